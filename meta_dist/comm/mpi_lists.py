"""Allreduce of a list of numpy arrays, with as few copies as the layout allows.

Imports numpy, mpi4py, meta_dist.comm.base (two array helpers) and meta_dist.comm.mpi_ops;
the MPI backend passes its flat allreduce in. Packing a list into a fusion buffer and
unpacking it again costs two full copies of the data; these cases avoid them:

- Arrays laid out back to back in memory (views of one buffer, as
  ``meta_dist.contiguous_arrays`` makes them, the way DDP's gradient_as_bucket_view and
  DeepSpeed's contiguous gradients lay out gradients) are one run of memory: reduced in place
  as one flat array, with no copy at all.
- From ZERO_COPY_MIN_BYTES, arrays of ALONE_MIN_BYTES or more are reduced one by one: a
  library call that size is bandwidth-bound already, and fusing them was slower than the
  raw per-array calls (33 MiB of 1.6K-80K-element arrays: 14.6 ms fused, 10.6 ms raw).
- The other arrays of such a list move through MPI derived datatypes (hindexed over their
  absolute addresses) straight out of the caller's input arrays. MPI refuses to reduce on a
  derived datatype (MPI_ERR_OP in Open MPI and MPICH), so they form one virtual buffer split
  into a chunk per rank: each rank sends every peer that peer's chunk from the arrays and adds
  what it receives into its own chunk (numpy), then sends its reduced chunk to every peer.
  In place, the sums go straight into the arrays and the second exchange moves between
  them. Out of place, the rank's chunk is packed once and summed in that buffer, and what comes
  back is unpacked into the outputs: the plan is the inputs', which a caller passes again
  and again, while outputs are new arrays each call (``out=None``).

Below ZERO_COPY_MIN_BYTES a list that is not adjacent is left to the caller, which packs it:
one library call then has the lower latency. Every choice that shapes the MPI calls depends on
sizes (the same on every rank) or on a flag the ranks agree on, since one rank's list may be
adjacent where another's is not, and one rank may reduce in place where another does not.

A numpy array's data never moves, so what is learned about a list (its layout, its datatypes)
is kept for a few lists, least recently used first out, and reused while the same array objects
come back, which is what a training loop does with its gradient arrays. Weak references tell a
new array at a recycled ``id`` from the same one; they also make numpy refuse to ``resize`` the
arrays (which would move their data under the same object) while a plan lives.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from meta_dist.comm.base import flat_view, unpack
from meta_dist.comm.mpi_ops import EXCHANGE_TAG, mpi_datatype

CACHED_LISTS = 8
# Measured with scripts/distributed/bench_fusion.py and per-size sweeps, 2 ranks, Open MPI 5:
# below this total a packed buffer and one library call beat the datatype exchange
ZERO_COPY_MIN_BYTES = 256 * 1024
# arrays from this size gain nothing from fusion (the library call is bandwidth-bound)
ALONE_MIN_BYTES = 64 * 1024

FlatReduce = Callable[[np.ndarray, np.ndarray, str], None]


class ListPlan:
    """What one list of arrays needs: its layout, and the datatypes of its fused part.

    Args:
        arrays: C-contiguous numpy arrays of one dtype.
        size: the number of ranks.
        rank: this rank.
        receive: returns the receive buffer for a chunk of so many elements (shared by plans).
    """

    def __init__(self, arrays: list[np.ndarray], size: int, rank: int,
                 receive: Callable[[np.dtype, int], np.ndarray]) -> None:
        # One array freed ends the plan: its id may come back on another array. While every
        # array lives, the ids the cache is keyed by name exactly these objects.
        alive = self.alive = [True]

        def died(_ref: weakref.ref, alive: list[bool] = alive) -> None:
            alive[0] = False

        self.refs = [weakref.ref(a, died) for a in arrays]
        self.numel = sum(a.size for a in arrays)
        self.small = self.numel * arrays[0].itemsize < ZERO_COPY_MIN_BYTES
        self.adjacent = _adjacent(arrays)  # this rank's layout only; see ListAllreduce.run
        # Arrays reduced one by one, and those fused (None: all of them, in list order).
        self.alone: list[int] = [] if self.small else [
            i for i, a in enumerate(arrays) if a.nbytes >= ALONE_MIN_BYTES]
        self.fused: list[int] | None = None
        if self.alone:
            skip = set(self.alone)
            self.fused = [i for i in range(len(arrays)) if i not in skip]
        self.types: list[MPI.Datatype] = []
        # Each rank's chunk of the fused arrays as pieces (index, first, last, whole): elements
        # first..last of fused array index, whole if that is all of it. Indices, never views of
        # the caller's arrays: the cache must not keep them alive.
        self.bounds: list[int] = []
        self.pieces: list[list[tuple[int, int, int, bool]]] = []
        # This rank's chunk again, for adding in place: fused arrays whole_lo..whole_hi lie
        # wholly in it, each added from the matching view in whole_gots; the (at most two)
        # arrays cut by its edges are in partial as (index, first, last, view of got).
        self.whole_lo = self.whole_hi = 0
        self.whole_gots: list[np.ndarray] = []
        self.partial: list[tuple[int, int, int, np.ndarray]] = []
        fused = self.fused_arrays(arrays)
        if self.small or not fused:
            return
        sizes = [a.size for a in fused]
        self.bounds = chunk_bounds(sum(sizes), size)
        self.got = receive(arrays[0].dtype, self.bounds[1])  # chunk 0 is the longest
        starts = np.cumsum([0] + sizes[:-1]).tolist()
        try:
            self._build(fused, rank, starts)
        except BaseException:
            self.free()  # the datatypes made before the failure
            raise

    def fused_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Return the arrays of ``arrays`` that move fused."""
        return arrays if self.fused is None else [arrays[i] for i in self.fused]

    def _build(self, arrays: list[np.ndarray], rank: int, starts: list[int]) -> None:
        basic = mpi_datatype(arrays[0].dtype)
        itemsize = arrays[0].itemsize
        bounds = self.bounds
        for r in range(len(bounds) - 1):
            lo, hi = bounds[r], bounds[r + 1]
            lengths, addresses, pieces = [], [], []
            for i, (a, start) in enumerate(zip(arrays, starts, strict=True)):
                first, last = max(lo, start), min(hi, start + a.size)
                if first >= last:
                    continue
                address = MPI.Get_address(a) + (first - start) * itemsize
                if addresses and addresses[-1] + lengths[-1] * itemsize == address:
                    lengths[-1] += last - first  # adjacent in memory: one block
                else:
                    lengths.append(last - first)
                    addresses.append(address)
                pieces.append((i, first - start, last - start, last - first == a.size))
                if r == rank:
                    self._add_piece(i, first - start, last - start, a.size, first - lo)
            self.pieces.append(pieces)
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

    def holds(self) -> bool:
        """Return True while every array the plan was built for lives (then the ids match)."""
        return self.alive[0]

    def chunk(self, r: int) -> int:
        """Return how many elements rank ``r``'s chunk of the fused arrays holds."""
        return self.bounds[r + 1] - self.bounds[r]

    def views(self, fused: list[np.ndarray], r: int) -> list[np.ndarray]:
        """Return rank ``r``'s chunk of the fused arrays (laid out like these) as flat views."""
        return [flat_view(fused[i]) if whole else flat_view(fused[i])[first:last]
                for i, first, last, whole in self.pieces[r]]

    def add_into(self, fused: list[np.ndarray], ufunc: np.ufunc) -> None:
        """Reduce what ``got`` holds into this rank's pieces of the fused arrays, in place."""
        for a, g in zip(fused[self.whole_lo : self.whole_hi], self.whole_gots, strict=True):
            if a.ndim != 1:
                a = a.reshape(-1)
            ufunc(a, g, out=a)
        for i, first, last, g in self.partial:
            piece = flat_view(fused[i])[first:last]
            ufunc(piece, g, out=piece)

    def free(self) -> None:
        """Free the MPI datatypes."""
        for datatype in self.types:
            datatype.Free()
        self.types.clear()


