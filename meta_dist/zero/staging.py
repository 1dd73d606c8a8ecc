"""StagingPool: the buffers backward writes a bucket's gradients into when not the grads' own.

Imports meta_dist.zero.flat and meta_dist.zero.partition (meta_dist.comm.base for type hints
only); meta_dist.zero.stages builds one per stage. A later micro-batch (levels 0 and 1), or
every backward at levels 2 and 3, writes each bucket into a staging buffer until the stage has
added it in or reduced it; with overlap two buffers alternate, one filling while the other's
reduction is in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket, Slot

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Handle


class StagingPool:
    """Staging buffers of the largest bucket's size, each bound to one bucket at a time.

    Args:
        flat: the model bound to its flat buffers (the buckets, slots, xp and dtype).
        count: how many buffers (0: backward always writes elsewhere).
        shard_of: instead of buffers, the bucket's own grad shard (one rank at level 2: the
            shard is the whole bucket, and backward writes straight into it).
    """

    def __init__(self, flat: FlatModel, count: int,
                 shard_of: Callable[[Bucket], Any] | None = None) -> None:
        largest = max(b.padded_size for b in flat.buckets)
        self.buffers = [flat.xp.zeros(largest, flat.dtype) for _ in range(count)]
        self._shard_of = shard_of
        self._free = list(range(len(self.buffers)))
        self._busy: deque[tuple[Handle, int]] = deque()  # reductions reading a staging buffer
        self._bound: dict[int, Any] = {}  # bucket index -> its staging for this backward
        self._pads = {b.index: _padding(b, flat.slots) for b in flat.buckets}

    def of(self, bucket: Bucket) -> Any:
        """Return the bucket's staging buffer, taking a free one (or the next to free) first."""
        staging = self._bound.get(bucket.index)
        if staging is not None:
            return staging
        if self._shard_of is not None:
            staging = self._shard_of(bucket)
        else:
            if not self._free:  # every buffer in use: wait for the oldest reduction
                handle, which = self._busy.popleft()
                handle.wait()
                self._free.append(which)
            staging = self.buffers[self._free.pop(0)]
        for lo, hi in self._pads[bucket.index]:
            staging[lo:hi] = 0  # padding has no gradients; the buffer held another bucket
        self._bound[bucket.index] = staging
        return staging

    def block(self, bucket: Bucket, slot: Slot, first: int, stop: int) -> Any:
        """Return rows ``[first, stop)`` of ``slot`` in the bucket's staging buffer."""
        begin = slot.offset + first * slot.row - bucket.start
        return self.of(bucket)[begin : begin + (stop - first) * slot.row].reshape(
            (stop - first, *slot.shape[1:]))

    def release(self, bucket: Bucket, handle: Handle | None = None) -> None:
        """The bucket is done with its staging (once ``handle`` finishes, if one is given)."""
        staging = self._bound.pop(bucket.index)
        which = next((i for i, s in enumerate(self.buffers) if s is staging), None)
        if which is not None:
            if handle is None:
                self._free.append(which)
            else:
                self._busy.append((handle, which))

    def settle(self) -> None:
        """Free every buffer a reduction was reading: the caller has waited for them all."""
        while self._busy:
            self._free.append(self._busy.popleft()[1])

    def nbytes(self) -> int:
        """Return the bytes of the staging buffers."""
        return int(sum(s.nbytes for s in self.buffers))


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
