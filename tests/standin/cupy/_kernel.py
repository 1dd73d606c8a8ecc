"""Launching the stand-in's kernels and copies on the current stream.

Imports the stand-in's _engine, _memory, _errors and cuda.stream. A kernel is a function of
numpy views that runs on a stream worker; ``launch`` checks that every array is on the stream's
device (CuPy's ``_check_peer_access``, cupy/_core/_kernel.pyx: with no peer access between
devices it raises ValueError), declares what it reads and writes to the race detector, and
enqueues it. Host-to-device copies read page-locked sources when they run and stage pageable
ones at call time, as CuPy and the CUDA runtime do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import _engine, _memory
from .cuda.stream import current_queue

if TYPE_CHECKING:
    from ._ndarray import ndarray

SCALAR_TYPES = (bool, int, float, complex, np.generic)


def check_device(arrays: Sequence[ndarray], q: _engine.Queue) -> None:
    """Raise ValueError for an array that is not on ``q``'s device (no peer access here)."""
    for a in arrays:
        if a._storage.device != q.device.index:
            raise ValueError(
                f"The device where the array resides ({a._storage.device}) is different from "
                f"the current device ({q.device.index}). Peer access is unavailable between "
                f"these devices.")


def launch(label: str, fn: Callable[..., None], inputs: Sequence[ndarray],
           outputs: Sequence[ndarray], *, q: _engine.Queue | None = None) -> _engine.Op:
    """Enqueue ``fn(*input_views, *output_views)`` on ``q`` (default: the current stream).

    Args:
        label: what the kernel is, for error messages.
        fn: a function of numpy views; it runs on the stream's worker thread.
        inputs: arrays it reads.
        outputs: arrays it writes (they may also be read).
        q: the queue; None means the current device's current stream.
    """
    q = q or current_queue()
    check_device([*inputs, *outputs], q)
    specs = [a._spec() for a in (*inputs, *outputs)]
    regions = [a._region(False) for a in inputs] + [a._region(True) for a in outputs]

    def run() -> None:
        with np.errstate(all="ignore"):  # CUDA kernels produce inf/nan without warnings
            fn(*(storage.view(offset, shape, strides, dtype)
                 for storage, offset, shape, strides, dtype in specs))

    return _engine.enqueue(q, run, label, regions=regions)


def host_source(host: np.ndarray) -> Callable[[], np.ndarray]:
    """Return how a host-to-device copy reads ``host`` when it runs.

    Page-locked memory is read by the copy itself, so writing it before the copy has run is a
    race (CuPy's docs for ``cupy.asarray(blocking=False)``). Pageable memory is staged now:
    CuPy copies it into a pinned staging buffer first, and cudaMemcpyAsync stages pageable
    memory before returning.
    """
    pinned = pinned_view(host, "copy host to device")
    if pinned is not None:
        return pinned
    staged = np.array(host, copy=True)
    return lambda: staged


def pinned_view(host: np.ndarray, label: str) -> Callable[[], np.ndarray | None] | None:
    """Return how an asynchronous copy reaches page-locked ``host`` when it runs (None when
    ``host`` is pageable): its bytes if the pinned array is still referenced, else None.

    CuPy hands cudaMemcpyAsync the address only (cupy/_core/core.pyx, ``set``/``get``) and
    keeps no reference, so a pinned array dropped before the copy runs is back in CuPy's
    pinned memory pool, free for "further memory allocations of the same size"
    (cupy.cuda.PinnedMemoryPool): the copy would read or overwrite someone else's bytes. The
    stand-in's copy holds the array weakly and reports such a copy at the next CUDA call.
    """
    found = _memory.pinned_owner(host)
    if found is None:
        return None
    ref, offset = found
    shape, strides, dtype, nbytes = host.shape, host.strides, host.dtype, host.nbytes

    def view() -> np.ndarray | None:
        owner = ref()
        if owner is None:
            _engine.note_hazard(
                f"{label}: pinned host memory ({nbytes} bytes) was freed (its last reference "
                f"dropped) before the asynchronous copy ran; CuPy passes only its address to "
                f"cudaMemcpyAsync, and the pinned memory pool hands a freed block to the next "
                f"allocation of its size; expected the pinned array kept alive until the "
                f"stream has passed the copy (synchronize the stream or an event recorded "
                f"after it)")
            return None
        flat = (owner if owner.flags.c_contiguous else owner.T).reshape(-1).view(np.uint8)
        return np.ndarray(shape, dtype, buffer=flat, offset=offset, strides=strides)

    return view


def copy_to_device(host: np.ndarray, out: ndarray, *, q: _engine.Queue | None = None,
                   blocking: bool = False) -> None:
    """Copy ``host`` into device array ``out`` (same shape) on ``q``."""
    source = host_source(host)

    def copy(dst: np.ndarray) -> None:
        data = source()
        if data is not None:  # None: a freed pinned source, reported
            dst[...] = data

    op = launch("copy host to device", copy, (), (out,), q=q)
    if blocking:
        q = q or current_queue()
        _engine.wait(q, op.seq, op.clock)


def copy_to_host(arr: ndarray, host: np.ndarray, *, q: _engine.Queue,
                 blocking: bool) -> None:
    """Copy device array ``arr`` into ``host`` (same shape) on ``q``; wait if ``blocking``."""
    pinned = pinned_view(host, "copy device to host")
    target = (lambda: host) if pinned is None else pinned

    def copy(src: np.ndarray) -> None:
        out = target()
        if out is not None:  # None: a freed pinned destination, reported
            out[...] = src

    op = launch("copy device to host", copy, (arr,), (), q=q)
    if blocking:
        _engine.wait(q, op.seq, op.clock)
