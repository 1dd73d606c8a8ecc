"""ZeroStage0..2: one class per ZeRO level, in order of increasing sharding.

Imports meta_dist.optim and meta_dist.zero.flat (meta_dist.comm.base for type hints only).
A stage owns the gradient buffers and the optimizer; the trainer calls ``attach`` once, runs
forward and ``model.backward`` (the stage's hooks reduce each bucket as soon as backward has
written all of it), then ``step()``. Gradients are averaged in exactly one place: the
collectives' op "avg" (``Communicator._average``). The trainer never branches on the level.

Bytes held per rank, Ψ parameters, N ranks, K optimizer bytes per parameter (Adam fp32: 8):
level 0: 4Ψ + 4Ψ + KΨ;  level 1: 4Ψ + 4Ψ + KΨ/N;  level 2: 4Ψ + 4Ψ/N + KΨ/N + staging, at
most the configured bucket size (two half-size buffers with overlap; none on one rank).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meta_dist.optim import Optimizer
from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket, Slot, bucket_numel

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Communicator, Handle

OptimizerFactory = Callable[[int], Optimizer]


class ZeroStage:
    """Base: a full gradient buffer, each bucket reduced once backward has written all of it.

    Backward writes gradients at ever lower flat offsets (``zero.partition``), so a bucket is
    complete as soon as backward has written below its start; its reduction then starts
    (asynchronously with ``overlap``, else at once) while backward goes on.

    Args:
        flat: the model bound to its flat parameter buffer.
        comm: the communicator of the data-parallel ranks.
        make_optimizer: builds an optimizer for a given number of elements.
        overlap: reduce buckets on the communication thread while backward continues.
    """

    level = -1

    @classmethod
    def bucket_numel(cls, cap: int, total: int, overlap: bool) -> int:
        """Return elements per bucket for a configured cap (elements) and a model of ``total``."""
        return bucket_numel(total, cap)

    def __init__(self, flat: FlatModel, comm: Communicator, make_optimizer: OptimizerFactory,
                 overlap: bool = True) -> None:
        self.flat, self.comm, self.overlap = flat, comm, overlap
        self.rank = comm.rank
        self._pending: list[Handle] = []
        self._next = len(flat.buckets) - 1  # the highest bucket not yet being reduced
        self.flat_grads = self._make_grads()
        self.optimizer = make_optimizer(sum(s.stop - s.start for s in self.owned_slices()))

    # ------------------------------------------------------------ what differs between levels

    def owned_slices(self) -> list[slice]:
        """The parts of the flat buffer this rank updates (level 0: all of it)."""
        return [slice(0, self.flat.flat_params.size)]

    def _make_grads(self) -> Any:
        grads = self.flat.xp.zeros(self.flat.flat_params.size, self.flat.dtype)
        for layer in self.flat.layer_slots:
            self.flat.bind_grads(layer, grads)
        return grads

    def _reduce_bucket(self, bucket: Bucket) -> Handle | None:
        """Average one bucket's gradients across ranks (allreduce, in place)."""
        grads = self.flat_grads[bucket.whole]
        if self.overlap:
            return self.comm.allreduce_async(grads, "avg", out=grads)
        self.comm.allreduce(grads, "avg", out=grads)
        return None

    def _local_grads(self) -> list[Any]:
        return [self.flat_grads[s] for s in self.owned_slices()]

    def _shard_grads(self) -> list[Any]:
        """This rank's shard of every bucket's reduced gradient, at every level.

        The ranks' shards together cover every gradient once: what a check looks at.
        """
        return [self.flat_grads[b.shard(self.rank)] for b in self.flat.buckets]

    def _after_update(self) -> None:
        """Level 0: every rank updated everything; nothing to gather."""

    def _before_layer(self, layer: int) -> None:
        """Hook before a layer's backward; level 2 points its grads at a staging buffer here."""

    def _streams_buckets(self) -> bool:
        """Whether buckets are reduced as backward completes them, or all at once in step().

        Without overlap, reducing bucket by bucket only adds points where the ranks wait for
        each other; one call in step() is faster. Level 2 must: its staging is reused.
        """
        return self.overlap

    # ------------------------------------------------------------ the shared step

    def attach(self) -> None:
        """Install the backward hooks on the model (call once)."""
        self.flat.model.before_backward = self._before_layer
        self.flat.model.after_backward = self._after_layer

    def _after_layer(self, layer: int) -> None:
        slots = self.flat.layer_slots.get(layer)
        if slots and self._streams_buckets():
            self._written(slots[0].offset)

    def _written(self, offset: int) -> None:
        """Backward has written every gradient from flat ``offset`` up: reduce what is done."""
        buckets = self.flat.buckets
        while self._next >= 0 and buckets[self._next].start >= offset:
            handle = self._reduce_bucket(buckets[self._next])
            if handle is not None:
                self._pending.append(handle)
            self._next -= 1

    def step(self, guard: Any = None) -> None:
        """Finish the gradient reduction, update this rank's part, and share the result.

        ``guard`` (a ``train.guard.FiniteGuard``) sees the reduced gradients this rank owns
        first and may veto the update (on every rank alike).
        """
        self._finish_reduction()
        params = [self.flat.flat_params[s] for s in self.owned_slices()]
        if guard is None or guard.inspect(self._shard_grads(), [b.shard(self.rank).start
                                                              for b in self.flat.buckets]):
            self.optimizer.step(params, self._local_grads())
        self._after_update()

    def broadcast_params(self, root: int = 0) -> None:
        """Give every rank ``root``'s parameters: one in-place broadcast per bucket. Collective."""
        params = self.flat.flat_params
        for bucket in self.flat.buckets:
            self.comm.broadcast(params[bucket.whole], root, out=params[bucket.whole])

    def _finish_reduction(self) -> None:
        """Reduce any bucket backward did not complete, then wait for every reduction."""
        if not self._streams_buckets():
            self.comm.allreduce(self.flat_grads, "avg", out=self.flat_grads)
            return
        self._written(0)
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        self._next = len(self.flat.buckets) - 1

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: params, grads (kept between steps), optimizer state, buffers."""
        return {"params": int(self.flat.flat_params.nbytes),
                "grads": int(self.flat_grads.nbytes),
                "optimizer": int(self.optimizer.state_bytes()),
                "buffers": 0}


class ZeroStage0(ZeroStage):
    """Plain data parallelism: average all grads (allreduce), every rank updates everything.

    Memory: params, grads and optimizer state all full size on every rank.
    """

    level = 0


class ZeroStage1(ZeroStage0):
    """ZeRO-1: average all grads (allreduce), update only my shard, then allgather the params.

    Memory: optimizer state ≈ 1/N of level 0's; params and grads full size.
    """

    level = 1

    def owned_slices(self) -> list[slice]:
        """This rank's shard of every bucket."""
        return [bucket.shard(self.rank) for bucket in self.flat.buckets]

    def _after_update(self) -> None:
        params = self.flat.flat_params
        handles = [self.comm.allgather_async(params[b.shard(self.rank)], out=params[b.whole])
                   for b in self.flat.buckets]
        for handle in handles:
            handle.wait()


