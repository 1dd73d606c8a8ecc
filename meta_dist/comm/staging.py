"""Moving CuPy arrays through the MPI backend: CUDA-aware MPI, or staging through host buffers.

Imports numpy, mpi4py and meta_dist.xp; cupy only when a device array arrives. Used by
meta_dist.comm.mpi_backend, whose primitives are decorated with ``staged(kind)``. The PyPI
Open MPI and MPICH wheels are not CUDA-aware: handing them a device pointer crashes, so staging
is the default and the library path needs the library (or META_DIST_CUDA_AWARE_MPI=1) to say yes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from meta_dist.comm.mpi_ops import MPI_OPS, NUMPY_REDUCED_DTYPES, P2P_TAG
from meta_dist.xp import data_ptr, is_cupy_array

ENV_CUDA_AWARE = "META_DIST_CUDA_AWARE_MPI"
# kind -> (argument indices the primitive reads, indices it writes)
ROLES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "allreduce": ((0,), (1,)), "reduce_scatter": ((0,), (1,)), "allgather": ((0,), (1,)),
    "broadcast": ((0,), (0,)), "reduce": ((0,), (1,)), "send": ((0,), ()), "recv": ((), (0,)),
}
_REDUCING = ("allreduce", "reduce_scatter", "reduce")
_MPI_LIBRARY = re.compile(r"^libmpi(ch)?[\w.-]*\.so")


def cuda_aware_mpi() -> bool:
    """Return True if the MPI library in this process can move GPU memory.

    META_DIST_CUDA_AWARE_MPI=1 or 0 decides when set. Otherwise the loaded libmpi's
    ``MPIX_Query_cuda_support()`` (Open MPI, MPICH) answers, found through /proc/self/maps
    because mpi4py loads it RTLD_LOCAL. Any failure means False: staging is always safe.
    """
    value = os.environ.get(ENV_CUDA_AWARE, "").strip().lower()
    if value:
        return value not in ("0", "false", "no", "off")
    return _library_cuda_support()


@functools.cache
def _library_cuda_support() -> bool:
    for path in loaded_mpi_libraries():
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        try:
            return bool(query())
        except Exception:  # a library that misbehaves is not one to trust with device memory
            return False
    return False


def loaded_mpi_libraries() -> list[str]:
    """Return the paths of the libmpi shared objects mapped into this process (Linux)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _MPI_LIBRARY.match(Path(fields[5]).name):
            if fields[5] not in paths:
                paths.append(fields[5])
    return paths


def library_call(comm: MPI.Comm, kind: str, args: Sequence[Any]) -> None:
    """Run one primitive as a single MPI library call on buffers the library can read.

    The buffers are numpy arrays, or device arrays on a CUDA-aware MPI. In place is ``recv is
    send`` for allreduce and reduce, and pointer aliasing for reduce_scatter (recv = send +
    rank*m: reduced through a scratch buffer, as MPI_IN_PLACE means something else there) and
    allgather (send = recv + rank*m: MPI_IN_PLACE).
    """
    rank = comm.Get_rank()
    if kind == "allreduce":
        send, recv, op = args
        comm.Allreduce(MPI.IN_PLACE if recv is send else send, recv, op=MPI_OPS[op])
    elif kind == "reduce_scatter":
        send, recv, op = args
        if data_ptr(send) <= data_ptr(recv) < data_ptr(send) + send.nbytes:
            scratch = _module(recv).empty_like(recv)
            comm.Reduce_scatter_block(send, scratch, op=MPI_OPS[op])
            recv[...] = scratch
        else:
            comm.Reduce_scatter_block(send, recv, op=MPI_OPS[op])
    elif kind == "allgather":
        send, recv = args
        in_place = data_ptr(send) == data_ptr(recv) + rank * send.nbytes
        comm.Allgather(MPI.IN_PLACE if in_place else send, recv)
    elif kind == "broadcast":
        buf, root = args
        comm.Bcast(buf, root=root)
    elif kind == "reduce":
        send, recv, op, root = args
        if rank == root:
            comm.Reduce(MPI.IN_PLACE if recv is send else send, recv, op=MPI_OPS[op], root=root)
        else:
            comm.Reduce(send, None, op=MPI_OPS[op], root=root)
    elif kind == "send":
        buf, peer = args
        comm.Send(buf, dest=peer, tag=P2P_TAG)
    elif kind == "recv":
        buf, peer = args
        comm.Recv(buf, source=peer, tag=P2P_TAG)
    else:
        raise ValueError(f"library_call: unknown kind; got {kind!r}, expected one of "
                         f"{', '.join(ROLES)}")


