"""Zero-copy allreduce of a list of numpy arrays in place, for the MPI backend.

Imports numpy, mpi4py and meta_dist.comm.mpi_backend's helpers only through arguments. MPI can
move data straight between the caller's arrays with a derived datatype (hindexed over their
absolute addresses) but refuses to reduce on one (MPI_ERR_OP in Open MPI and MPICH). So the
list is treated as one virtual buffer split into a chunk per rank: each rank sends every peer
that peer's chunk straight from the arrays, adds what it receives into its own chunk (numpy),
then sends its reduced chunk to every peer, which receives it straight into its arrays. That
saves packing into a fusion buffer and unpacking out of it, two full copies of the data.

A numpy array's data never moves, so the datatypes built for a list are kept (a few lists,
least recently used first out) and reused while the same array objects come back, which is
what a training loop does with its gradient arrays. Weak references tell a new array at a
recycled ``id`` from the same one.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

CACHED_LISTS = 4


class ListPlan:
    """The chunk datatypes and this rank's pieces for one list of arrays.

    Args:
        arrays: C-contiguous numpy arrays of one dtype.
        bounds: size+1 boundaries of the chunks in the virtual concatenation.
        rank: this rank.
        got: the receive buffer (at least this rank's chunk long); the plan keeps views of it.
    """

    def __init__(self, arrays: list[np.ndarray], bounds: list[int], rank: int,
                 got: np.ndarray) -> None:
        self.refs = [weakref.ref(a) for a in arrays]
        self.got = got
        self.types: list[MPI.Datatype] = []
        # This rank's chunk as indices, never views of the caller's arrays (the cache must not
        # keep them alive): arrays whole_lo..whole_hi lie wholly in it, each added from the
        # matching view in whole_gots; the (at most two) arrays cut by its edges are in
        # partial as (array index, first, last, view of got).
        self.whole_lo = self.whole_hi = 0
        self.whole_gots: list[np.ndarray] = []
        self.partial: list[tuple[int, int, int, np.ndarray]] = []
        starts = np.cumsum([0] + [a.size for a in arrays[:-1]]).tolist()
        try:
            self._build(arrays, bounds, rank, starts)
        except BaseException:
            self.free()  # the datatypes made before the failure
            raise

    def _build(self, arrays: list[np.ndarray], bounds: list[int], rank: int,
               starts: list[int]) -> None:
        basic = MPI._typedict[arrays[0].dtype.char]
        itemsize = arrays[0].itemsize
        for r in range(len(bounds) - 1):
            lo, hi = bounds[r], bounds[r + 1]
            lengths, addresses = [], []
            for i, (a, start) in enumerate(zip(arrays, starts, strict=True)):
                first, last = max(lo, start), min(hi, start + a.size)
                if first >= last:
                    continue
                lengths.append(last - first)
                addresses.append(MPI.Get_address(a) + (first - start) * itemsize)
                if r == rank:
                    self._add_piece(i, first - start, last - start, a.size, first - lo)
            datatype = basic.Create_hindexed(lengths, addresses)
            datatype.Commit()
            self.types.append(datatype)

    def _add_piece(self, i: int, first: int, last: int, numel: int, offset: int) -> None:
        view = self.got[offset : offset + last - first]
        if first == 0 and last == numel and (not self.whole_gots or self.whole_hi == i):
            if not self.whole_gots:
                self.whole_lo = i
            self.whole_gots.append(view)
            self.whole_hi = i + 1
        else:
            self.partial.append((i, first, last, view))

    def holds(self, arrays: list[np.ndarray]) -> bool:
        """Return True if this plan was built for exactly these array objects."""
        return len(arrays) == len(self.refs) and all(
            map(operator.is_, map(weakref.ref.__call__, self.refs), arrays))

    def add_into(self, arrays: list[np.ndarray], ufunc: np.ufunc) -> None:
        """Reduce what ``got`` holds into this rank's pieces of ``arrays``, in place."""
        for a, g in zip(arrays[self.whole_lo : self.whole_hi], self.whole_gots, strict=True):
            if a.ndim != 1:
                a = a.reshape(-1)
            ufunc(a, g, out=a)
        for i, first, last, g in self.partial:
            a = arrays[i]
            piece = (a if a.ndim == 1 else a.reshape(-1))[first:last]
            ufunc(piece, g, out=piece)

    def free(self) -> None:
        """Free the MPI datatypes."""
        for datatype in self.types:
            datatype.Free()
        self.types.clear()


class ListAllreduce:
    """In-place allreduce of lists of numpy arrays over a communicator, without fusion copies.

    Args:
        comm: the backend's MPI communicator.
        ufuncs: op name -> numpy ufunc used for the reduction.
    """

    def __init__(self, comm: MPI.Comm, ufuncs: dict[str, np.ufunc]) -> None:
        self.comm, self.ufuncs = comm, ufuncs
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._plans: OrderedDict[tuple[int, ...], ListPlan] = OrderedDict()
        self._got: dict[np.dtype, np.ndarray] = {}  # receive buffers, shared by the plans

    def run(self, arrays: list[np.ndarray], bounds: list[int], op: str) -> None:
        """Reduce ``arrays`` in place across ranks; every rank ends with the same values."""
        plan = self._plan(arrays, bounds)
        rank, size, ufunc = self.rank, self.size, self.ufuncs[op]
        for k in range(1, size):  # reduce-scatter: my chunk gathers every rank's part
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[to]], dest=to,
                               recvbuf=plan.got, source=frm)
            plan.add_into(arrays, ufunc)
        for k in range(1, size):  # allgather: my reduced chunk to everyone, theirs to me
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[rank]], dest=to,
                               recvbuf=[MPI.BOTTOM, 1, plan.types[frm]], source=frm)

    def _plan(self, arrays: list[np.ndarray], bounds: list[int]) -> ListPlan:
        key = tuple(map(id, arrays))
        plan = self._plans.get(key)
        if plan is not None and plan.holds(arrays):
            self._plans.move_to_end(key)
            return plan
        if plan is not None:
            del self._plans[key]
            plan.free()
        plan = self._plans[key] = ListPlan(arrays, bounds, self.rank,
                                           self._receive_buffer(arrays[0].dtype, bounds))
        while len(self._plans) > CACHED_LISTS:
            self._plans.popitem(last=False)[1].free()
        return plan

    def _receive_buffer(self, dtype: np.dtype, bounds: list[int]) -> np.ndarray:
        """Return the shared receive buffer, sized for this rank's chunk (plans view it)."""
        numel = bounds[self.rank + 1] - bounds[self.rank]
        got = self._got.get(dtype)
        if got is None or got.size < numel:
            self.clear()  # the cached plans view the old buffer; build them again
            got = self._got[dtype] = np.empty(numel, dtype)
        return got[:numel]

    def clear(self) -> None:
        """Free every cached datatype and receive buffer."""
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
        self._got.clear()
