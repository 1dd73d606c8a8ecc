"""Transformer layers: Embedding, LayerNorm, Dropout, causal self-attention and the GPT block.

Leaf module: imports numpy, ``meta_dist.xp`` and ``meta_dist.nn.layers`` (with its
``grad_blocks``) only; ``meta_dist.models`` and the tests import it. The layers follow the
``Layer`` contract and run unchanged on numpy or CuPy. ``Composite`` builds one layer from named
child layers, whose parameters it shows under qualified names ("attn.c_attn.weight").

The shapes follow nanoGPT's model.py (https://github.com/karpathy/nanoGPT), attention is
"Attention Is All You Need" (arXiv 1706.03762, section 3.2.1) with a causal mask.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Iterator, MutableMapping

import numpy as np

from meta_dist.nn.grad_blocks import write_grad
from meta_dist.nn.init import draw
from meta_dist.nn.layers import (
    GELU,
    Layer,
    Linear,
    _check_last_axis,
    _matmul_into,
    _positive,
)
from meta_dist.xp import array_module, is_cupy_array


RESERVED_NAMES = frozenset({"params", "grads", "children"})  # set by Composite.__init__


def draw_normal(rng: np.random.Generator, std: float, shape: tuple[int, ...],
                dtype=np.float32) -> np.ndarray:
    """Draw N(0, std**2) on the host in blocks, as ``layers._uniform`` draws U(-k, k).

    Args:
        rng: host generator; every rank with the same seed draws the same values.
        std: standard deviation.
        shape: shape of the result.
        dtype: dtype of the result (each block is cast as it is drawn).

    Returns:
        A numpy array of ``shape`` and ``dtype`` (DeferredValues inside ``nn.init.deferred``).
    """
    return draw(rng, "normal", std, shape, dtype)


def derive_seed(seed: int, *path: int) -> int:
    """Return the seed of a sub-layer: a 64-bit hash of ``(seed, *path)``, distinct per path."""
    return int(np.random.SeedSequence([seed, *path]).generate_state(1, np.uint64)[0])


def _seed(api: str, name: str, value) -> int:
    """Return ``value`` if it is an int >= 0 (a SeedSequence entropy word), else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name} has the wrong type; got {value!r}, expected an int")
    if value < 0:
        raise ValueError(f"{api}: {name} is negative; got {value}, expected >= 0")
    return int(value)


def _scatter_add(out, ids, rows) -> None:
    """Add ``rows[i]`` to ``out[ids[i]]`` for every i, repeated ids accumulating."""
    if is_cupy_array(out):
        import cupyx

        cupyx.scatter_add(out, ids, rows)
    else:
        np.add.at(out, ids, rows)


