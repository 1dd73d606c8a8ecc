"""The GPT layers: causal self-attention, the MLP, the pre-norm Block, token input, tied head.

Leaf module: imports numpy, ``meta_dist.xp`` and ``meta_dist.nn`` (``layers``, ``norm``,
``embedding``, ``dropout``, ``composite``, ``grad_blocks``) only; ``meta_dist.models`` and the
tests import it. Each layer but TiedHead is a ``Composite`` of the simpler layers, and all follow
the ``Layer`` contract and run unchanged on numpy or CuPy.

The shapes follow nanoGPT's model.py (https://github.com/karpathy/nanoGPT), attention is
"Attention Is All You Need" (arXiv 1706.03762, section 3.2.1) with a causal mask.
"""

from __future__ import annotations

import math
import types

import numpy as np

from meta_dist.nn.composite import Composite
from meta_dist.nn.dropout import Dropout, derive_seed
from meta_dist.nn.embedding import Embedding
from meta_dist.nn.grad_blocks import sum_rows, write_grad
from meta_dist.nn.layers import GELU, Layer, Linear, _check_last_axis, _matmul_into, _positive
from meta_dist.nn.norm import LayerNorm
from meta_dist.xp import array_module


class CausalScaledDotProduct(Composite):
    """``softmax(q k^T / sqrt(head_dim) + causal mask) v`` per head, q, k, v packed on input.

    Input (B, T, 3C) holds q, k, v one after the other on the last axis, each (B, T, C) split
    into n_head heads of C / n_head (nanoGPT's ``split`` and ``view``); output is (B, T, C),
    the heads side by side. The attention probabilities go through ``attn_dropout``. Keeps the
    (B, n_head, T, T) probabilities for backward. No parameters.
    """

    def __init__(self, n_embd: int, n_head: int, *, dropout: float = 0.0, seed: int = 0) -> None:
        """Create the layer.

        Args:
            n_embd: C, the width of q, k and v.
            n_head: number of heads; must divide n_embd.
            dropout: drop probability of the attention probabilities.
            seed: seed of the dropout masks.

        Raises:
            ValueError: n_head does not divide n_embd (or a size is not positive).
        """
        super().__init__(attn_dropout=Dropout(dropout, seed=seed))
        self.n_embd = _positive("CausalScaledDotProduct", "n_embd", n_embd)
        self.n_head = _positive("CausalScaledDotProduct", "n_head", n_head)
        if n_embd % n_head:
            raise ValueError(f"CausalScaledDotProduct: n_head does not divide n_embd; got "
                             f"n_embd={n_embd}, n_head={n_head}, expected n_embd % n_head == 0")
        self.scale = 1.0 / math.sqrt(n_embd // n_head)
        self.q = self.k = self.v = self.probs = self.dropped = None

    def _heads(self, x, parts: int):
        """View (B, T, parts*C) as (parts, B, n_head, T, head_dim); no copy."""
        b, t, _ = x.shape
        return x.reshape(b, t, parts, self.n_head, -1).transpose(2, 0, 3, 1, 4)

    def forward(self, qkv):
        """Return the attention output (B, T, C).

        Raises:
            ValueError: qkv is not (B, T, 3 * n_embd).
        """
        if qkv.ndim != 3 or qkv.shape[-1] != 3 * self.n_embd:
            raise ValueError(f"CausalScaledDotProduct.forward: input has the wrong shape; got "
                             f"{tuple(qkv.shape)}, expected (B, T, {3 * self.n_embd})")
        xp = array_module(qkv)
        b, t, _ = qkv.shape
        self.q, self.k, self.v = self._heads(qkv, 3)
        # q scaled first: float16's q.k overflows long before the scaled score would
        scores = xp.matmul(self.q * self.q.dtype.type(self.scale), self.k.swapaxes(-1, -2))
        scores[..., ~xp.tri(t, dtype=bool)] = -xp.inf  # position i sees j <= i only
        scores -= scores.max(axis=-1, keepdims=True)  # the diagonal is never masked: finite max
        probs = xp.exp(scores, out=scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        self.probs = probs
        self.dropped = self.attn_dropout.forward(probs)
        out = xp.matmul(self.dropped, self.v)  # (B, H, T, D)
        return out.transpose(0, 2, 1, 3).reshape(b, t, self.n_embd)

    def backward(self, dout):
        """Return d(qkv) (B, T, 3C) through the softmax, the mask and the dropout."""
        xp = array_module(dout)
        b, t, _ = dout.shape
        dy = self._heads(dout, 1)[0]  # (B, H, T, D)
        dqkv = xp.empty((b, t, 3 * self.n_embd), dtype=dout.dtype)
        dq, dk, dv = self._heads(dqkv, 3)
        dv[...] = xp.matmul(self.dropped.swapaxes(-1, -2), dy)
        dprobs = self.attn_dropout.backward(xp.matmul(dy, self.v.swapaxes(-1, -2)))
        # softmax: ds = p * (dp - sum(dp * p)); masked entries have p == 0, so ds == 0 there
        dscores = dprobs - (dprobs * self.probs).sum(axis=-1, keepdims=True)
        dscores *= self.probs
        dscores *= self.scale
        dq[...] = xp.matmul(dscores, self.k)
        dk[...] = xp.matmul(dscores.swapaxes(-1, -2), self.q)
        return dqkv


class CausalSelfAttention(Composite):
    """nanoGPT's multi-head causal self-attention: c_attn -> attention -> c_proj -> dropout.

    ``c_attn`` projects (B, T, C) to q, k, v at once (weight (C, 3C), stored (in, out) like
    ``Linear``); ``c_proj`` (C, C) mixes the heads.
    """

    def __init__(self, n_embd: int, n_head: int, *, rng: np.random.Generator,
                 dropout: float = 0.0, bias: bool = True, dtype=np.float32,
                 xp: types.ModuleType = np, seed: int = 0) -> None:
        """Create the layer, the Linear layers with PyTorch's default initialisation.

        Args:
            n_embd: C, the model width.
            n_head: number of heads; must divide n_embd.
            rng: host generator for the initial weights.
            dropout: drop probability of the attention probabilities and of the output.
            bias: whether c_attn and c_proj add a bias.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.
            seed: seed of the dropout masks.

        Raises:
            ValueError: n_head does not divide n_embd, or a size or dropout is out of range.
        """
        kw = {"bias": bias, "rng": rng, "dtype": dtype, "xp": xp}
        super().__init__(
            c_attn=Linear(n_embd, 3 * n_embd, **kw),
            attend=CausalScaledDotProduct(n_embd, n_head, dropout=dropout,
                                          seed=derive_seed(seed, 0)),
            c_proj=Linear(n_embd, n_embd, **kw),
            resid_dropout=Dropout(dropout, seed=derive_seed(seed, 1)),
        )


class MLP(Composite):
    """nanoGPT's feed-forward part: c_fc (C -> 4C) -> GELU (tanh form) -> c_proj -> dropout."""

    def __init__(self, n_embd: int, *, rng: np.random.Generator, dropout: float = 0.0,
                 bias: bool = True, dtype=np.float32, xp: types.ModuleType = np,
                 seed: int = 0) -> None:
        """Create the layer; arguments as for ``CausalSelfAttention``."""
        kw = {"bias": bias, "rng": rng, "dtype": dtype, "xp": xp}
        super().__init__(c_fc=Linear(n_embd, 4 * n_embd, **kw), gelu=GELU(),
                         c_proj=Linear(4 * n_embd, n_embd, **kw),
                         dropout=Dropout(dropout, seed=seed))


class Block(Composite):
    """nanoGPT's pre-norm block: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, *, rng: np.random.Generator,
                 dropout: float = 0.0, bias: bool = True, dtype=np.float32,
                 xp: types.ModuleType = np, seed: int = 0) -> None:
        """Create the block; arguments as for ``CausalSelfAttention``."""
        kw = {"rng": rng, "dropout": dropout, "bias": bias, "dtype": dtype, "xp": xp}
        super().__init__(
            ln_1=LayerNorm(n_embd, dtype=dtype, xp=xp),
            attn=CausalSelfAttention(n_embd, n_head, seed=derive_seed(seed, 0), **kw),
            ln_2=LayerNorm(n_embd, dtype=dtype, xp=xp),
            mlp=MLP(n_embd, seed=derive_seed(seed, 1), **kw),
        )

    def forward(self, x):
        """Return the block's output (B, T, C)."""
        x = x + self.attn.forward(self.ln_1.forward(x))
        return x + self.mlp.forward(self.ln_2.forward(x))

    def backward(self, dout):
        """Write the grads (mlp, ln_2, attn, ln_1: the order of ``params``); return dx."""
        dmid = dout + self.ln_2.backward(self.mlp.backward(dout))
        dattn = self.ln_1.backward(self.attn.backward(dmid))
        return None if dattn is None else dmid + dattn


class TokenAndPosition(Composite):
    """nanoGPT's input: ``dropout(wte[ids] + wpe[0..T-1])`` for token ids (B, T)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, *,
                 rng: np.random.Generator, dropout: float = 0.0, dtype=np.float32,
                 xp: types.ModuleType = np, seed: int = 0) -> None:
        """Create both tables (N(0, 1), as ``Embedding``) and the dropout.

        Args:
            vocab_size: rows of the token table wte.
            block_size: rows of the position table wpe, the longest sequence.
            n_embd: width of both tables.
            rng: host generator for the initial values.
            dropout: drop probability of the sum.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.
            seed: seed of the dropout masks.
        """
        kw = {"rng": rng, "dtype": dtype, "xp": xp}
        super().__init__(wte=Embedding(vocab_size, n_embd, **kw),
                         wpe=Embedding(block_size, n_embd, **kw),
                         drop=Dropout(dropout, seed=derive_seed(seed, 0)))
        self.block_size = block_size

    def forward(self, ids):
        """Return the embedded tokens (B, T, n_embd).

        Raises:
            ValueError: ids are not (B, T) with T <= block_size.
        """
        if ids.ndim != 2 or not 0 < ids.shape[1] <= self.block_size:
            raise ValueError(f"TokenAndPosition.forward: ids have the wrong shape; got "
                             f"{tuple(ids.shape)}, expected (B, T) with 1 <= T <= "
                             f"{self.block_size} (block_size)")
        positions = array_module(ids).arange(ids.shape[1])
        return self.drop.forward(self.wte.forward(ids) + self.wpe.forward(positions))

    def backward(self, dout):
        """Write dwpe (summed over the batch) then dwte; return None (ids have no gradient)."""
        dsum = self.drop.backward(dout)
        self.wpe.backward(sum_rows(dsum))
        self.wte.backward(dsum)


class TiedHead(Layer):
    """Language-model head ``x @ weight.T`` sharing its weight with an Embedding (no bias).

    ``params["weight"]`` is the embedding's weight array itself: the training machinery finds
    the tie by identity, keeps one parameter, and adds this layer's gradient to the owner's.
    Until then ``grads["weight"]`` is this layer's own zeros, not the embedding's.
    """

    grad_rows = True

    def __init__(self, embedding: Embedding) -> None:
        """Tie to ``embedding``'s weight (V, C).

        Raises:
            TypeError: embedding is not an Embedding.
        """
        super().__init__()
        if not isinstance(embedding, Embedding):
            raise TypeError(f"TiedHead: embedding has the wrong type; got "
                            f"{type(embedding).__name__}, expected Embedding")
        weight = embedding.params["weight"]
        self.params["weight"] = weight
        self.grads["weight"] = array_module(weight).zeros(weight.shape, dtype=weight.dtype)
        self.x = None

    def forward(self, x):
        """Return the logits ``x @ weight.T`` (..., V); keeps x.

        Raises:
            ValueError: the last axis of x is not the embedding width.
        """
        _check_last_axis("TiedHead.forward", x, self.params["weight"].shape[1])
        self.x = x
        return x @ self.params["weight"].T

    def backward(self, dout):
        """Write dweight = dout.T @ x in place; return dout @ weight."""
        vocab, width = self.params["weight"].shape
        x2 = self.x.reshape(-1, width)
        d2 = dout.reshape(-1, vocab)
        write_grad(self.grads["weight"], lambda first, stop, out: _matmul_into(
            d2[:, first:stop].T, x2, out))
        if not self.input_grad:
            return None
        return dout @ self.params["weight"]
