"""cupyx of the stand-in: page-locked host arrays (``empty_pinned`` and friends).

Imports numpy and the stand-in's cupy._memory. Mirrors cupyx/_pinned_array.py
(https://docs.cupy.dev/en/stable/reference/generated/cupyx.empty_pinned.html): each function
returns a numpy array on pinned memory. The stand-in remembers which memory is pinned: copies
to and from it are truly asynchronous (``get(out=..., blocking=False)``, ``set``,
``cupy.asarray``), so the host must synchronise before reading or rewriting it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from cupy import _memory
from cupy._ndarray import ndarray

__standin__ = True
__all__ = ["empty_like_pinned", "empty_pinned", "zeros_like_pinned", "zeros_pinned"]


def empty_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    """Return an uninitialised numpy array in pinned memory."""
    array = np.empty(shape, dtype, order)
    _memory.register_pinned(array)
    return array


def zeros_pinned(shape: Any, dtype: Any = float, order: str = "C") -> np.ndarray:
    """Return a numpy array of zeros in pinned memory."""
    array = empty_pinned(shape, dtype, order)
    array[...] = 0
    return array


def _like(a: Any, dtype: Any, order: str, shape: Any) -> tuple[Any, Any, str]:
    if not isinstance(a, (np.ndarray, ndarray)):
        raise TypeError(f"expected a numpy or cupy array; got {type(a).__name__}")
    order = "F" if order in ("F", "A", "K") and a.flags.f_contiguous and a.ndim > 1 else "C"
    return (a.shape if shape is None else shape), (a.dtype if dtype is None else dtype), order


def empty_like_pinned(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
                      shape: Any = None) -> np.ndarray:
    """Return an uninitialised pinned numpy array shaped like ``a``."""
    return empty_pinned(*_like(a, dtype, order, shape))


def zeros_like_pinned(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
                      shape: Any = None) -> np.ndarray:
    """Return a pinned numpy array of zeros shaped like ``a``."""
    return zeros_pinned(*_like(a, dtype, order, shape))
