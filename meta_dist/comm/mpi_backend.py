"""MpiCommunicator: collectives on host (numpy) buffers through mpi4py.

Imports numpy, mpi4py and meta_dist.comm.base. CuPy arrays are moved through CUDA-aware MPI when
the MPI library says it is one, otherwise staged through reused host buffers (see
``meta_dist.comm.staging``).

Small messages go straight to the library (its latency is hard to beat). Large reductions use a
pairwise exchange on persistent buffers: for k = 1..size-1 each rank sends the chunk owned by
rank+k and receives its own chunk's contribution from rank-k, adding it with numpy, segment by
segment so the scratch stays in cache; an allreduce then gathers the chunks with one in-place
MPI_Allgatherv (faster than forwarding each reduced segment: 16 MiB in 1.85 against 2.9 ms,
64 MiB 12.0 against 12.8, 2 ranks). Open MPI allocates and first-touches fresh scratch memory
inside every large MPI_Allreduce and MPI_Reduce_scatter_block, which costs more than the data
movement itself (see DESIGN.md); reused buffers avoid that. Each chunk is reduced by exactly
one rank and then copied, so every rank ends with bit-identical results.
"""

from __future__ import annotations

import itertools
import operator
import sys
from typing import Any

import numpy as np
from mpi4py import MPI

from meta_dist.comm.base import Communicator, address, memory_owner, unpack
from meta_dist.comm.mpi_lists import ZERO_COPY_MIN_BYTES, ListAllreduce, chunk_bounds
from meta_dist.comm.mpi_ops import (
    EXCHANGE_TAG,
    MPI_OPS,
    NUMPY_REDUCED_DTYPES,
    P2P_TAG,
    UFUNCS,
    mpi_datatype,
)
from meta_dist.comm.staging import HostStaging, staged
from meta_dist.connector import MPIConnector
from meta_dist.xp import gpu_count, select_device