class ZeroStage2(ZeroStage1):
    """ZeRO-2: reduce-scatter each bucket as backward completes it, keep only my grad shard.

    The full-size gradient never exists: a bucket's grads land in a staging buffer (a layer
    larger than a bucket writes into it a block of rows at a time), are reduce-scattered
    (averaged) into this rank's grad shard, and the buffer takes the next bucket. With overlap
    two staging buffers alternate and buckets are planned at half the configured size, so the
    staging is at most the configured size; on one rank the shard is the whole bucket and
    backward writes straight into it.
    Memory: grads ≈ 1/N of level 0's plus the staging; optimizer state ≈ 1/N.
    """

    level = 2

    @classmethod
    def bucket_numel(cls, cap: int, total: int, overlap: bool) -> int:
        """Half-size buckets with overlap: the two staging buffers together make one bucket.

        The staging is then at most a quarter of the model as well, so grad shard + staging
        stays below level 1's full gradient from two ranks up.
        """
        return max(1, bucket_numel(total, cap) // (2 if overlap else 1))

    def _make_grads(self) -> Any:
        flat, xp = self.flat, self.flat.xp
        self._shard_start, offset = {}, 0
        for bucket in flat.buckets:
            self._shard_start[bucket.index] = offset
            offset += bucket.shard_size
        grads = xp.zeros(offset, flat.dtype)  # this rank's shard of every bucket, end to end
        count = 2 if self.overlap and len(flat.buckets) > 1 else 1
        largest = max(b.padded_size for b in flat.buckets)
        self._staging = [] if self.comm.size == 1 else [
            xp.zeros(largest, flat.dtype) for _ in range(count)]
        self._free = list(range(len(self._staging)))
        self._busy: deque[tuple[Handle, int]] = deque()  # reductions reading a staging buffer
        self._bound: dict[int, Any] = {}  # bucket index -> its staging for this backward
        self._pads = {b.index: _padding(b, flat.slots) for b in flat.buckets}
        for layer, buckets in flat.layer_buckets.items():
            if len(buckets) > 1:  # a layer across buckets writes them one block at a time
                flat.bind_blocks(layer, self._block, self._written)
        return grads

    def _streams_buckets(self) -> bool:
        """See ``ZeroStage._streams_buckets``: always, the staging is reused."""
        return True

    def _grad_shard(self, bucket: Bucket) -> Any:
        start = self._shard_start[bucket.index]
        return self.flat_grads[start : start + bucket.shard_size]

    def _local_grads(self) -> list[Any]:
        return [self._grad_shard(b) for b in self.flat.buckets]

    _shard_grads = _local_grads

    def _before_layer(self, layer: int) -> None:
        buckets = self.flat.layer_buckets.get(layer)
        if buckets and len(buckets) == 1:  # the layer's grads go straight into the staging
            self.flat.bind_grads(layer, self._staging_of(buckets[0]), buckets[0].start)

    def _block(self, bucket: Bucket, slot: Slot, first: int, stop: int) -> Any:
        begin = slot.offset + first * slot.row - bucket.start
        return self._staging_of(bucket)[begin : begin + (stop - first) * slot.row].reshape(
            (stop - first, *slot.shape[1:]))

    def _staging_of(self, bucket: Bucket) -> Any:
        """Return the bucket's staging buffer, taking a free one (or the next to free) first."""
        staging = self._bound.get(bucket.index)
        if staging is not None:
            return staging
        if not self._staging:  # one rank: the shard is the bucket
            staging = self._grad_shard(bucket)
        else:
            if not self._free:  # both in use: wait for the older reduction
                handle, which = self._busy.popleft()
                handle.wait()
                self._free.append(which)
            staging = self._staging[self._free.pop(0)]
        for lo, hi in self._pads[bucket.index]:
            staging[lo:hi] = 0  # padding has no gradients; the buffer held another bucket
        self._bound[bucket.index] = staging
        return staging

    def _reduce_bucket(self, bucket: Bucket) -> Handle | None:
        """Average one bucket across ranks, keeping only my shard (reduce-scatter)."""
        reached = bucket.index in self._bound
        staging = self._staging_of(bucket)
        if not reached:  # backward never wrote it (step without backward): no gradient
            staging[: bucket.padded_size] = 0
        del self._bound[bucket.index]
        send, out = staging[: bucket.padded_size], self._grad_shard(bucket)
        which = next((i for i, s in enumerate(self._staging) if s is staging), None)
        if not self.overlap:
            self.comm.reduce_scatter(send, "avg", out=out)
            if which is not None:
                self._free.append(which)
            return None
        handle = self.comm.reduce_scatter_async(send, "avg", out=out)
        if which is not None:
            self._busy.append((handle, which))
        return handle

    def _finish_reduction(self) -> None:
        super()._finish_reduction()
        while self._busy:
            self._free.append(self._busy.popleft()[1])  # their handles were waited for

    def memory_report(self) -> dict[str, int]:
        """See ``ZeroStage.memory_report``; ``buffers`` are the staging buffers."""
        report = super().memory_report()
        report["buffers"] = int(sum(s.nbytes for s in self._staging))
        return report


def _padding(bucket: Bucket, slots: list[Slot]) -> list[tuple[int, int]]:
    """Return the bucket's padding as (lo, hi) ranges relative to its start."""
    taken = sorted((max(s.offset, bucket.start), min(s.offset + s.numel, bucket.stop))
                   for s in slots if s.offset < bucket.stop and bucket.start < s.offset + s.numel)
    gaps, at = [], bucket.start
    for lo, hi in taken:
        if lo > at:
            gaps.append((at - bucket.start, lo - bucket.start))
        at = max(at, hi)
    if at < bucket.stop:
        gaps.append((at - bucket.start, bucket.stop - bucket.start))
    return gaps


STAGES: dict[int, type[ZeroStage]] = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2}
