"""Dropout, its masks drawn from (seed, rank, call), and the seeds that keep dropouts apart.

Leaf module: imports numpy, ``meta_dist.xp``, ``nn.layers`` and ``nn.composite`` only;
``nn.transformer``, ``meta_dist.models``, the trainer and the tests import it. ``derive_seed``
gives each sub-layer its own seed; ``set_dropout_rank`` sets the rank of every Dropout in a
model, Composites opened, so that data-parallel ranks drop different elements, and
``number_forward`` numbers the next training forward, so that a run resumed from a checkpoint
draws the masks the uninterrupted one drew (the trainer calls both).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from meta_dist.nn.composite import Composite
from meta_dist.nn.layers import Layer
from meta_dist.xp import array_module


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


class Dropout(Layer):
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    Reproducible: the mask of the n-th training forward is drawn on the host by
    ``np.random.default_rng([seed, rank, n])``, so it depends on nothing but those three numbers
    (not on the array module, the dtype or other layers). ``calls`` is n, counted from 0 or
    from what ``number_forward`` set; ``rank`` may be changed before training so that
    data-parallel ranks drop different elements. On a GPU the mask is copied to the device each
    call (host work and a transfer of x.size floats). Identity when p == 0 or in eval mode.
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


FORWARD_STRIDE = 2**16  # mask numbers one numbered forward may use (calls of one Dropout in it)


def dropouts(layers: Iterable[Layer]) -> list[Dropout]:
    """Return every Dropout among ``layers`` and their descendants (Composites opened)."""
    found = []
    for layer in layers:
        leaves = layer.named_leaves() if isinstance(layer, Composite) else [("", layer)]
        found += [leaf for _, leaf in leaves if isinstance(leaf, Dropout)]
    return found


def set_dropout_rank(layers: Iterable[Layer], rank: int) -> None:
    """Set ``rank`` on every Dropout among ``layers`` and their descendants.

    Args:
        layers: e.g. ``Sequential.layers``.
        rank: this process's rank, so that ranks draw different masks.
    """
    for dropout in dropouts(layers):
        dropout.rank = _seed("set_dropout_rank", "rank", rank)


def number_forward(layers: Iterable[Dropout], number: int) -> None:
    """Number the next training forward of each of ``layers`` (``dropouts``' list).

    Its masks are drawn from ``calls`` ``number * FORWARD_STRIDE`` on. The trainer numbers
    each micro-batch by the step and its place in it, so the masks follow from the step alone,
    and a run resumed from a checkpoint draws what the uninterrupted run drew.
    """
    first = _seed("number_forward", "number", number) * FORWARD_STRIDE
    for dropout in layers:
        dropout.calls = first