class HostStaging:
    """Run MPI primitives on device arrays: straight to a CUDA-aware library, else via host copies.

    Staging copies each device argument a primitive reads into a reused host buffer (pinned
    when ``cupyx.empty_pinned`` exists; one per argument position and dtype, grown as needed),
    runs the numpy primitive on the host buffers, and copies what it wrote back on the current
    stream. Aliasing follows identity: an argument that *is* another (``recv is send``, the
    in-place allreduce and reduce) shares one host buffer, so the primitive still sees in
    place. Arguments that only overlap by pointer (in-place reduce_scatter, recv = send +
    rank*m; in-place allgather, send = recv + rank*m) get separate buffers and take the
    out-of-place path, which is right: send's host copy holds the whole input taken before the
    call, and copying recv back writes exactly the rows the in-place call writes (allgather
    rewrites this rank's rows with the values they already hold).

    Args:
        comm: the MPI communicator of the primitives (for the library path and the decision).
        force: stage numpy arrays too, into separate host buffers (tests the logic on a CPU).
        cuda_aware: hand device arrays to the library; None asks ``cuda_aware_mpi()`` on
            every rank of ``comm`` and says yes only if all do (collective then), so ranks never
            pick different algorithms.
    """

    def __init__(self, comm: MPI.Comm | None, *, force: bool = False,
                 cuda_aware: bool | None = None) -> None:
        self.comm = comm
        self.force = force
        if cuda_aware is None:
            cuda_aware = comm is not None and all(comm.allgather(cuda_aware_mpi()))
        self.cuda_aware = cuda_aware
        self._buffers: dict[tuple[int, str, bool], np.ndarray] = {}
        self._copied: Any = None  # event after the last copy back: pinned buffers are reused
        self._lock = threading.RLock()
        self._inside = threading.local()

    def wanted(self, args: Sequence[Any]) -> bool:
        """Return True if ``args`` need this object (device arrays, or any array when forced)."""
        if getattr(self._inside, "active", False):
            return False  # a primitive calling another on host buffers: nothing to move
        return any(is_cupy_array(a) or (self.force and isinstance(a, np.ndarray)) for a in args)

    def call(self, kind: str, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        """Run primitive ``fn(*args)`` of ``kind`` (a key of ROLES) on device or forced arrays."""
        reads, writes = ROLES[kind]
        arrays = [a for a in args if _is_array(a)]
        numpy_reduced = kind in _REDUCING and arrays[0].dtype in NUMPY_REDUCED_DTYPES
        if self.cuda_aware and not numpy_reduced:
            for a in arrays:
                if is_cupy_array(a):  # mpi4py cannot order MPI after pending kernels
                    with a.device:
                        _cupy().cuda.get_current_stream().synchronize()
            library_call(self.comm, kind, args)
        else:
            self.run(fn, args, reads=reads, writes=writes)

    def run(self, fn: Callable[..., Any], args: Sequence[Any], *, reads: Sequence[int],
            writes: Sequence[int]) -> Any:
        """Call ``fn`` on host copies of ``args``, copy ``writes`` back and return its result.

        Args:
            fn: a function of host (numpy) arrays.
            args: its arguments; arrays among them are staged, anything else passes through.
            reads: indices of arrays ``fn`` reads (copied to the host first).
            writes: indices of arrays ``fn`` writes (copied back afterwards).
        """
        with self._lock, self._device_of(args):
            if self._copied is not None:
                self._copied.synchronize()  # the last copy back may still read these buffers
                self._copied = None
            host, by_id = list(args), {}
            for i, a in enumerate(args):
                if _is_array(a) and (is_cupy_array(a) or self.force):
                    if id(a) not in by_id:
                        by_id[id(a)] = self._buffer(i, a)
                    host[i] = by_id[id(a)]
            device_read = False
            for i in dict.fromkeys(reads):
                if host[i] is not args[i]:
                    device_read |= _copy_in(args[i], host[i])
            if device_read:
                _cupy().cuda.get_current_stream().synchronize()
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
            buf = (_pinned_empty if pinned else np.empty)(like.size, like.dtype)
            self._buffers[key] = buf
        return buf[: like.size].reshape(like.shape)

    @staticmethod
    def _device_of(args: Sequence[Any]) -> Any:
        for a in args:
            if is_cupy_array(a):
                return a.device  # copies and events belong to the arrays' GPU
        return contextlib.nullcontext()


def staged(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate an MPI primitive method so device arrays reach it through ``self.staging``.

    Numpy arrays cost one type check: without ``self.staging`` (a HostStaging), or when it is
    not wanted, the method runs as written. Decorating twice keeps the first.

    Args:
        kind: the primitive, a key of ROLES ("allreduce", ..., "recv").
    """
    if kind not in ROLES:
        raise ValueError(f"staged: unknown kind; got {kind!r}, expected one of {', '.join(ROLES)}")

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(method, "staged_kind", None) is not None:
            return method

        @functools.wraps(method)
        def primitive(self: Any, *args: Any) -> Any:
            staging = getattr(self, "staging", None)
            if (staging is None or (type(args[0]) is np.ndarray and not staging.force)
                    or not staging.wanted(args)):  # host arrays: one type check, no staging
                return method(self, *args)
            return staging.call(kind, lambda *host: method(self, *host), args)

        primitive.staged_kind = kind  # type: ignore[attr-defined]
        return primitive

    return wrap


def _cupy() -> Any:
    import cupy

    return cupy


def _is_array(a: Any) -> bool:
    return isinstance(a, np.ndarray) or is_cupy_array(a)


def _module(a: Any) -> Any:
    return _cupy() if is_cupy_array(a) else np


def _pinned_empty(numel: int, dtype: np.dtype) -> np.ndarray:
    try:
        import cupyx

        return cupyx.empty_pinned(numel, dtype)
    except (ImportError, AttributeError):  # older CuPy: pageable memory, synchronous copies
        return np.empty(numel, dtype)


def _copy_in(src: Any, host: np.ndarray) -> bool:
    """Copy ``src`` into ``host``; return True if it was an asynchronous device copy."""
    if is_cupy_array(src):
        try:
            src.get(out=host, blocking=False)
        except TypeError:  # CuPy before 13 has no blocking argument: a synchronous copy
            src.get(out=host)
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
