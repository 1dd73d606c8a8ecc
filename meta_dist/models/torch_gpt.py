"""The GPT in PyTorch, written out from nanoGPT's model.py: the oracle's and the benchmark's twin.

Needs torch (the ``bench`` extra); nothing in meta_dist's training path imports this module. The
oracle tests (tests/unit/test_torch_oracle.py) compare meta_dist's GPT with ``TorchGPT`` step by
step; `bench train --model gpt` times both under the same data and weights. ``twin`` copies a
meta_dist GPT's weights into a ``TorchGPT``.

One deliberate difference from nanoGPT: the MLP's GELU is the tanh form (GPT-2's), because
meta_dist's is; the oracle pins the gap between the two forms.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from meta_dist.nn.layers import Linear
from meta_dist.nn.model import Sequential
from meta_dist.nn.transformer import Block, TiedHead, TokenAndPosition

LINEAR_WEIGHTS = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


class TorchAttention(nn.Module):
    """Causal self-attention: nanoGPT's explicit form (masked softmax, no fused kernel)."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        """Causal self-attention of ``x`` (batch, time, channels)."""
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(),
                              float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class TorchMLP(nn.Module):
    """Linear(4x) -> GELU (tanh form) -> Linear."""

    def __init__(self, n_embd):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.gelu = nn.GELU(approximate="tanh")

    def forward(self, x):
        """Apply the MLP to ``x``."""
        return self.c_proj(self.gelu(self.c_fc(x)))


class TorchBlock(nn.Module):
    """Pre-norm residual block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = TorchAttention(n_embd, n_head), TorchMLP(n_embd)

    def forward(self, x):
        """Apply the block to ``x``."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """Token and position embeddings, blocks, final LayerNorm, head tied to the token table."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(TorchBlock(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def forward(self, idx):
        """Return the logits (batch, time, vocab) for token ids ``idx`` (batch, time)."""
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def is_linear_weight(layer, name: str) -> bool:
    """meta_dist's Linear stores its weight (in, out), torch's (out, in): one transposes."""
    return isinstance(layer, Linear) and name == "weight" or name.endswith(LINEAR_WEIGHTS)


def gpt_names(model: Sequential) -> dict:
    """Map each TorchGPT parameter name to (meta_dist layer, name); the tied head is left out."""
    names = {}
    for i, layer in enumerate(model.layers):
        for name in layer.params:
            if isinstance(layer, TiedHead):
                continue  # the same array as wte.weight
            if isinstance(layer, TokenAndPosition):
                names[name] = (layer, name)
            elif isinstance(layer, Block):
                names[f"h.{i - 1}.{name}"] = (layer, name)
            else:
                names[f"ln_f.{name}"] = (layer, name)
    return names


def twin(model: Sequential, vocab_size: int, block_size: int, n_layer: int, n_head: int,
         n_embd: int) -> TorchGPT:
    """Return a TorchGPT of ``model``'s shape and dtype holding copies of its weights.

    ``model`` is a meta_dist GPT built by ``meta_dist.models.gpt`` with the same sizes, on the
    host (numpy).
    """
    dtype = getattr(torch, model.layers[0].params["wte.weight"].dtype.name)
    torch_gpt = TorchGPT(vocab_size, block_size, n_layer, n_head, n_embd).to(dtype)
    with torch.no_grad():
        for torch_name, (layer, name) in gpt_names(model).items():
            value = layer.params[name]
            torch_gpt.get_parameter(torch_name).copy_(
                torch.from_numpy(value.T if is_linear_weight(layer, name) else value))
    return torch_gpt
