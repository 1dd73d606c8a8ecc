"""A strict, numpy-backed stand-in for CuPy (and cupy.cuda.nccl) for machines without a GPU.

Never imported from meta_dist: tests put ``tests/standin`` first on ``sys.path`` (see
``tests/standin/install.py``) when the real cupy cannot run. ``cupy.__standin__`` is True here.

It is stricter than CuPy on purpose, so code that passes here is right on a GPU: every kernel
and copy runs asynchronously on its stream's worker thread after a random delay; device bytes
reach the host only through ``get``/``asnumpy``; unordered cross-stream accesses raise
``StandinRaceError``; uninitialised memory holds garbage. Knobs (environment variables) are
documented in ``cupy._knobs``; the execution model in ``cupy._engine``.
"""

from __future__ import annotations

import numpy as _np

if tuple(int(p) for p in _np.__version__.split(".")[:2]) < (2, 1):
    raise ImportError(f"the cupy stand-in needs numpy >= 2.1 (reshape(copy=False)); got "
                      f"{_np.__version__}")

from . import _ndarray, _ops, _routines, cuda, lib  # noqa: E402
from ._errors import StandinRaceError  # noqa: E402
from ._ndarray import ndarray  # noqa: E402
from ._ops import ufunc  # noqa: E402

__standin__ = True
__version__ = "14.2.0"

globals().update(_ops.FUNCTIONS)

dtype = _np.dtype
newaxis = None
bool_ = _np.bool_
int8, int16, int32, int64 = _np.int8, _np.int16, _np.int32, _np.int64
uint8, uint16, uint32, uint64 = _np.uint8, _np.uint16, _np.uint32, _np.uint64
float16, float32, float64 = _np.float16, _np.float32, _np.float64
complex64, complex128 = _np.complex64, _np.complex128
intp, uintp = _np.intp, _np.uintp
inf, nan, pi, e = _np.inf, _np.nan, _np.pi, _np.e
can_cast, result_type, promote_types = _np.can_cast, _np.result_type, _np.promote_types
finfo, iinfo = _np.finfo, _np.iinfo


def get_default_memory_pool() -> cuda.MemoryPool:
    """Return the memory pool all device allocations come from."""
    return cuda.memory.get_default_pool()


def is_available() -> bool:
    """Return True if a (modeled) CUDA device is visible."""
    return cuda.is_available()


__all__ = ["StandinRaceError", "cuda", "get_default_memory_pool", "is_available", "lib",
           "ndarray", "ufunc", *sorted(_ops.FUNCTIONS)]
del _ndarray, _routines
