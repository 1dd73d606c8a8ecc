"""Initial values drawn on the host, now or when they are needed (``deferred``).

Leaf module: numpy only; the layer modules, ``zero``, ``train`` and ``meta_dist.models`` import it.
``draw(rng, kind, scale, shape, dtype)`` returns U(-scale, scale) ("uniform") or N(0, scale²)
("normal", or ``draw_normal``) values in blocks straight into ``dtype``: one float64
draw of a large layer (and numpy's temporary for the scaling) would take three times the
layer's memory for a moment. The values are those of one draw of the whole shape (the
generator's stream is sequential), so every rank with the same seed agrees.

Inside ``with deferred():`` a layer's parameters are DeferredValues instead: the generator's
state and the recipe, no memory. The caller's generator still advances past the values, so
later layers draw what they would have drawn. A Trainer at ZeRO level 3 then reads each
parameter a slice at a time (only its shards' rows) and never holds the model whole: a model
larger than one rank's memory can be built, as DeepSpeed's ``zero.Init`` builds it. Other
levels fill their full copy from the recipe, block by block.
"""

from __future__ import annotations

import contextvars
import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

INIT_BLOCK = 1 << 16  # elements drawn at a time
_DEFERRED = contextvars.ContextVar("meta_dist_deferred_init", default=False)


@contextmanager
def deferred() -> Iterator[None]:
    """Build layers inside this block with DeferredValues for their random parameters."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def _blocks(rng: np.random.Generator, kind: str, scale: float, n: int) -> Iterator[Any]:
    """Yield the float64 values in blocks of INIT_BLOCK (the last shorter)."""
    for start in range(0, n, INIT_BLOCK):
        size = min(INIT_BLOCK, n - start)
        yield (rng.uniform(-scale, scale, size=size) if kind == "uniform"
               else rng.normal(0.0, scale, size=size))


def draw(rng: np.random.Generator, kind: str, scale: float, shape: tuple[int, ...],
         dtype: Any = np.float32) -> Any:
    """Return the initial values (an array), or DeferredValues inside ``deferred()``."""
    if kind not in ("uniform", "normal"):
        raise ValueError(f"draw: unknown kind {kind!r}; expected 'uniform' or 'normal'")
    n = math.prod(shape)
    if _DEFERRED.get():
        values = DeferredValues(shape, dtype, (kind, scale, copy.deepcopy(
            rng.bit_generator.state)), type(rng.bit_generator))
        for _ in _blocks(rng, kind, scale, n):  # the caller's stream moves on as if drawn
            pass
        return values
    out = np.empty(shape, dtype)
    flat, at = out.reshape(-1), 0
    for block in _blocks(rng, kind, scale, n):
        flat[at : at + block.size] = block
        at += block.size
    return out


def draw_normal(rng: np.random.Generator, std: float, shape: tuple[int, ...],
                dtype=np.float32) -> np.ndarray:
    """Draw N(0, std**2) on the host in blocks: ``draw(rng, "normal", std, shape, dtype)``.

    Args:
        rng: host generator; every rank with the same seed draws the same values.
        std: standard deviation.
        shape: shape of the result.
        dtype: dtype of the result (each block is cast as it is drawn).

    Returns:
        A numpy array of ``shape`` and ``dtype`` (DeferredValues inside ``nn.init.deferred``).
    """
    return draw(rng, "normal", std, shape, dtype)


class DeferredValues:
    """A parameter's initial values as a recipe: read a slice of them when needed.

    Args:
        shape, dtype: the parameter's.
        recipe: ``(kind, scale, generator state)``, the same on ranks built alike; kind
            "zeros" (scale and state unused) for values set to zero after the draw.
        bit_generator: the generator's bit generator class (its state is set from the recipe).
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, recipe: tuple[str, float, Any],
                 bit_generator: type) -> None:
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size, self.ndim = math.prod(self.shape), len(self.shape)
        self.recipe, self._bit_generator = recipe, bit_generator
        self.xp: Any = np  # where the values will live (Layer._add_param sets it)
        self._cursor: tuple[Any, int, tuple[int, Any] | None] | None = None

    def adopt(self, recipe: tuple[str, float, Any]) -> None:
        """Take another rank's recipe (the trainer gives every rank rank 0's)."""
        self.recipe, self._cursor = recipe, None

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Return flat elements ``[lo, hi)`` in ``dtype``.

        Reading upwards costs one draw per element in all; reading below the last read starts
        the stream again.
        """
        kind, scale, state = self.recipe
        if kind == "zeros":
            return np.zeros(hi - lo, self.dtype)
        if self._cursor is None or lo < (self._cursor[2][0] if self._cursor[2] else
                                         self._cursor[1]):  # below what the cursor holds
            rng = np.random.Generator(self._bit_generator())
            rng.bit_generator.state = copy.deepcopy(state)
            self._cursor = (rng, 0, None)
        rng, pos, last = self._cursor
        out = np.empty(hi - lo, self.dtype)
        at = lo
        if last is not None and last[0] <= at < pos:  # the block drawn last covers the start
            stop = min(hi, pos)
            out[: stop - lo] = last[1][at - last[0] : stop - last[0]]
            at = stop
        while at < hi:
            start, block = pos, next(_blocks(rng, kind, scale, min(INIT_BLOCK, self.size - pos)))
            pos += block.size
            if pos > at:
                stop = min(hi, pos)
                out[at - lo : stop - lo] = block[at - start : stop - start]
                at = stop
            last = (start, block)
        self._cursor = (rng, pos, last)
        return out

    def fill(self, target: Any, xp: Any = np) -> None:
        """Write every value into ``target`` (an array of this shape, on ``xp``), in blocks."""
        flat = target.reshape(-1)
        for start in range(0, self.size, INIT_BLOCK):
            stop = min(start + INIT_BLOCK, self.size)
            flat[start:stop] = xp.asarray(self.read(start, stop))
