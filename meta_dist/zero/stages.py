"""ZeroStage0..2: one class per ZeRO level, in order of increasing sharding.

Imports meta_dist.comm.base (the interface only), meta_dist.optim and meta_dist.zero.flat.
A stage owns the gradient buffers and the optimizer; the trainer calls ``attach`` once, runs
forward and ``model.backward`` (the stage's hooks reduce buckets as backward produces them),
then ``step()``. Gradients are averaged in exactly one place: the collectives' op "avg"
(``Communicator._average``). The trainer never branches on the level.

Bytes held per rank, Ψ parameters, N ranks, K optimizer bytes per parameter (Adam fp32: 8):
level 0: 4Ψ + 4Ψ + KΨ;  level 1: 4Ψ + 4Ψ + KΨ/N;  level 2: 4Ψ + 4Ψ/N + KΨ/N + staging buckets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meta_dist.comm.base import Communicator, Handle
from meta_dist.optim import Optimizer
from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket

OptimizerFactory = Callable[[int], Optimizer]


class ZeroStage:
    """Base: full gradient buffer, reduced bucket by bucket; subclasses say who updates what.

    Args:
        flat: the model bound to its flat parameter buffer.
        comm: the communicator of the data-parallel ranks.
        make_optimizer: builds an optimizer for a given number of elements.
        overlap: start each bucket's reduction as soon as backward has produced it; otherwise
            reduce every bucket together when ``step()`` begins.
    """

    level = -1

    @classmethod
    def bucket_numel(cls, bucket_bytes: float, itemsize: int, overlap: bool) -> int:
        """Return the plan's elements per bucket for a configured bucket size in bytes."""
        return max(1, int(bucket_bytes) // itemsize)

    def __init__(self, flat: FlatModel, comm: Communicator, make_optimizer: OptimizerFactory,
                 overlap: bool = True) -> None:
        self.flat, self.comm, self.overlap = flat, comm, overlap
        self.rank = comm.rank
        self._pending: list[Handle] = []
        self.flat_grads = self._make_grad_buffer()
        self.optimizer = make_optimizer(sum(len_of(s) for s in self.owned_slices()))

    # ------------------------------------------------------------ what differs between levels

    def owned_slices(self) -> list[slice]:
        """The parts of the flat buffer this rank updates (level 0: all of it)."""
        return [slice(0, self.flat.flat_params.size)]

    def _make_grad_buffer(self) -> Any:
        grads = self.flat.xp.zeros_like(self.flat.flat_params)
        for bucket in self.flat.buckets:
            self.flat.bind_grads(grads, bucket, bucket.start)
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

    def _after_update(self) -> None:
        """Level 0: every rank updated everything; nothing to gather."""

    # ------------------------------------------------------------ the shared step

    def attach(self) -> None:
        """Install the backward hooks on the model (call once)."""
        self.flat.model.before_backward = self._before_layer
        self.flat.model.after_backward = self._after_layer

    def _before_layer(self, layer: int) -> None:
        """Hook before a layer's backward; level 2 binds its staging buffer here."""

    def _after_layer(self, layer: int) -> None:
        bucket = self.flat.bucket_of_layer[layer]
        if layer == bucket.first_layer and self.overlap:  # the bucket's last grads are in
            self._pending.append(self._reduce_bucket(bucket))

    def step(self) -> None:
        """Finish the gradient reduction, update this rank's part, and share the result."""
        self._finish_reduction()
        params = [self.flat.flat_params[s] for s in self.owned_slices()]
        self.optimizer.step(params, self._local_grads())
        self._after_update()

    def _finish_reduction(self) -> None:
        """Wait for the buckets reduced during backward (without overlap: reduce them now)."""
        if not self.overlap:  # buckets only serve overlap: reduce the whole buffer at once
            self.comm.allreduce(self.flat_grads, "avg", out=self.flat_grads)
        for handle in self._pending:
            handle.wait()
        self._pending.clear()

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
    """ZeRO-2: reduce-scatter each bucket as backward produces it, keep only my grad shard.

    The full-size gradient never exists: a bucket's grads land in a staging buffer, are
    reduce-scattered (averaged) into this rank's grad shard, and the buffer is reused. With
    overlap two staging buffers alternate (buckets are planned at half the configured size),
    so staging stays about one bucket; a layer larger than that is a bucket of its own.
    Memory: grads ≈ 1/N of level 0's plus the staging; optimizer state ≈ 1/N.
    """

    level = 2

    @classmethod
    def bucket_numel(cls, bucket_bytes: float, itemsize: int, overlap: bool) -> int:
        """Half-size buckets with overlap: the two staging buffers together make one bucket."""
        return max(1, int(bucket_bytes) // itemsize // (2 if overlap else 1))

    def _make_grad_buffer(self) -> Any:
        xp, dtype, buckets = self.flat.xp, self.flat.dtype, self.flat.buckets
        self._shard_start = {}
        offset = 0
        for bucket in buckets:
            self._shard_start[bucket.index] = offset
            offset += bucket.shard_size
        count = 2 if self.overlap and len(buckets) > 1 else 1  # a second one only helps overlap
        # buckets alternate between the buffers; each is as large as the largest it receives
        sizes = [max(b.padded_size for b in buckets[k::count]) for k in range(count)]
        self._staging = [xp.zeros(size, dtype) for size in sizes]
        self._staging_busy: list[Handle | None] = [None] * len(self._staging)
        return xp.zeros(offset, dtype)  # this rank's grad shard of every bucket, end to end

    def _grad_shard(self, bucket: Bucket) -> Any:
        start = self._shard_start[bucket.index]
        return self.flat_grads[start : start + bucket.shard_size]

    def _local_grads(self) -> list[Any]:
        return [self._grad_shard(b) for b in self.flat.buckets]

    def _staging_for(self, bucket: Bucket) -> int:
        return bucket.index % len(self._staging)

    def _before_layer(self, layer: int) -> None:
        bucket = self.flat.bucket_of_layer[layer]
        if layer == bucket.last_layer:  # the bucket's first grads are about to be written
            which = self._staging_for(bucket)
            if self._staging_busy[which] is not None:  # still being reduced: wait for it
                self._staging_busy[which].wait()
                self._staging_busy[which] = None
            self.flat.bind_grads(self._staging[which], bucket, 0)

    def _after_layer(self, layer: int) -> None:
        bucket = self.flat.bucket_of_layer[layer]
        if layer == bucket.first_layer:
            self._staging_busy[self._staging_for(bucket)] = self._reduce_bucket(bucket)

    def _reduce_bucket(self, bucket: Bucket) -> Handle | None:
        """Average one bucket across ranks, keeping only my shard (reduce-scatter)."""
        send = self._staging[self._staging_for(bucket)][: bucket.padded_size]
        if self.overlap:
            return self.comm.reduce_scatter_async(send, "avg", out=self._grad_shard(bucket))
        self.comm.reduce_scatter(send, "avg", out=self._grad_shard(bucket))
        return None

    def _finish_reduction(self) -> None:
        """Wait for the last buckets' reduce-scatter (each was started as backward filled it)."""
        for which, handle in enumerate(self._staging_busy):
            if handle is not None:
                handle.wait()
                self._staging_busy[which] = None

    def memory_report(self) -> dict[str, int]:
        """See ``ZeroStage.memory_report``; ``buffers`` are the staging buffers."""
        report = super().memory_report()
        report["buffers"] = int(sum(s.nbytes for s in self._staging))
        return report


STAGES: dict[int, type[ZeroStage]] = {0: ZeroStage0, 1: ZeroStage1, 2: ZeroStage2}


def len_of(s: slice) -> int:
    """Return the length of a slice with explicit start and stop."""
    return s.stop - s.start