class ListAllreduce:
    """Allreduce of lists of numpy arrays over a communicator, with few copies.

    Args:
        comm: the backend's MPI communicator.
        ufuncs: op name -> numpy ufunc used for the reduction.
    """

    def __init__(self, comm: MPI.Comm, ufuncs: dict[str, np.ufunc]) -> None:
        self.comm, self.ufuncs = comm, ufuncs
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._plans: OrderedDict[tuple[int, ...], ListPlan] = OrderedDict()
        self._got: dict[np.dtype, np.ndarray] = {}  # receive buffers, shared by the plans
        self._packed: dict[np.dtype, np.ndarray] = {}  # this rank's chunk, out of place
        self._flag = np.empty(1, np.int32)

    def run(self, sends: list[np.ndarray], outs: list[np.ndarray], op: str,
            reduce_flat: FlatReduce) -> bool:
        """Reduce ``sends`` into ``outs`` across ranks unless packing is better; say whether.

        ``outs`` is ``sends`` itself (in place) or arrays sharing no memory with them.
        ``reduce_flat`` is the backend's allreduce of one flat array. A small list is reduced
        here only in place and if its arrays are adjacent, with the same ``reduce_flat`` call the
        caller makes on a packed buffer; otherwise this returns False and the caller packs. A
        larger list is one flat array if every rank's list is adjacent (one small allreduce
        decides; out of place the caller packs it), else it moves as described in the module
        docstring. Collective.
        """
        plan = self._plan(sends)
        in_place = outs is sends or all(map(operator.is_, outs, sends))
        if plan.small:
            if not (in_place and plan.adjacent):
                return False
            reduce_flat(*_run_of(sends, plan.numel), op)
            return True
        if self._everywhere(plan.adjacent):
            if not in_place:
                return False
            reduce_flat(*_run_of(sends, plan.numel), op)
            return True
        for i in plan.alone:
            reduce_flat(flat_view(sends[i]), flat_view(outs[i]), op)
        if plan.types:
            fused_sends = plan.fused_arrays(sends)
            if in_place:
                self._exchange_in_place(plan, fused_sends, op)
            else:
                self._exchange(plan, fused_sends, plan.fused_arrays(outs), op)
        return True

    def _exchange_in_place(self, plan: ListPlan, fused: list[np.ndarray], op: str) -> None:
        rank, size, ufunc = self.rank, self.size, self.ufuncs[op]
        got = plan.got[: plan.chunk(rank)]
        for k in range(1, size):  # reduce-scatter: my chunk gathers every rank's part
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[to]], dest=to, sendtag=EXCHANGE_TAG,
                               recvbuf=got, source=frm, recvtag=EXCHANGE_TAG)
            plan.add_into(fused, ufunc)
        for k in range(1, size):  # allgather: my reduced chunk to everyone, theirs to me
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[rank]], dest=to, sendtag=EXCHANGE_TAG,
                               recvbuf=[MPI.BOTTOM, 1, plan.types[frm]], source=frm,
                               recvtag=EXCHANGE_TAG)

    def _exchange(self, plan: ListPlan, sends: list[np.ndarray], outs: list[np.ndarray],
                  op: str) -> None:
        """The exchange out of place: the same messages as in place, summed in a packed chunk.

        The first exchange sends from the inputs' datatypes, as in place; this rank's chunk is
        packed once and the parts received are added to it (one ufunc call each). Its reduced
        chunk then goes out contiguous, and every chunk is unpacked into the outputs.
        """
        rank, size, ufunc = self.rank, self.size, self.ufuncs[op]
        mine = self._packed_buffer(sends[0].dtype, plan.chunk(rank))
        if mine.size:
            np.concatenate(plan.views(sends, rank), out=mine)
        got = plan.got[: mine.size]
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            self.comm.Sendrecv([MPI.BOTTOM, 1, plan.types[to]], dest=to, sendtag=EXCHANGE_TAG,
                               recvbuf=got, source=frm, recvtag=EXCHANGE_TAG)
            ufunc(mine, got, out=mine)
        for k in range(1, size):
            to, frm = (rank + k) % size, (rank - k) % size
            theirs = plan.got[: plan.chunk(frm)]
            self.comm.Sendrecv(mine, dest=to, sendtag=EXCHANGE_TAG, recvbuf=theirs, source=frm,
                               recvtag=EXCHANGE_TAG)
            unpack(theirs, plan.views(outs, frm))
        unpack(mine, plan.views(outs, rank))

    def _everywhere(self, flag: bool) -> bool:
        """Return True on every rank if ``flag`` is True on every rank. Collective."""
        self._flag[0] = flag
        self.comm.Allreduce(MPI.IN_PLACE, self._flag, op=MPI.MIN)
        return bool(self._flag[0])

    def _plan(self, arrays: list[np.ndarray]) -> ListPlan:
        key = tuple(map(id, arrays))
        plan = self._plans.get(key)
        if plan is not None and plan.holds():
            self._plans.move_to_end(key)
            return plan
        if plan is not None:
            del self._plans[key]
            plan.free()
        plan = self._plans[key] = ListPlan(arrays, self.size, self.rank, self._receive_buffer)
        while len(self._plans) > CACHED_LISTS:
            self._plans.popitem(last=False)[1].free()
        return plan

    def _receive_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """Return the shared receive buffer for ``numel`` elements (plans keep views of it)."""
        got = self._got.get(dtype)
        if got is None or got.size < numel:
            self.clear()  # the cached plans view the old buffer; build them again
            got = self._got[dtype] = np.empty(numel, dtype)
        return got[:numel]

    def _packed_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray:
        """Return the reused buffer this rank's chunk is summed in out of place."""
        packed = self._packed.get(dtype)
        if packed is None or packed.size < numel:
            packed = self._packed[dtype] = np.empty(numel, dtype)
        return packed[:numel]

    def clear(self) -> None:
        """Free every cached datatype and buffer."""
        for plan in self._plans.values():
            plan.free()
        self._plans.clear()
        self._got.clear()
        self._packed.clear()


def _adjacent(arrays: list[np.ndarray]) -> bool:
    """Return True if the arrays lie back to back in memory, in list order, with no gap."""
    end = None
    for a in arrays:
        if a.size == 0:
            continue
        start = MPI.Get_address(a)
        if end is not None and start != end:
            return False
        end = start + a.nbytes
    return True


def _run_of(arrays: list[np.ndarray], numel: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (send, recv) for one flat view over adjacent arrays (in place: the same view).

    The view starts at the first non-empty array and spans exactly the arrays' memory, which
    _adjacent found to be one run, so it reaches no byte outside them.
    """
    first = next((a for a in arrays if a.size), arrays[0])
    run = np.lib.stride_tricks.as_strided(flat_view(first), shape=(numel,))
    return run, run


def chunk_bounds(numel: int, parts: int) -> list[int]:
    """Return parts+1 boundaries splitting numel elements as evenly as possible."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds
