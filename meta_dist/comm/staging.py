"""CuPy arrays through the MPI backend: staged through host buffers, or to a CUDA-aware MPI.

Imports numpy and meta_dist.xp; cupy only when a device array arrives. The MPI backend's
primitives are decorated with ``staged(kind)``: numpy arrays pass straight through, device
arrays are copied into reused host buffers, the numpy primitive runs on those, and what it wrote
is copied back. A CUDA-aware MPI takes device arrays itself, but no portable call says whether a
library is one, and handing a device pointer to one that is not (the PyPI Open MPI and MPICH
wheels) crashes; so it is an explicit opt-in, META_DIST_CUDA_AWARE_MPI=1, agreed by every rank.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meta_dist.xp import is_cupy_array

ENV_CUDA_AWARE = "META_DIST_CUDA_AWARE_MPI"
# kind -> (argument indices the primitive reads, indices it writes)
ROLES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "allreduce": ((0,), (1,)), "reduce_scatter": ((0,), (1,)), "allgather": ((0,), (1,)),
    "broadcast": ((0,), (0,)), "reduce": ((0,), (1,)), "send": ((0,), ()), "recv": ((), (0,)),
}


def cuda_aware_requested() -> bool:
    """Return True when META_DIST_CUDA_AWARE_MPI says the MPI library takes device pointers."""
    value = os.environ.get(ENV_CUDA_AWARE, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


class HostStaging:
    """Run MPI primitives on device arrays: through host copies, or as they are when CUDA-aware.

    Staging copies each device argument a primitive reads into a reused host buffer (pinned
    where ``cupyx.empty_pinned`` exists; one per argument position and dtype, grown as needed),
    runs the numpy primitive on the host buffers, and copies what it wrote back on the current
    stream. Aliasing follows identity: an argument that *is* another (``recv is send``, the
    in-place allreduce and reduce) shares one host buffer, so the primitive still sees in
    place. Arguments that only overlap by pointer (in-place reduce_scatter, recv = send +
    rank*m; in-place allgather, send = recv + rank*m) get separate buffers and take the
    out-of-place path, which is right: send's host copy holds the whole input taken before the
    call, and copying recv back writes exactly the rows the in-place call writes.

    With ``cuda_aware`` the primitive gets the device arrays after the current stream has been
    synchronised (MPI cannot order itself after pending kernels).

    Args:
        cuda_aware: hand device arrays to the library (every rank must agree).
        force: stage numpy arrays too, into separate host buffers (tests the logic on a CPU).
    """

    def __init__(self, *, cuda_aware: bool = False, force: bool = False) -> None:
        self.cuda_aware = cuda_aware
        self.force = force
        self._buffers: dict[tuple[int, str, bool], np.ndarray] = {}
        self._copied: Any = None  # event after the last copy back: pinned buffers are reused
        self._lock = threading.RLock()
        self._inside = threading.local()

    def wanted(self, args: Sequence[Any]) -> bool:
        """Return True if ``args`` need this object (device arrays, or any array when forced)."""
        if getattr(self._inside, "active", False):
            return False  # a primitive calling another on host buffers: nothing to move
        return any(is_cupy_array(a) or (self.force and isinstance(a, np.ndarray)) for a in args)

    def call(self, kind: str, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """Run primitive ``fn(*args)`` of ``kind`` (a key of ROLES) on device or forced arrays."""
        if self.cuda_aware:
            device = self._device_of(args)
            if device is not None:
                with device:
                    _cupy().cuda.get_current_stream().synchronize()
            return fn(*args)
        reads, writes = ROLES[kind]
        return self.run(fn, args, reads=reads, writes=writes)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], *, reads: Sequence[int],
            writes: Sequence[int]) -> Any:
        """Call ``fn`` on host copies of ``args``, copy ``writes`` back and return its result.

        Args:
            fn: a function of host (numpy) arrays.
            args: its arguments; arrays among them are staged, anything else passes through.
            reads: indices of arrays ``fn`` reads (copied to the host first).
            writes: indices of arrays ``fn`` writes (copied back afterwards).
        """
        with self._lock, self._device_of(args) or contextlib.nullcontext():
            if self._copied is not None:
                self._copied.synchronize()  # the last copy back may still read these buffers
                self._copied = None
            host, by_id = list(args), {}
            for i, a in enumerate(args):
                if is_cupy_array(a) or (self.force and isinstance(a, np.ndarray)):
                    if id(a) not in by_id:
                        by_id[id(a)] = self._buffer(i, a)
                    host[i] = by_id[id(a)]
            device_read = False
            for i in dict.fromkeys(reads):
                if host[i] is not args[i]:
                    device_read |= _copy_in(args[i], host[i])
            if device_read:
                _cupy().cuda.get_current_stream().synchronize()  # host buffers now hold the data
            self._inside.active = True
            try:
                result = fn(*host)
            finally:
                self._inside.active = False
            device_written = False
            for i in dict.fromkeys(writes):
                if host[i] is not args[i]:
                    device_written |= _copy_out(host[i], args[i])
            if device_written:
                self._copied = _cupy().cuda.get_current_stream().record()
            return result

    def clear(self) -> None:
        """Release the host buffers (they are re-created on the next staged call)."""
        with self._lock:
            if self._copied is not None:
                self._copied.synchronize()
                self._copied = None
            self._buffers.clear()

    def _buffer(self, role: int, like: Any) -> np.ndarray:
        pinned = is_cupy_array(like)
        key = (role, like.dtype.str, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.size < like.size:
            buf = self._buffers[key] = (_pinned_empty if pinned else np.empty)(like.size,
                                                                               like.dtype)
        return buf[: like.size].reshape(like.shape)

    @staticmethod
    def _device_of(args: Sequence[Any]) -> Any:
        for a in args:
            if is_cupy_array(a):
                return a.device  # copies and events belong to the arrays' GPU
        return None


def staged(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an MPI primitive method so device arrays reach it through ``self.staging``.

    Numpy arrays cost one type check: unless ``self.staging`` wants the arguments (device
    arrays, or a forced staging in tests), the method runs as written.

    Args:
        kind: the primitive, a key of ROLES ("allreduce", ..., "recv").
    """
    if kind not in ROLES:
        raise ValueError(f"staged: unknown kind; got {kind!r}, expected one of {', '.join(ROLES)}")

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def primitive(self: Any, *args: Any) -> Any:
            staging = self.staging
            if (type(args[0]) is np.ndarray and not staging.force) or not staging.wanted(args):
                return method(self, *args)
            return staging.call(kind, functools.partial(method, self), args)

        return primitive

    return wrap


def _cupy() -> Any:
    import cupy

    return cupy


def _pinned_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    try:
        import cupyx

        return cupyx.empty_pinned(numel, dtype)
    except (ImportError, AttributeError):  # older CuPy: pageable memory, synchronous copies
        return np.empty(numel, dtype)


def _copy_in(src: Any, host: np.ndarray) -> bool:
    """Copy ``src`` into ``host``; return True if it was an asynchronous device copy."""
    if is_cupy_array(src):
        src.get(out=host, blocking=False)
        return True
    host[...] = src
    return False


def _copy_out(host: np.ndarray, dst: Any) -> bool:
    """Copy ``host`` into ``dst``; return True if it was an asynchronous device copy."""
    if is_cupy_array(dst):
        dst.set(host)
        return True
    dst[...] = host
    return False