class Embedding(Layer):
    """Lookup table ``weight[ids]``, weight of shape (num_embeddings, embedding_dim)."""

    grad_rows = True

    def __init__(self, num_embeddings: int, embedding_dim: int, *, rng: np.random.Generator,
                 dtype=np.float32, xp: types.ModuleType = np) -> None:
        """Create the table with PyTorch's initialisation, weight ~ N(0, 1).

        Args:
            num_embeddings: number of rows (the vocabulary or the positions).
            embedding_dim: size of each row.
            rng: host generator for the initial values.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: a size is not an int.
            ValueError: a size is not positive.
        """
        super().__init__()
        self.num_embeddings = _positive("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = _positive("Embedding", "embedding_dim", embedding_dim)
        shape = (num_embeddings, embedding_dim)
        self._add_param("weight", draw_normal(rng, 1.0, shape, dtype), dtype, xp)
        self.ids = None

    def forward(self, ids):
        """Return ``weight[ids]`` of shape ``ids.shape + (embedding_dim,)``; keeps the ids.

        Raises:
            TypeError: ids are not integers.
            ValueError: (host arrays only) an id is outside [0, num_embeddings).
        """
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"Embedding.forward: ids must be integers; got dtype {ids.dtype}, "
                            f"expected an integer dtype")
        # Reading the ids back is a host sync on the GPU, so the range is checked on the host only.
        if ids.size and not is_cupy_array(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(f"Embedding.forward: id out of range; got ids in [{low}, {high}],"
                                 f" expected every id in [0, {self.num_embeddings - 1}]")
        self.ids = ids
        return self.params["weight"][ids]

    def backward(self, dout):
        """Write the scatter-add of ``dout`` into the rows of dweight; return None (ids)."""
        ids = self.ids.reshape(-1)
        rows = dout.reshape(-1, self.embedding_dim)

        def rows_into(first: int, stop: int, out) -> None:
            out[...] = 0
            if first == 0 and stop == self.num_embeddings:
                _scatter_add(out, ids, rows)
            else:  # one block of a GradBlocks: only the ids that fall in it
                inside = (ids >= first) & (ids < stop)
                _scatter_add(out, ids[inside] - first, rows[inside])

        write_grad(self.grads["weight"], rows_into)
        return None


class LayerNorm(Layer):
    """Layer normalisation over the last axis: ``weight * (x - mean) / sqrt(var + eps) + bias``.

    The variance is the biased one, as in ``torch.nn.LayerNorm``.
    """

    grad_rows = True

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=np.float32,
                 xp: types.ModuleType = np) -> None:
        """Create the layer with weight 1 and bias 0.

        Args:
            dim: size of the last axis.
            eps: added to the variance before the square root, > 0.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: dim is not an int.
            ValueError: dim or eps is not positive.
        """
        super().__init__()
        self.dim = _positive("LayerNorm", "dim", dim)
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps is not positive; got {eps}, expected > 0")
        self.eps = eps
        self._add_param("weight", np.ones(dim), dtype, xp)
        self._add_param("bias", np.zeros(dim), dtype, xp)
        self.xhat = None
        self.inv_std = None

    def forward(self, x):
        """Return the normalised ``x``; keeps xhat and 1/std for backward.

        Raises:
            ValueError: the last axis of x is not dim.
        """
        _check_last_axis("LayerNorm.forward", x, self.dim)
        xp = array_module(x)
        centered = x - x.mean(axis=-1, keepdims=True)
        var = (centered * centered).mean(axis=-1, keepdims=True)
        self.inv_std = 1.0 / xp.sqrt(var + self.eps)
        self.xhat = centered * self.inv_std
        return self.xhat * self.params["weight"] + self.params["bias"]

    def backward(self, dout):
        """Write dweight and dbias in place; return dx (None when ``input_grad`` is False)."""
        d2 = dout.reshape(-1, self.dim)
        xhat2 = self.xhat.reshape(-1, self.dim)
        write_grad(self.grads["weight"], lambda first, stop, out: (
            d2[:, first:stop] * xhat2[:, first:stop]).sum(axis=0, out=out))
        write_grad(self.grads["bias"],
                   lambda first, stop, out: d2[:, first:stop].sum(axis=0, out=out))
        if not self.input_grad:
            return None
        # dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std, means over the last axis
        dxhat = dout * self.params["weight"]
        return self.inv_std * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                               - self.xhat * (dxhat * self.xhat).mean(axis=-1, keepdims=True))


