"""GPT-2-style decoder as a ``Sequential``, built and initialised like nanoGPT.

Imports numpy, ``meta_dist.xp`` and ``meta_dist.nn`` only; the trainer and the tests import it.
Architecture and initialisation: nanoGPT's model.py (https://github.com/karpathy/nanoGPT),
itself GPT-2 (Radford et al. 2019).
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator

import numpy as np

from meta_dist.nn.composite import Composite
from meta_dist.nn.dropout import derive_seed
from meta_dist.nn.embedding import Embedding
from meta_dist.nn.init import DeferredValues, draw_normal
from meta_dist.nn.layers import Layer, Linear
from meta_dist.nn.model import Sequential
from meta_dist.nn.norm import LayerNorm
from meta_dist.nn.transformer import Block, TiedHead, TokenAndPosition

INIT_STD = 0.02  # nanoGPT's (and GPT-2's) standard deviation of weights and embeddings


def gpt(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, *,
        dropout: float = 0.0, seed: int = 0, dtype=np.float32,
        xp: types.ModuleType = np) -> Sequential:
    """Build ``Sequential(TokenAndPosition, Block x n_layer, LayerNorm, TiedHead)``.

    Initialised as nanoGPT's ``GPT._init_weights``: every Linear weight and both embedding
    tables ~ N(0, 0.02), the two ``c_proj`` weights of each block (attention and MLP outputs,
    which add onto the residual stream) ~ N(0, 0.02 / sqrt(2 * n_layer)), biases 0, LayerNorms
    weight 1 and bias 0. The head shares the token table wte (weight tying). The values are
    drawn on the host from ``np.random.default_rng(seed)``, layer by layer in forward order, so
    every rank with the same seed builds the same model. Input: token ids (B, T), T <=
    block_size; output: logits (B, T, vocab_size), for ``losses.cross_entropy_tokens``.

    Args:
        vocab_size: number of tokens.
        block_size: longest sequence (rows of the position table).
        n_layer: number of blocks.
        n_head: attention heads per block; must divide n_embd.
        n_embd: model width.
        dropout: drop probability after the embeddings, on the attention probabilities and
            after each residual branch; dropout masks are seeded from ``seed`` (see
            ``nn.dropout.Dropout``; the Trainer sets each rank's and numbers the forwards).
        seed: seed of the initial values and of the dropout masks.
        dtype: parameter dtype.
        xp: array module (numpy or cupy) the parameters live on.

    Returns:
        The model.

    Raises:
        ValueError: a size is not positive, n_head does not divide n_embd, or dropout is
            outside [0, 1).
    """
    rng = np.random.default_rng(seed)
    kw = {"rng": rng, "dropout": dropout, "dtype": dtype, "xp": xp}
    tokens = TokenAndPosition(vocab_size, block_size, n_embd, seed=derive_seed(seed, 0), **kw)
    blocks = [Block(n_embd, n_head, seed=derive_seed(seed, 1 + i), **kw) for i in range(n_layer)]
    model = Sequential(tokens, *blocks, LayerNorm(n_embd, dtype=dtype, xp=xp),
                       TiedHead(tokens.wte))
    # The constructors drew PyTorch's default values (their rng draws are spent, not used);
    # the nanoGPT values overwrite them in place, so the arrays stay the ones layers hold.
    residual_std = INIT_STD / math.sqrt(2 * n_layer)
    for name, leaf in _named_leaves(model):
        if isinstance(leaf, (Linear, Embedding)):
            std = residual_std if name.endswith("c_proj") else INIT_STD
            weight = leaf.params["weight"]
            values = draw_normal(rng, std, weight.shape, weight.dtype)
            if isinstance(weight, DeferredValues):  # the same object: ties hold it by identity
                weight.adopt(values.recipe)
            else:
                weight[...] = xp.asarray(values)
        if isinstance(leaf, Linear) and "bias" in leaf.params:
            bias = leaf.params["bias"]
            if isinstance(bias, DeferredValues):
                bias.adopt(("zeros", 0.0, None))
            else:
                bias[...] = 0
    return model


def _named_leaves(model: Sequential) -> Iterator[tuple[str, Layer]]:
    """Yield (name, layer) for every layer of ``model``, Composites opened, in forward order."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer, Composite):
            yield from layer.named_leaves(f"{i}.")
        else:
            yield str(i), layer
