"""ZeroStage0..2: one class per ZeRO level, in order of increasing sharding (3: stage3.py).

Imports meta_dist.optim and meta_dist.zero (meta_dist.comm.base for type hints only); imported
by meta_dist.zero (STAGES) and zero.stage3. A stage owns the gradient buffers (and a
StagingPool, zero.staging, for what backward writes elsewhere), the fp32 master copy under
mixed precision, and the optimizer; its OwnedLayout (zero.shards) maps what it owns to the
optimizer's decay spans and to checkpoints. Per optimizer step the trainer runs
``begin_micro`` and backward once per micro-batch (the stage's hooks handle each bucket as soon
as backward has written all of it: accumulate it locally, or on the last micro-batch reduce
it), then ``step()``. Gradients are averaged across ranks in exactly one place: the
collectives' op "avg" (``Communicator._average``); over micro-batches (fp16: in the loss
gradient, so float16 never holds their sum), loss scale and clipping in one factor handed to
the optimizer. The trainer never branches on the level.

Bytes held per rank, Ψ parameters, N ranks, Adam: fp32 (4Ψ params, 4Ψ grads, 8Ψ moments):
level 0: 16Ψ;  level 1: 8Ψ + 8Ψ/N;  level 2: 4Ψ + 12Ψ/N. Mixed precision (2Ψ working params,
2Ψ grads, 12Ψ fp32 master + moments): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N. Plus at most one bucket of
staging (two half-size buffers with overlap; none on one rank), and at level 2 with
accumulation a full local gradient while the micro-batches add up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meta_dist.optim import Optimizer
from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket, bucket_numel
from meta_dist.zero.shards import OwnedLayout
from meta_dist.zero.staging import StagingPool

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Communicator, Handle

OptimizerFactory = Callable[[int], Optimizer]


class ZeroStage(OwnedLayout):
    """Base: a full gradient buffer, each bucket reduced once backward has written all of it.

    Backward writes gradients at ever lower flat offsets (``zero.partition``), so a bucket is
    complete as soon as backward has written below its start. On the first micro-batch levels
    0 and 1 write straight into the gradient buffer; later micro-batches write into staging
    buffers, each added in when its bucket is complete. On the last micro-batch a complete
    bucket is reduced at once (asynchronously with ``overlap``) or, levels 0 and 1 without
    overlap, all in one call in ``step``.

    Args:
        flat: the model bound to its flat parameter buffer.
        comm: the communicator of the data-parallel ranks.
        make_optimizer: builds an optimizer for a given number of elements.
        overlap: reduce buckets on the communication thread while backward continues.
        accumulate: micro-batches per optimizer step.
        reshard_after_forward: level 3 only (see ZeroStage3).
    """

    level = -1
    gathers_params = False  # level 3: forward gathers each layer's parameters

    @classmethod
    def bucket_numel(cls, cap: int, total: int, overlap: bool) -> int:
        """Return elements per bucket for a configured cap (elements) and a model of ``total``."""
        return bucket_numel(total, cap)

    def __init__(self, flat: FlatModel, comm: Communicator, make_optimizer: OptimizerFactory,
                 overlap: bool = True, accumulate: int = 1,
                 reshard_after_forward: bool = True) -> None:
        self.flat, self.comm, self.overlap, self.accumulate = flat, comm, overlap, accumulate
        self.rank = comm.rank
        self._pending: list[Handle] = []
        self._next = len(flat.buckets) - 1  # the highest bucket not yet complete
        self._micro, self._direct = 0, True
        self.flat_grads = self._make_grads()
        self._staging = StagingPool(flat, self._staging_buffers(),
                                    self._grad_shard if self._staging_is_shard() else None)
        owned = self.owned_slices()
        # under mixed precision the optimizer updates an fp32 copy of what this rank owns
        self.master = None if flat.master is None else [flat.master[s].copy() for s in owned]
        flat.master = None  # the full fp32 copy was only needed until now
        self.optimizer = make_optimizer(sum(s.stop - s.start for s in owned))

    # ------------------------------------------------------------ what differs between levels

    def owned_slices(self) -> list[slice]:
        """The parts of the flat buffer this rank updates (level 0: all of it)."""
        return [slice(0, self.flat.flat_params.size)]

    def _make_grads(self) -> Any:
        return self.flat.xp.zeros(self.flat.flat_params.size, self.flat.dtype)

    def _writes_direct(self) -> bool:
        """Whether this micro-batch's backward writes straight into the gradient buffer."""
        return self._micro == 0

    def _fold(self, bucket: Bucket, staging: Any) -> None:
        """Add a later micro-batch's bucket, written into ``staging``, to the gradients."""
        grads = self.flat_grads[bucket.whole]
        grads += staging[: bucket.padded_size]

    def _run(self, collective: str, *args: Any, **kwargs: Any) -> Handle | None:
        """Run ``collective`` of the communicator; the one place overlap picks the call.

        With overlap on its communication thread (return the handle), else now (return None).
        """
        if self.overlap:
            return getattr(self.comm, f"{collective}_async")(*args, **kwargs)
        getattr(self.comm, collective)(*args, **kwargs)
        return None

    def _two_buffers(self) -> bool:
        """Whether to double-buffer (staging, gathers).

        With overlap and more than one bucket: one buffer fills while the other is in flight.
        """
        return self.overlap and len(self.flat.buckets) > 1

    def _staging_buffers(self) -> int:
        """How many staging buffers: none when every backward writes straight into the grads."""
        if self.accumulate == 1:
            return 0
        return 2 if self._two_buffers() else 1

    def _staging_is_shard(self) -> bool:
        """Whether the grad shard itself is the staging (``StagingPool``'s ``shard_of``)."""
        return False

    def _reduce_bucket(self, bucket: Bucket) -> Handle | None:
        """Average one bucket's gradients across ranks (allreduce, in place)."""
        grads = self.flat_grads[bucket.whole]
        return self._run("allreduce", grads, "avg", out=grads)

    def _reduce_all(self) -> None:
        """Average every bucket at once (one collective), when backward did not stream them."""
        self.comm.allreduce(self.flat_grads, "avg", out=self.flat_grads)

    def _local_grads(self) -> list[Any]:
        return [self.flat_grads[s] for s in self.owned_slices()]

    def _shard_grads(self) -> list[Any]:
        """This rank's shard of every bucket's reduced gradient, at every level.

        The ranks' shards together cover every gradient once: what a check looks at.
        """
        return [self.flat_grads[b.shard(self.rank)] for b in self.flat.buckets]

    def _after_update(self) -> None:
        """Level 0: every rank updated everything; nothing to gather."""

    def full_params(self) -> Any:
        """Return the full working copy of the parameters (at levels 0-2, the buffer itself)."""
        return self.flat.flat_params

    def _owned_working(self) -> list[Any]:
        """This rank's owned parts of the working parameters (views, in ``owned_slices``)."""
        return [self.flat.flat_params[s] for s in self.owned_slices()]

    def _owned_params(self) -> list[Any]:
        """What the optimizer updates: the fp32 master under mixed precision, else the params."""
        return self.master or self._owned_working()

    def _streams_buckets(self) -> bool:
        """Whether buckets are reduced as backward completes them, or all at once in step().

        Without overlap, reducing bucket by bucket only adds points where the ranks wait for
        each other; one call in step() is faster. Level 2 must: its staging is reused.
        """
        return self.overlap

    # ------------------------------------------------------------ one backward pass

    def attach(self) -> None:
        """Install the backward hooks on the model (call once)."""
        self.flat.model.before_backward = self._before_layer
        self.flat.model.after_backward = self._after_layer
        self.begin_micro(0)

    def begin_micro(self, index: int) -> None:
        """Point the layers' grads where micro-batch ``index`` of this step writes them."""
        self._micro, self._next = index, len(self.flat.buckets) - 1
        self._direct = self._writes_direct()
        for layer, buckets in self.flat.layer_buckets.items():
            if self._direct:
                self.flat.bind_grads(layer, self.flat_grads)
            elif len(buckets) > 1:  # a layer across buckets writes them one block at a time
                self.flat.bind_blocks(layer, self._staging.block, self._written)

    def _before_layer(self, layer: int) -> None:
        buckets = self.flat.layer_buckets.get(layer)
        if not self._direct and buckets and len(buckets) == 1:  # into that bucket's staging
            self.flat.bind_grads(layer, self._staging.of(buckets[0]), buckets[0].start)

    def _after_layer(self, layer: int) -> None:
        slots = self.flat.layer_slots.get(layer)
        if slots:
            self._written(slots[0].offset)

    def _written(self, offset: int) -> None:
        """Backward has written every gradient from flat ``offset`` up: finish what is done."""
        buckets = self.flat.buckets
        while self._next >= 0 and buckets[self._next].start >= offset:
            self._complete(buckets[self._next])
            self._next -= 1

    def _complete(self, bucket: Bucket) -> None:
        if not self._direct:
            self._fold(bucket, self._staging.of(bucket))
            self._staging.release(bucket)
        if self._micro == self.accumulate - 1 and self._streams_buckets():
            self._start_reduction(bucket)

    def _start_reduction(self, bucket: Bucket) -> None:
        handle = self._reduce_bucket(bucket)
        if handle is not None:
            self._pending.append(handle)

    def end_micro(self) -> None:
        """Finish a micro-batch's backward: complete any bucket it did not reach."""
        self._written(0)

    # ------------------------------------------------------------ the update

    def step(self, guard: Any = None, grad_scale: float = 1.0) -> None:
        """Finish the gradient reduction, update this rank's part, and share the result.

        Args:
            guard: a ``train.guard.StepGuard``: sees the reduced gradients first, may veto
                the update (on every rank alike) or shrink it (clipping).
            grad_scale: multiplies the reduced gradients before the update (1 / micro-batches,
                or under fp16 1 / loss scale).
        """
        self.end_micro()
        self._finish_reduction()
        update, scale = True, grad_scale
        if guard is not None:
            update, scale = guard.inspect(self._shard_grads(), [
                b.shard(self.rank).start for b in self.flat.buckets], grad_scale)
        if update:
            self.optimizer.step(self._owned_params(), self._local_grads(), grad_scale=scale)
            if self.master is not None:  # the working copy follows its master
                for working, master in zip(self._owned_working(), self.master, strict=True):
                    working[...] = master
        self._after_update()
        self.begin_micro(0)

    def _finish_reduction(self) -> None:
        """Reduce what backward did not, then wait for every reduction."""
        if not self._streams_buckets():
            self._reduce_all()
        for handle in self._pending:
            handle.wait()
        self._pending.clear()
        self._staging.settle()  # their handles were waited for

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds: params (working + master), grads, optimizer state, buffers."""
        master = sum(int(m.nbytes) for m in self.master or ())
        working = sum(int(w.nbytes) for w in self._owned_working()) \
            if self.flat.flat_params is None else int(self.flat.flat_params.nbytes)
        return {"params": working + master,
                "grads": int(self.flat_grads.nbytes),
                "optimizer": int(self.optimizer.state_bytes()),
                "buffers": self._staging.nbytes()}


class ZeroStage0(ZeroStage):
    """Plain data parallelism: average all grads (allreduce), every rank updates everything.

    Memory: params, grads and optimizer state all full size on every rank.
    """

    level = 0


class ZeroStage1(ZeroStage0):
    """ZeRO-1: reduce-scatter the grads in place, update only my shard, allgather the params.

    A reduce-scatter plus an allgather moves what one allreduce does: level 0's volume.
    Memory: optimizer state ≈ 1/N of level 0's; params and grads full size.
    """

    level = 1

    def owned_slices(self) -> list[slice]:
        """This rank's shard of every bucket."""
        return [bucket.shard(self.rank) for bucket in self.flat.buckets]

    def _reduce_bucket(self, bucket: Bucket) -> Handle | None:
        """Average one bucket into this rank's shard of it (the rest is not read again)."""
        grads = self.flat_grads
        return self._run("reduce_scatter", grads[bucket.whole], "avg",
                         out=grads[bucket.shard(self.rank)])

    def _reduce_all(self) -> None:
        """One in-place reduce-scatter per bucket (a fused list would pack a full-size copy)."""
        for bucket in self.flat.buckets:
            self._start_reduction(bucket)

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
    backward writes straight into it. With accumulation the micro-batches add up in a full
    local gradient (reducing once per step, as DDP's no_sync), reduced with the last one.
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
        # a full local gradient only while micro-batches add up (none without accumulation)
        self._local = (xp.zeros(flat.flat_params.size, flat.dtype) if self.accumulate > 1
                       else None)
        return xp.zeros(offset, flat.dtype)  # this rank's shard of every bucket, end to end

    def _staging_buffers(self) -> int:
        if self._staging_is_shard():
            return 0
        return 2 if self._two_buffers() else 1

    def _staging_is_shard(self) -> bool:
        return self.comm.size == 1 and self.accumulate == 1

    def _writes_direct(self) -> bool:
        return False  # always through staging (or, on one rank, into the shard itself)

    def _grad_shard(self, bucket: Bucket) -> Any:
        start = self._shard_start[bucket.index]
        return self.flat_grads[start : start + bucket.shard_size]

    def _local_grads(self) -> list[Any]:
        return [self._grad_shard(b) for b in self.flat.buckets]

    _shard_grads = _local_grads

    def _streams_buckets(self) -> bool:
        """See ``ZeroStage._streams_buckets``: always, the staging is reused."""
        return True

    def _complete(self, bucket: Bucket) -> None:
        staging = self._staging.of(bucket)[: bucket.padded_size]
        last = self._micro == self.accumulate - 1
        if self._local is not None:  # micro-batches add up in the local gradient
            local = self._local[bucket.whole]
            if self._micro == 0:
                local[...] = staging
            elif last:
                staging += local
            else:
                local += staging
        if not last:
            self._staging.release(bucket)
            return
        handle = self._run("reduce_scatter", staging, "avg", out=self._grad_shard(bucket))
        if handle is not None:
            self._pending.append(handle)
        self._staging.release(bucket, handle)

    def memory_report(self) -> dict[str, int]:
        """See ``ZeroStage.memory_report``; a local accumulation gradient counts as buffers."""
        report = super().memory_report()
        report["buffers"] += int(self._local.nbytes) if self._local is not None else 0
        return report