class Dropout(Layer):
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    Reproducible: the mask of the n-th training forward is drawn on the host by
    ``np.random.default_rng([seed, rank, n])``, so it depends on nothing but those three numbers
    (not on the array module, the dtype or other layers). ``calls`` is n; ``rank`` may be
    changed before training so that data-parallel ranks drop different elements. On a GPU the
    mask is copied to the device each call (host work and a transfer of x.size floats).
    Identity when p == 0 or in eval mode.
    """

    def __init__(self, p: float, *, seed: int, rank: int = 0) -> None:
        """Create the layer.

        Args:
            p: probability of zeroing an element, in [0, 1).
            seed: int >= 0; layers of one model need different seeds (see ``derive_seed``).
            rank: int >= 0, this process's rank.

        Raises:
            TypeError: p is not a real number, or seed or rank is not an int.
            ValueError: p is outside [0, 1), or seed or rank is negative.
        """
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)):
            raise TypeError(f"Dropout: p has the wrong type; got {p!r}, expected a float")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p out of range; got {p}, expected 0 <= p < 1 "
                             f"(the probability of zeroing an element; p = 1 would drop all)")
        self.p = float(p)
        self.seed = _seed("Dropout", "seed", seed)
        self.rank = _seed("Dropout", "rank", rank)
        self.calls = 0
        self.mask = None

    def forward(self, x):
        """Return ``x * mask / (1 - p)`` in training (a fresh mask per call), else ``x``."""
        if self.p == 0.0 or not self.training:
            self.mask = None
            return x
        rng = np.random.default_rng([self.seed, self.rank, self.calls])
        self.calls += 1
        keep = rng.random(tuple(x.shape), dtype=np.float32) >= self.p
        self.mask = array_module(x).asarray(keep.astype(x.dtype) * x.dtype.type(1 / (1 - self.p)))
        return x * self.mask

    def backward(self, dout):
        """Return ``dout`` through the mask of the last forward."""
        return dout if self.mask is None else dout * self.mask


class ChildParams(MutableMapping):
    """The ``params`` (or ``grads``) of a Composite: the children's, under qualified names.

    Reads and writes go through to the child's own dict, so rebinding
    ``block.params["attn.c_attn.weight"]`` rebinds ``block.attn.c_attn.params["weight"]``.
    Names are listed in the order backward writes them: children last to first. Names cannot
    be added or removed.
    """

    def __init__(self, children: dict[str, Layer], kind: str) -> None:
        self._children, self._kind = children, kind

    def _locate(self, key: str) -> tuple[MutableMapping, str]:
        head, _, rest = key.partition(".")
        child = self._children.get(head)
        if child is None or rest not in getattr(child, self._kind):
            raise KeyError(f"Composite.{self._kind}: no parameter {key!r}; expected one of "
                           f"{', '.join(self)}")
        return getattr(child, self._kind), rest

    def __getitem__(self, key: str):
        table, rest = self._locate(key)
        return table[rest]

    def __setitem__(self, key: str, value) -> None:
        table, rest = self._locate(key)
        table[rest] = value

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"Composite.{self._kind}: cannot remove {key!r}; a layer's parameters "
                        f"are fixed when it is built")

    def __iter__(self) -> Iterator[str]:
        for name, child in reversed(self._children.items()):
            for rest in getattr(child, self._kind):
                yield f"{name}.{rest}"

    def __len__(self) -> int:
        return sum(len(getattr(child, self._kind)) for child in self._children.values())

    def __repr__(self) -> str:
        return f"ChildParams({self._kind}: {', '.join(self)})"


class Composite(Layer):
    """A layer made of named child layers, run in order by default (last to first in backward).

    ``params`` and ``grads`` are ``ChildParams`` views of the children's. Setting ``training``
    sets it on every child; setting ``input_grad`` sets it on the first child, the one that
    sees the input. Subclasses with another data flow (residuals) override forward/backward and
    must write the children's grads last child first, the order of ``params``. Children may not
    hold buffers (BatchNorm's running statistics): the trainer looks for those on the model's
    own layers only.
    """

    def __init__(self, **children: Layer) -> None:
        """Adopt ``children`` (keyword order is forward order) as attributes of the same name.

        Raises:
            TypeError: a child is not a Layer.
            ValueError: no children, or a child holds buffers.
        """
        api = type(self).__name__
        if not children:
            raise ValueError(f"{api}: no child layers; got none, expected at least one")
        for name, child in children.items():
            if not isinstance(child, Layer):
                raise TypeError(f"{api}: child {name!r} is not a Layer; got "
                                f"{type(child).__name__}")
            if name in RESERVED_NAMES or hasattr(type(self), name):
                raise ValueError(f"{api}: child name {name!r} is taken by an attribute of the "
                                 f"layer; expected another name")
            if child.buffer_names:
                raise ValueError(f"{api}: child {name!r} holds buffers {child.buffer_names}; "
                                 f"expected none; put that layer in the Sequential directly")
        self.children = dict(children)
        self.__dict__.update(children)
        super().__init__()
        self.params = ChildParams(self.children, "params")
        self.grads = ChildParams(self.children, "grads")

    @property
    def training(self) -> bool:
        """Training mode; setting it sets every child's."""
        return self._training

    @training.setter
    def training(self, mode: bool) -> None:
        self._training = mode
        for child in self.children.values():
            child.training = mode

    @property
    def input_grad(self) -> bool:
        """Whether backward returns dx; setting it sets the first child's."""
        return self._input_grad

    @input_grad.setter
    def input_grad(self, value: bool) -> None:
        self._input_grad = value
        next(iter(self.children.values())).input_grad = value

    @property
    def grad_rows(self) -> bool:
        """True when every child with parameters writes its grads by rows (``write_grad``)."""
        return all(child.grad_rows for child in self.children.values() if len(child.params))

    def named_leaves(self, prefix: str = "") -> Iterator[tuple[str, Layer]]:
        """Yield (qualified name, layer) for every non-Composite descendant, in forward order."""
        for name, child in self.children.items():
            if isinstance(child, Composite):
                yield from child.named_leaves(f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", child

    def forward(self, x):
        """Return the children applied in order."""
        for child in self.children.values():
            x = child.forward(x)
        return x

    def backward(self, dout):
        """Backpropagate through the children last to first; return dx (or None)."""
        for child in reversed(self.children.values()):
            dout = child.backward(dout)
        return dout


def set_dropout_rank(layers: Iterable[Layer], rank: int) -> None:
    """Set ``rank`` on every Dropout among ``layers`` and their descendants.

    Args:
        layers: e.g. ``Sequential.layers``.
        rank: this process's rank, so that ranks draw different masks.
    """
    for layer in layers:
        leaves = layer.named_leaves() if isinstance(layer, Composite) else [("", layer)]
        for _, leaf in leaves:
            if isinstance(leaf, Dropout):
                leaf.rank = _seed("set_dropout_rank", "rank", rank)


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
        scores = xp.matmul(self.q, self.k.swapaxes(-1, -2))  # (B, H, T, T)
        scores *= self.scale
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
        self.wpe.backward(dsum.sum(axis=0))
        self.wte.backward(dsum)
        return None


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
