"""Fusion: the buffers a communicator packs lists into, the results it makes, and the copies.

Imports numpy and meta_dist.comm.checks / streams / xp; cupy only through the arrays' module
(and cupyx for pinned host memory). ``comm.plans`` asks it for flat buffers: a list is packed
into one reused buffer and unpacked after the collective, unless it already lies back to back
in one (then that memory is the buffer); results made for ``out=None`` are views of one new
buffer.
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from meta_dist.comm import checks
from meta_dist.comm.checks import flat_view
from meta_dist.comm.streams import mark
from meta_dist.xp import array_module, is_cupy_array, split_buffer

RECYCLE_MIN_BYTES, RECYCLED_BUFFERS = 2**20, 2  # results recycled from this size; how many
_SIZE = operator.attrgetter("size")


class Fusion:
    """The buffers a communicator fuses lists in, the results it makes, and how data gets there.

    A backend whose library moves host memory only (MPI, unless CUDA-aware) ``stages`` CuPy
    arrays: they are always packed, a collective's into reused pinned host buffers (the
    device-to-host copies are the packing; a point-to-point message gets a buffer of its own),
    and unpacked back onto the device; a single CuPy array takes the path of a list. A copy back
    reads its pinned buffer after the call has returned: the event it records is waited for
    before the buffer is handed out again (a lock keeps the newest event when a receive thread
    records one beside the collectives).

    Args:
        address: returns an array's data address (the backend's cheapest way).
        stages: device arrays go through host buffers.
    """

    def __init__(self, address: Callable[[Any], int], stages: bool = False) -> None:
        self.address, self.stages = address, stages
        self._buffers: dict[tuple[str, np.dtype, bool], Any] = {}
        self._recycled: list[list[Any]] = []  # [memory, weakref to its result]: new_buffer
        self._copied: Any = None  # an event after the last copy from a pinned buffer
        self._lock = threading.Lock()  # recording an event and storing it: one step

    def direct(self, arrays: list[Any]) -> bool:
        """Whether one array moves as it is (a list, or a staged device array, is packed)."""
        return len(arrays) == 1 and (type(arrays[0]) is np.ndarray or not (
            self.stages and is_cupy_array(arrays[0])))

    def fuse(self, sends: list[Any], outs: list[Any] | None, fresh: Any,
             pack: bool = True) -> tuple[Any, Any, list[Any] | None]:
        """Return flat (send, out) buffers for a collective whose result has the inputs' layout.

        ``fresh`` is the new buffer the outputs are views of (None: they were given). The third
        item lists the outputs to unpack the result into afterwards (None: the flat out is
        already their memory). ``outs`` None (reduce off the root) gives out None. ``pack``
        False leaves the buffer's values unset (broadcast off the root).
        """
        if self.direct(sends):  # [x] is the call x: the same library calls on every rank
            flat = flat_view(sends[0])
            if outs is None or outs[0] is sends[0]:
                return flat, None if outs is None else flat, None
            return flat, flat_view(outs[0]), None
        staged = self.stages and is_cupy_array(sends[0])
        if fresh is not None and not staged:
            if pack:
                self.pack(sends, into=fresh)
            return fresh, fresh, None
        if outs is sends and not staged:  # in place: a list back to back in one buffer is it
            run = checks.adjacent_run(sends, self.address)
            if run is not None:
                return run, run, None
        buf = self.pack(sends) if pack else self.buffer(sends[0], sum(map(_SIZE, sends)))
        if outs is None:
            return buf, None, None
        return buf, buf, [fresh] if fresh is not None else outs

    def buffer(self, like: Any, numel: int) -> Any:
        """Return the reused buffer of ``numel`` elements (fresh ones cost page faults)."""
        staged = self.stages and is_cupy_array(like)
        xp = np if staged else array_module(like)
        key = (xp.__name__, like.dtype, staged)
        if staged and self._copied is not None:
            # a copy to the device may still read the buffer, or the one a larger buffer
            # replaces below: CuPy's pinned pool would hand that one out again at once
            self._settle()
        buf = self._buffers.get(key)
        if buf is None or buf.size < numel:
            buf = self._buffers[key] = (_pinned if staged else xp.empty)(numel, like.dtype)
        return buf[:numel]

    def private(self, like: Any, numel: int, dtype: Any = None) -> Any:
        """Return a new buffer for one point-to-point message (on the host when staged)."""
        staged = self.stages and is_cupy_array(like)
        return (np if staged else array_module(like)).empty(numel, dtype or like.dtype)

    def pack(self, arrays: list[Any], into: Any = None) -> Any:
        """Copy arrays one after another into ``into`` (default: the reused buffer)."""
        if into is None:
            into = self.buffer(arrays[0], sum(map(_SIZE, arrays)))
        if type(into) is np.ndarray and is_cupy_array(arrays[0]):  # device to host
            start = 0
            for a in arrays:
                a.get(out=into[start : start + a.size].reshape(a.shape), blocking=False)
                start += a.size
            array_module(arrays[0]).cuda.get_current_stream().synchronize()  # MPI reads next
        else:
            array_module(arrays[0]).concatenate(arrays, axis=None, out=into)
        return into

    def unpack(self, buf: Any, outs: list[Any] | None) -> None:
        """Copy a flat buffer into contiguous arrays, one after another (nothing for None)."""
        if outs and type(buf) is not type(outs[0]):  # onto the device, from a staging buffer
            for o, part in zip(outs, split_buffer(buf, [o.shape for o in outs]), strict=True):
                self.copy(o, part)
            return
        start = 0
        for o in outs or ():  # per array as little as it can be: a list may hold thousands
            stop = start + o.size
            (o if o.ndim == 1 else o.reshape(-1))[...] = buf[start:stop]
            start = stop

    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (same shape), from a host buffer onto the device if staged."""
        if type(src) is np.ndarray and is_cupy_array(dst):
            dst.set(np.asarray(src, order="C"))  # keeps 0-d; asynchronous: buffer() waits
            with self._lock:  # one stream: the newest event covers every older copy
                cupy = array_module(dst)
                self._copied = mark(cupy, cupy.cuda.get_current_stream())
        else:
            dst[...] = src

    def new_buffer(self, like: Any, numel: int) -> Any:
        """Return a new result buffer; large host ones are recycled once nothing refers to them.

        The kernel zeroes every fresh page a large array first touches, and MPI registers each
        new address again; ``x = meta_dist.allreduce(x)`` frees such an array every call and
        asks for another of the same size. Memory here is handed out again only when the array
        last made over it has died: it is made through a memoryview, so numpy names it as the
        base of every view of it (the chain of bases stops at an array over a non-array), and
        a weak reference says when none is left. (Not sys.getrefcount: Python 3.14 borrows
        references and counts fewer, which would hand out memory a user still holds.)
        """
        xp = array_module(like)
        if xp is not np or numel * like.itemsize < RECYCLE_MIN_BYTES:
            return xp.empty(numel, like.dtype)
        for entry in self._recycled:
            memory, handed = entry
            if handed() is None and memory.size == numel and memory.dtype == like.dtype:
                break
        else:
            entry = [np.empty(numel, like.dtype), None]
            self._recycled = [*self._recycled[1 - RECYCLED_BUFFERS :], entry]
        buffer = np.frombuffer(memoryview(entry[0]), like.dtype)
        entry[1] = weakref.ref(buffer)
        return buffer

    def outputs(self, like: Any, shapes: list[tuple[int, ...]],
                numel: int) -> tuple[list[Any], Any]:
        """Return new outputs of ``shapes`` (``numel`` elements) as views of one buffer, and it."""
        buffer = self.new_buffer(like, numel)
        return split_buffer(buffer, shapes), buffer

    def clear(self) -> None:
        """Release every buffer (after any copy still reading one)."""
        self._settle()
        self._buffers.clear()
        self._recycled.clear()

    def _settle(self) -> None:
        """Wait for the last copy out of a pinned buffer (if any) to finish."""
        with self._lock:
            copied, self._copied = self._copied, None
        if copied is not None:
            copied.synchronize()


def _pinned(numel: int, dtype: np.dtype) -> np.ndarray:
    """Return page-locked host memory, so copies to and from the device run asynchronously."""
    try:
        import cupyx

        return cupyx.empty_pinned(numel, dtype)
    except (ImportError, AttributeError):  # older CuPy: pageable memory, synchronous copies
        return np.empty(numel, dtype)
