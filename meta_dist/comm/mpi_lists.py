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

import weakref
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

CACHED_LISTS = 4


class ListPlan:
    """The chunk datatypes and this rank's pieces for one list of arrays.

    Args:
        arrays: C-contiguous numpy arrays of one dtype.
        bounds: size+1 boundaries of the chunks in the virtual concatenation.
        rank: this rank.
    """

    def __init__(self, arrays: list[np.ndarray], bounds: list[int], rank: int) -> None:
        self.refs = [weakref.ref(a) for a in arrays]
        basic = MPI._typedict[arrays[0].dtype.char]
        itemsize = arrays[0].itemsize
        self.types: list[MPI.Datatype] = []
        # my chunk as (array index, first, last, offset in chunk): indices, not views, so the
        # cache never keeps the caller's arrays alive
        self.mine: list[tuple[int, int, int, int]] = []
        starts = np.cumsum([0] + [a.size for a in arrays[:-1]]).tolist()
        try:
            self._build(arrays, bounds, rank, starts, basic, itemsize)
        except BaseException:
            self.free()  # the datatypes made before the failure
            raise

    def _build(self, arrays: list[np.ndarray], bounds: list[int], rank: int, starts: list[int],
               basic: MPI.Datatype, itemsize: int) -> None:
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
                    self.mine.append((i, first - start, last - start, first - lo))
            datatype = basic.Create_hindexed(lengths, addresses)
            datatype.Commit()
            self.types.append(datatype)

    def holds(self, arrays: list[np.ndarray]) -> bool:
        """Return True if this plan was built for exactly these array objects."""
        return len(arrays) == len(self.refs) and all(
            ref() is a for ref, a in zip(self.refs, arrays, strict=True))

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
        scratch: returns a reused buffer of a dtype and length.
    """

    def __init__(self, comm: MPI.Comm, ufuncs: dict[str, np.ufunc],
                 scratch: Callable[[np.dtype, int], np.ndarray]) -> None:
        self.comm, self.ufuncs, self.scratch = comm, ufuncs, scratch
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._plans: OrderedDict[tuple[int, ...], ListPlan] = OrderedDict()

    def run(self, arrays: list[np.ndarray], bounds: list[int], op: str) -> None:
        """Reduce ``arrays`` in place across ranks; every rank ends with the same values."""
        plan = self._plan(arrays, bounds)
        rank, size, ufunc = self.rank, self.size, self.ufuncs[op]
        got = self.scratch(arrays[0].dtype, bounds[rank + 1] - bounds[rank])
        for k in range(1, size):  # reduce-scatter: my chunk gathers every rank's part
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[to]], dest=to,
                               recvbuf=got, source=frm)
            for i, first, last, offset in plan.mine:
                a = arrays[i]
                piece = (a if a.ndim == 1 else a.reshape(-1))[first:last]
                ufunc(piece, got[offset : offset + last - first], out=piece)
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
            plan.free()
        plan = self._plans[key] = ListPlan(arrays, bounds, self.rank)
        while len(self._plans) > CACHED_LISTS:
            self._plans.popitem(last=False)[1].free()
        return plan

    def clear(self) -> None:
        """Free every cached datatype."""
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
