"""MpiCommunicator: collectives on host (numpy) buffers through mpi4py.

Imports numpy, mpi4py, meta_dist.comm.base / checks and meta_dist.xp. CuPy arrays reach the
same primitives through pinned host buffers (``comm.fusion`` packs them there and back), or,
when META_DIST_CUDA_AWARE_MPI=1 says the library is CUDA-aware, as they are: no portable call
says whether a library is one, and a device pointer handed to one that is not (the PyPI Open
MPI and MPICH wheels) crashes, so it is an explicit opt-in, agreed by every rank.

Small messages go straight to the library (its latency is hard to beat). Large reductions use a
pairwise exchange on persistent buffers: for k = 1..size-1 each rank sends the chunk owned by
rank+k and receives its own chunk's contribution from rank-k, adding it with numpy, segment by
segment so the scratch stays in cache; an allreduce then gathers the chunks with one in-place
MPI_Allgatherv. Open MPI allocates and first-touches fresh scratch memory inside every large
MPI_Allreduce and MPI_Reduce_scatter_block, which costs more than moving the data (DESIGN.md);
reused buffers avoid that. Each chunk is reduced by exactly one rank and then copied, so every
rank ends with bit-identical results. `bench collectives` measures where the
exchange starts to pay; ``PAIRWISE_MIN_BYTES`` holds the answer.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import numpy as np

from meta_dist.comm.base import Communicator
from meta_dist.comm.checks import DTYPES
from meta_dist.connector import MPIConnector
from meta_dist.env import env_flag
from meta_dist.lazy_mpi import MPI
from meta_dist.xp import array_module, data_ptr, gpu_count, is_cupy_array, select_device

ENV_CUDA_AWARE = "META_DIST_CUDA_AWARE_MPI"

MPI_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "prod": "PROD"}  # MPI's names
# max and min skip NaN (IEEE 754 maxNum, numpy's fmax), as NCCL's fmaxf and __hmax do
UFUNCS = {"sum": np.add, "avg": np.add, "max": np.fmax, "min": np.fmin, "prod": np.multiply}
# Open MPI 5.0's MPI_SUM on MPI_UNSIGNED_CHAR saturates at 255 (seen with the PyPI wheel) where
# numpy and C wrap modulo 256, and MPI has no bfloat16 at all: these dtypes are always reduced
# by numpy in the pairwise path (bfloat16 travels as its 16 raw bits).
NUMPY_REDUCED = frozenset(d.char for d in DTYPES if d.name in ("uint8", "bfloat16"))
# The libraries' MPI_MAX and MPI_MIN on floats keep or drop a NaN by which rank holds it (and
# MPICH's by where in the array it lies): the library calls get numpy's fmax and fmin as
# user-defined ops instead. meta_dist's calls never depend on the op; MPICH's algorithm does
# (a user-defined op takes another), so with META_DIST_CHECK=0 ranks passing a floating max
# against a sum fail inside MPICH, as sizes that differ do.
NAN_SKIPPING_OPS = ("max", "min")
_NAN_SKIPPING: dict[tuple[str, np.dtype], MPI.Op] = {}  # see nan_skipping_op
_NAN_SKIPPING_LOCK = threading.Lock()
# avg of float16 divides each contribution by size before the sum, as ncclAvg does: a sum of
# size values overflows float16's 65504 where their mean does not (fp16 gradients under a loss
# scale sit close to it). Wider floats sum first and divide once (bfloat16 has float32's range).
PRESCALED_AVG = frozenset({np.dtype(np.float16).char})
PAIRWISE_MIN_BYTES = {"allreduce": 16 * 2**20, "reduce_scatter": 128 * 1024}
SEGMENT_BYTES = 512 * 1024
# Tags: the pairwise exchange uses Sendrecv on the communicator that also carries the user's
# send/recv (on their own threads); with one tag a collective could take a user's message.
P2P_TAG, EXCHANGE_TAG = 0, 1


def cuda_aware_requested() -> bool:
    """Return True when META_DIST_CUDA_AWARE_MPI says the MPI library takes device pointers."""
    return env_flag(ENV_CUDA_AWARE)


class MpiCommunicator(Communicator):
    """Communicator on numpy arrays over MPI. See ``Communicator`` for every collective.

    Args:
        connector: the MPI world.
        pairwise_min_bytes: per operation ("allreduce", "reduce_scatter"), the message size
            from which the pairwise exchange on reused buffers is used; smaller ones call the
            library directly.
        segment_bytes: size of one pairwise step's message (the scratch buffer's size).
        **kwargs: ``check`` and ``stall_timeout``, see ``Communicator``.
    """

    backend_name = "mpi"

    def __init__(self, connector: MPIConnector, *, pairwise_min_bytes: dict[str, int] | None = None,
                 segment_bytes: int = SEGMENT_BYTES, **kwargs: Any) -> None:
        self.pairwise_min_bytes = {**PAIRWISE_MIN_BYTES, **(pairwise_min_bytes or {})}
        self.segment_bytes = segment_bytes
        self.cuda_aware = cuda_aware_requested()
        self.stages_device_arrays = not self.cuda_aware
        super().__init__(connector, **kwargs)
        self._comm: MPI.Comm = connector.comm.Dup()
        self._ops = {name: getattr(MPI, mpi_name) for name, mpi_name in MPI_OPS.items()}
        self._scratch: dict[tuple[str, np.dtype], Any] = {}

    def _call_settings(self) -> dict[str, Any]:
        """See ``Communicator._call_settings``: the pairwise thresholds, CUDA-aware MPI."""
        return {"pairwise_min_bytes": self.pairwise_min_bytes, "segment_bytes": self.segment_bytes,
                "cuda_aware_mpi": self.cuda_aware}

    def _worker_started(self) -> None:
        """Make this rank's GPU current on the async thread too (CUDA's device is per thread)."""
        if gpu_count() > 0:
            select_device(self.connector.local_rank)

    @staticmethod
    def _address(arr: Any) -> int:
        """See ``Communicator._address``; MPI.Get_address costs less than numpy's interface."""
        return MPI.Get_address(arr) if type(arr) is np.ndarray else data_ptr(arr)

    # ---------------------------------------------------------------- primitives

    def _allreduce(self, send: Any, recv: Any, op: str) -> None:
        send = self._prescaled(send, op, in_place=recv is send)
        if self.size == 1 or self._library_reduces(send, "allreduce"):
            if recv is not send:  # the standard asks every rank for MPI_IN_PLACE, or none
                recv[...] = send
            if self.size > 1:
                self._comm.Allreduce(MPI.IN_PLACE, _wire(recv), op=self._op(op, recv))
            return
        bounds = chunk_bounds(send.size, self.size)
        self._pairwise_reduce(send, recv[bounds[self.rank] : bounds[self.rank + 1]], bounds, op)
        counts = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        wire = _wire(recv)
        self._comm.Allgatherv(MPI.IN_PLACE, [wire, counts, bounds[:-1], _mpi_type(wire)])

    def _reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        send = self._prescaled(send, op)
        in_place = _overlap(send, recv)  # only as this rank's rows (checks.check_alias)
        if self.size == 1:
            if not in_place:
                recv[...] = send
            return
        if not self._library_reduces(send, "reduce_scatter"):
            self._pairwise_reduce(send, recv, [r * recv.size for r in range(self.size + 1)], op)
        elif in_place:  # MPI_IN_PLACE means rows 0..m of send there: reduce aside, copy
            result = self._scratch_buffer(recv, recv.size)[: recv.size]
            self._comm.Reduce_scatter_block(_wire(send), _wire(result), op=self._ops[op])
            recv[...] = result
        else:
            self._comm.Reduce_scatter_block(_wire(send), _wire(recv), op=self._ops[op])

    def _allgather(self, send: Any, recv: Any) -> None:
        if not _overlap(send, recv):  # MPI_IN_PLACE everywhere, as MPI asks
            recv[self.rank * send.size : (self.rank + 1) * send.size] = send
        if self.size > 1:
            self._comm.Allgather(MPI.IN_PLACE, _wire(recv))

    def _broadcast(self, buf: Any, root: int) -> None:
        if self.size > 1:
            self._comm.Bcast(_wire(buf), root=root)

    def _reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        send = self._prescaled(send, op)
        if self.size > 1 and send.dtype.char in NUMPY_REDUCED:  # rare: no faster way needed
            total = array_module(send).empty_like(send)
            self._allreduce(send, total, op)
            if recv is not None:
                recv[...] = total
        elif self.rank == root:
            if recv is not send:
                recv[...] = send
            if self.size > 1:
                self._comm.Reduce(MPI.IN_PLACE, _wire(recv), op=self._op(op, recv), root=root)
        else:
            self._comm.Reduce(_wire(send), None, op=self._op(op, send), root=root)

    def _send(self, buf: Any, peer: int) -> None:
        self._comm.Send(_wire(buf), dest=peer, tag=P2P_TAG)

    def _recv(self, buf: Any, peer: int) -> None:
        self._comm.Recv(_wire(buf), source=peer, tag=P2P_TAG)

    def _barrier(self) -> None:
        self._comm.Barrier()

    def _close_backend(self) -> None:
        self._scratch.clear()
        self._comm.Free()

    def _prescaled(self, send: Any, op: str, in_place: bool = False) -> Any:
        """Return ``send / size`` where avg divides before the sum (``PRESCALED_AVG``).

        Divided where it lies when the call is in place (the result overwrites it anyway: the
        trainer's gradient buckets), else into a new array: out of place, ``send`` comes back
        untouched. Each element is rounded once (float16 division) either way.
        """
        if op != "avg" or self.size == 1 or send.dtype.char not in PRESCALED_AVG:
            return send
        if in_place:
            send /= send.dtype.type(self.size)
            return send
        return send / send.dtype.type(self.size)

    def _average(self, flat: Any, op: str) -> None:
        """See ``Communicator._average``; float16's avg was divided before the sum."""
        if op == "avg" and flat.dtype.char not in PRESCALED_AVG:
            super()._average(flat, op)

    # ---------------------------------------------------------------- the pairwise reduction

    def _library_reduces(self, send: Any, api: str) -> bool:
        return (send.nbytes < self.pairwise_min_bytes[api]
                and send.dtype.char not in NUMPY_REDUCED)

    def _op(self, op: str, arr: Any) -> MPI.Op:
        """Return the MPI op for ``op`` on ``arr``'s dtype: fmax and fmin for floats' max, min."""
        if op not in NAN_SKIPPING_OPS or arr.dtype.kind != "f":
            return self._ops[op]
        return nan_skipping_op(op, arr.dtype)

    def _pairwise_reduce(self, send: Any, mine: Any, bounds: list[int], op: str) -> None:
        """Reduce chunk ``rank`` of ``send`` across ranks into ``mine``.

        ``bounds`` splits ``send`` into one chunk per rank; ``mine`` may be this rank's chunk of
        ``send`` itself (in place). Segment by segment, step k sends the segment of chunk
        rank+k and adds what rank-k sent for this rank's chunk. Every rank walks the same
        number of segments, so the Sendrecv calls pair up even when chunk sizes differ.
        """
        ufunc, rank, size = UFUNCS[op], self.rank, self.size
        own = send[bounds[rank] : bounds[rank + 1]]
        in_place = _overlap(mine, own)
        seg = max(1, self.segment_bytes // send.itemsize)
        longest = max(hi - lo for lo, hi in itertools.pairwise(bounds))
        scratch = self._scratch_buffer(send, min(seg, longest))
        # as the library's own reductions, overflow and inf - inf give inf and NaN silently
        with np.errstate(all="ignore"):
            for start in range(0, longest, seg):
                part = mine[start : start + seg]
                for k in range(1, size):
                    to, frm = (rank + k) % size, (rank - k) % size
                    piece = send[bounds[to] + start : min(bounds[to] + start + seg, bounds[to + 1])]
                    # out of place the first contribution lands in the result itself, which then
                    # adds this rank's own: no scratch round trip, and the result is read once
                    first = k == 1 and not in_place
                    got = part if first else scratch[: part.size]
                    self._comm.Sendrecv(_wire(piece), dest=to, sendtag=EXCHANGE_TAG,
                                        recvbuf=_wire(got), source=frm, recvtag=EXCHANGE_TAG)
                    # CuPy arrays (CUDA-aware MPI) take CuPy's ufunc; ops commute, so the sum is
                    # the same bits in place and out of place
                    ufunc(part, own[start : start + seg] if first else got, out=part)

    def _scratch_buffer(self, like: Any, numel: int) -> Any:
        xp = array_module(like)
        key = (xp.__name__, like.dtype)
        buf = self._scratch.get(key)
        if buf is None or buf.size < numel:
            buf = self._scratch[key] = xp.empty(numel, like.dtype)
        return buf


def nan_skipping_op(op: str, dtype: np.dtype) -> MPI.Op:
    """Return the process's one user-defined MPI op for float ``op`` (max, min) on ``dtype``.

    Made on first use and kept for the process, shared by every communicator: MPI libraries
    cap how many user-defined ops a process may hold (mpi4py: 32), and these are at most 6.
    """
    key = (op, dtype)
    with _NAN_SKIPPING_LOCK:  # two communicators' threads may ask at once
        made = _NAN_SKIPPING.get(key)
        if made is None:
            made = _NAN_SKIPPING[key] = MPI.Op.Create(_elementwise(UFUNCS[op], dtype),
                                                      commute=True)
    return made


def _elementwise(ufunc: np.ufunc, dtype: np.dtype) -> Any:
    """Return an MPI user-defined op's function: ``inout = ufunc(in, inout)`` on ``dtype``.

    fmax and fmin return either argument on a tie (+0.0 and -0.0, or NaN on both; which one
    depends on numpy's loop), and MPICH hands a commutative op its operands in either order:
    ranks got +0.0 and -0.0 from one allreduce. A tie takes the same bits whichever comes
    first: the lower pattern for fmax (+0.0), the higher for fmin (-0.0).
    """
    bits, pick = np.dtype(f"u{dtype.itemsize}"), np.minimum if ufunc is np.fmax else np.maximum

    def apply(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
        got, inout = np.frombuffer(inbuf, dtype), np.frombuffer(inoutbuf, dtype)
        tied = pick(got.view(bits), inout.view(bits))
        tie = got == inout
        ufunc(got, inout, out=inout)
        tie |= np.isnan(inout)  # NaN on both: fmax and fmin skip a NaN on one side only
        np.copyto(inout.view(bits), tied, where=tie)

    return apply


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Return parts+1 boundaries splitting numel elements as evenly as possible."""
    base, extra = divmod(numel, parts)
    return [r * base + min(r, extra) for r in range(parts + 1)]


def _overlap(a: Any, b: Any) -> bool:
    """Return whether two buffers share memory: for a primitive, whether it runs in place.

    The plans pass only the exact in-place spellings (``checks.check_alias``).
    """
    if type(a) is np.ndarray is type(b):  # numpy's bounds test: a third of two addresses' cost
        return np.may_share_memory(a, b)
    start, other = MpiCommunicator._address(a), MpiCommunicator._address(b)
    return start < other + b.nbytes and other < start + a.nbytes


def _mpi_type(arr: Any) -> MPI.Datatype:
    """Return the predefined MPI datatype of an array's dtype (for explicit buffer specs)."""
    return MPI._typedict[arr.dtype.char]


def _wire(arr: Any) -> Any:
    """Return ``arr`` as MPI can move it: a dtype MPI lacks (bfloat16) as its raw 16 bits.

    Device memory (CUDA-aware MPI) once the stream has finished writing it: MPI cannot order
    itself after pending kernels, so the host waits for them here, before every library call.
    """
    if type(arr) is not np.ndarray and is_cupy_array(arr):
        array_module(arr).cuda.get_current_stream().synchronize()
    return arr.view(np.uint16) if arr.dtype.char not in MPI._typedict else arr
