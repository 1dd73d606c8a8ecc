"""cupyx of the stand-in: page-locked host arrays (``empty_pinned`` and friends), scatter_add.

Imports numpy and the stand-in's cupy._memory, _kernel and _ndarray. Mirrors cupyx/_pinned_array.py
(https://docs.cupy.dev/en/stable/reference/generated/cupyx.empty_pinned.html): each function
returns a numpy array on pinned memory. The stand-in remembers which memory is pinned: copies
to and from it are truly asynchronous (``get(out=..., blocking=False)``, ``set``,
``cupy.asarray``), so the host must synchronise before reading or rewriting it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from cupy import _kernel, _memory
from cupy._ndarray import ndarray

__standin__ = True
__all__ = ["empty_like_pinned", "empty_pinned", "scatter_add", "zeros_like_pinned",
           "zeros_pinned"]
# the dtypes CuPy's add.at takes (cupy/_core/_routines_indexing.pyx, _scatter_op_single); CuPy
# 14.2 on an H200 raised for bfloat16: "cupy.add.at only supports int32, int64, float16,
# float32, float64, uint32, uint64 as data type"
SCATTER_ADD_DTYPES = ("int32", "int64", "float16", "float32", "float64", "uint32", "uint64")


def scatter_add(a: ndarray, slices: Any, value: Any) -> None:
    """Add ``value`` to ``a[slices]`` in a kernel, repeated indices accumulating (np.add.at).

    Only what meta_dist uses is modeled (stricter than CuPy): ``slices`` one integer device
    array, ``value`` a device array of the same dtype.
    """
    if not isinstance(a, ndarray) or a.dtype.name not in SCATTER_ADD_DTYPES:
        kind = a.dtype.name if isinstance(a, ndarray) else type(a).__name__
        raise TypeError(f"cupy.add.at only supports {', '.join(SCATTER_ADD_DTYPES)} as data "
                        f"type (got {kind})")
    if not (isinstance(slices, ndarray) and slices.dtype.kind in "iu" and slices.ndim == 1
            and isinstance(value, ndarray) and value.dtype == a.dtype):
        raise NotImplementedError("cupyx.scatter_add of the stand-in takes one 1-D integer "
                                  "device array of indices and a device array of a's dtype")

    def add(ids: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        np.add.at(out, ids, rows)

    _kernel.launch("kernel scatter_add", add, [slices, value], [a])


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
