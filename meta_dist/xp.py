"""Array-module selection: numpy on the host, CuPy on a GPU.

Leaf module: imports numpy, and cupy lazily. Everything that touches arrays asks this module
which array module an array belongs to, so layers, optimizers and ZeRO run unchanged on either.
"""

from __future__ import annotations

import itertools
import math
import types

import numpy as np

from meta_dist.errors import UsageError


def cupy_or_none() -> types.ModuleType | None:
    """Return the cupy module if it imports, else None (never raises)."""
    try:
        import cupy
    except Exception:  # ImportError, or a CUDA library that fails to load
        return None
    return cupy


def is_cupy_array(arr: object) -> bool:
    """Return True if ``arr`` is a CuPy array (without importing cupy when it is not)."""
    kind = type(arr)
    return kind is not np.ndarray and kind.__module__.split(".")[0] == "cupy"


def array_module(arr: object) -> types.ModuleType:
    """Return ``cupy`` for a CuPy array and ``numpy`` for anything else."""
    if is_cupy_array(arr):
        import cupy

        return cupy
    return np


def to_numpy(arr: object) -> np.ndarray:
    """Return a host copy (CuPy) or the array itself (numpy)."""
    if is_cupy_array(arr):
        return arr.get()
    return np.asarray(arr)


def data_ptr(arr: object) -> int:
    """Return the address of an array's first element (numpy or CuPy), for aliasing checks."""
    if is_cupy_array(arr):
        return arr.data.ptr
    return arr.__array_interface__["data"][0]


def gpu_count() -> int:
    """Return how many CUDA devices this process can see (0 without cupy or a driver)."""
    cupy = cupy_or_none()
    if cupy is None:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, or CUDA_VISIBLE_DEVICES hides every device
        return 0


def select_device(local_rank: int) -> int:
    """Make GPU ``local_rank % gpu_count()`` current for this process and return its index.

    Call before allocating anything on the GPU. With per-rank CUDA_VISIBLE_DEVICES every rank
    sees one device, and the modulo maps them all to device 0 as intended.

    Raises:
        UsageError: no GPU is visible.
    """
    count = gpu_count()
    if count == 0:
        raise UsageError(
            "select_device: no CUDA device is visible; got gpu_count() == 0, expected >= 1; "
            "install cupy-cuda12x (pip install 'meta_dist[gpu]') on a machine with a GPU, "
            "or use device: cpu"
        )
    import cupy

    device = local_rank % count
    cupy.cuda.Device(device).use()
    return device


def contiguous_arrays(shapes: list[tuple[int, ...]], dtype: object,
                      xp: types.ModuleType = np) -> list:
    """Return zeroed arrays of ``shapes`` laid out back to back in one buffer, in order.

    A fused collective on such a list (in place) moves the buffer itself, with no fusion copy:
    the layout DDP's gradient_as_bucket_view and DeepSpeed's contiguous gradients use. Each
    array is an ordinary C-contiguous view of the buffer.

    Args:
        shapes: the arrays' shapes (an int is a 1-D shape, as numpy.zeros takes it).
        dtype: their one dtype.
        xp: numpy (host arrays) or cupy (device arrays).
    """
    shapes = [(int(s),) if isinstance(s, (int, np.integer)) else tuple(s) for s in shapes]
    return split_buffer(xp.zeros(sum(math.prod(shape) for shape in shapes), dtype), shapes)


def split_buffer(buffer: object, shapes: list[tuple[int, ...]]) -> list:
    """Return views of a 1-D ``buffer`` shaped ``shapes``, back to back from its start."""
    if len(shapes) == 1:  # one array, as most calls have: nothing to add up
        return [buffer[: math.prod(shapes[0])].reshape(shapes[0])]
    ends = list(itertools.accumulate(map(math.prod, shapes), initial=0))
    views = [buffer[a:b] for a, b in itertools.pairwise(ends)]  # a fused list: thousands, maybe
    for i, shape in enumerate(shapes):
        if len(shape) != 1:
            views[i] = views[i].reshape(shape)
    return views