# Where the pairwise exchange starts to beat the library (2 ranks, Open MPI 5 and MPICH 5 wheels,
# measured with scripts/distributed/bench_collectives.py): allreduce crosses over near 16 MiB
# (16 MiB: pairwise 1.95 ms, library 2.02; 64 MiB: 13.1 against 23.5 ms, Open MPI), since the
# library's allreduce is fast until its per-call scratch allocation dominates; an in-place
# reduce_scatter already wins at 128 KiB (40 µs against 57 through the library's scratch and a
# copy, Open MPI; 35 against 61, MPICH).
PAIRWISE_MIN_BYTES = {"allreduce": 16 * 2**20, "reduce_scatter": 128 * 1024}
SEGMENT_BYTES = 512 * 1024


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

    def __init__(
        self,
        connector: MPIConnector,
        *,
        pairwise_min_bytes: dict[str, int] | None = None,
        segment_bytes: int = SEGMENT_BYTES,
        **kwargs: Any,
    ) -> None:
        self.pairwise_min_bytes = {**PAIRWISE_MIN_BYTES, **(pairwise_min_bytes or {})}
        self.segment_bytes = segment_bytes
        super().__init__(connector, **kwargs)
        self._comm: MPI.Comm = connector.comm.Dup()
        self.staging = HostStaging(self._comm)  # CuPy arrays: CUDA-aware MPI or host copies
        self._scratch: dict[np.dtype, np.ndarray] = {}
        self._lists = ListAllreduce(self._comm, UFUNCS)

    def _call_settings(self) -> dict[str, Any]:
        """See ``Communicator._call_settings``: where the pairwise exchange starts, its steps."""
        return {"pairwise_min_bytes": self.pairwise_min_bytes, "segment_bytes": self.segment_bytes}

    def _async_p2p_problem(self, arrays: Any) -> str | None:
        first = arrays[0] if isinstance(arrays, (list, tuple)) and arrays else arrays
        if type(first) is np.ndarray:
            return None
        return ("CuPy arrays through the MPI backend are staged through host buffers shared by "
                "send and receive, so only one may run at a time")

    def _worker_started(self) -> None:
        """Make this rank's GPU current on the async thread too (CUDA's device is per thread)."""
        if "cupy" in sys.modules and gpu_count() > 0:
            select_device(self.connector.local_rank)

    # ---------------------------------------------------------------- primitives

    @staged("allreduce")
    def _allreduce(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        if self.size == 1:
            if recv is not send:
                recv[...] = send
            return
        if self._library_reduces(send, "allreduce"):
            if recv is not send:  # the standard asks every rank for MPI_IN_PLACE, or none
                recv[...] = send
            self._comm.Allreduce(MPI.IN_PLACE, recv, op=MPI_OPS[op])
            return
        bounds = chunk_bounds(send.size, self.size)
        self._pairwise_reduce(send, recv[bounds[self.rank] : bounds[self.rank + 1]], bounds, op)
        counts = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        self._comm.Allgatherv(MPI.IN_PLACE, [recv, counts, bounds[:-1], mpi_datatype(recv.dtype)])

    @staged("reduce_scatter")
    def _reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: str) -> None:
        if self.size == 1:
            if recv is not send:
                recv[...] = send
            return
        if self._library_reduces(send, "reduce_scatter"):
            if (recv.base is not None  # an array owning its memory lies in no other
                    and address(recv) == address(send) + self.rank * recv.nbytes):
                # MPI_IN_PLACE would overwrite rows 0..m of send; go through scratch instead
                scratch = self._scratch_buffer(recv.dtype, recv.size)[: recv.size]
                self._comm.Reduce_scatter_block(send, scratch, op=MPI_OPS[op])
                recv[...] = scratch
            else:
                self._comm.Reduce_scatter_block(send, recv, op=MPI_OPS[op])
            return
        bounds = [r * recv.size for r in range(self.size + 1)]
        self._pairwise_reduce(send, recv, bounds, op)

    @staged("allgather")
    def _allgather(self, send: np.ndarray, recv: np.ndarray) -> None:
        if self.size == 1:
            if address(recv) != address(send):
                recv[...] = send
            return
        mine = recv[self.rank * send.size : (self.rank + 1) * send.size]
        if address(mine) != address(send):  # MPI_IN_PLACE on every rank, as the standard asks
            mine[...] = send
        self._comm.Allgather(MPI.IN_PLACE, recv)

    @staged("broadcast")
    def _broadcast(self, buf: np.ndarray, root: int) -> None:
        if self.size > 1:
            self._comm.Bcast(buf, root=root)

    @staged("reduce")
    def _reduce(self, send: np.ndarray, recv: np.ndarray | None, op: str, root: int) -> None:
        if self.size == 1:
            if recv is not send:
                recv[...] = send
            return
        if send.dtype in NUMPY_REDUCED_DTYPES:  # see NUMPY_REDUCED_DTYPES; rare, so no fast path
            total = np.empty_like(send)
            self._allreduce(send, total, op)
            if recv is not None:
                recv[...] = total
            return
        if self.rank == root:
            if recv is not send:  # also when recv is send's memory under another object
                recv[...] = send
            self._comm.Reduce(MPI.IN_PLACE, recv, op=MPI_OPS[op], root=root)
        else:
            self._comm.Reduce(send, None, op=MPI_OPS[op], root=root)

    @staged("send")
    def _send(self, buf: np.ndarray, peer: int) -> None:
        self._comm.Send(buf, dest=peer, tag=P2P_TAG)

    @staged("recv")
    def _recv(self, buf: np.ndarray, peer: int) -> None:
        self._comm.Recv(buf, source=peer, tag=P2P_TAG)

    def _barrier(self) -> None:
        self._comm.Barrier()

    def _close_backend(self) -> None:
        self._lists.clear()
        self._scratch.clear()
        self.staging.clear()
        self._comm.Free()

    def _allreduce_list(self, sends: list[Any], outs: list[Any], op: str) -> None:
        """Host lists are reduced with few copies (``mpi_lists``).

        Whether a list is in place is each rank's own choice, and the MPI calls must not depend
        on it. Below ZERO_COPY_MIN_BYTES every list is one flat ``_allreduce`` of all its
        elements, so out of place it is packed straight from the inputs. Above it, the list
        exchange reads the inputs and writes the outputs, unless an output is another input's
        memory: then the inputs are copied into the outputs first (through the fusion buffer,
        so every input is read before any output is written) and reduced there in place.
        """
        if self.size == 1 or type(sends[0]) is not np.ndarray:
            super()._allreduce_list(sends, outs, op)
            return
        if not all(map(operator.is_, outs, sends)):
            if sum(s.nbytes for s in sends) < ZERO_COPY_MIN_BYTES:
                super()._allreduce_list(sends, outs, op)
                return
            owners = {id(memory_owner(s)) for s in sends}
            if not owners.isdisjoint(id(memory_owner(o)) for o in outs):
                unpack(self._pack(sends, "allreduce"), outs)
                sends = outs
        if not self._lists.run(sends, outs, op, self._allreduce):
            super()._allreduce_list(sends, outs, op)

    # ---------------------------------------------------------------- the pairwise reduction

    def _library_reduces(self, send: np.ndarray, api: str) -> bool:
        return (send.nbytes < self.pairwise_min_bytes[api]
                and send.dtype not in NUMPY_REDUCED_DTYPES)

    def _pairwise_reduce(self, send: np.ndarray, mine: np.ndarray, bounds: list[int],
                         op: str) -> None:
        """Reduce chunk ``rank`` of ``send`` across ranks into ``mine``.

        ``bounds`` splits ``send`` into one chunk per rank; ``mine`` may be this rank's chunk of
        ``send`` itself (in place). Segment by segment, step k sends the segment of chunk
        rank+k and adds what rank-k sent for this rank's chunk. Every rank walks the same
        number of segments, so the Sendrecv calls pair up even when chunk sizes differ.
        """
        ufunc, rank, size = UFUNCS[op], self.rank, self.size
        own = send[bounds[rank] : bounds[rank + 1]]
        if address(mine) != address(own):
            mine[...] = own
        seg = max(1, self.segment_bytes // send.itemsize)
        longest = max(hi - lo for lo, hi in itertools.pairwise(bounds))
        scratch = self._scratch_buffer(send.dtype, min(seg, longest))
        for start in range(0, longest, seg):
            part = mine[start : start + seg]
            for k in range(1, size):
                to, frm = (rank + k) % size, (rank - k) % size
                piece = send[bounds[to] + start : min(bounds[to] + start + seg, bounds[to + 1])]
                got = scratch[: part.size]
                self._comm.Sendrecv(piece, dest=to, sendtag=EXCHANGE_TAG, recvbuf=got,
                                    source=frm, recvtag=EXCHANGE_TAG)
                ufunc(part, got, out=part)

    def _scratch_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray:
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < numel:
            buf = np.empty(numel, dtype)
            self._scratch[dtype] = buf
        return buf
