"""The partition plan: which elements of the flat buffer form each bucket and which rank owns what.

Pure maths; imports nothing of meta_dist. The flat buffer is a sequence of buckets, each a run
of whole layers, each padded to a multiple of the world size and split into equal shards: rank r
owns ``[start + r*shard_size, start + (r+1)*shard_size)`` of every bucket. With one bucket this is
DESIGN.md's layout (rank r owns slice r of the whole buffer). Buckets keep whole layers so that a
layer's gradients always land in one bucket, and the last layers come first in backward, so
their bucket can be reduced while earlier layers are still computing.
"""

from __future__ import annotations

from dataclasses import dataclass


def padded_size(numel: int, world: int) -> int:
    """Return numel rounded up to a multiple of world (padding keeps shards equal)."""
    if world < 1 or numel < 0:
        raise ValueError(f"padded_size: got numel={numel}, world={world}; expected numel >= 0, "
                         "world >= 1")
    return -(-numel // world) * world


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of whole layers in the flat buffer, padded to a multiple of world."""

    index: int
    start: int
    numel: int
    padded_size: int
    world: int
    first_layer: int
    last_layer: int

    @property
    def stop(self) -> int:
        """End of the bucket (padding included) in the flat buffer."""
        return self.start + self.padded_size

    @property
    def shard_size(self) -> int:
        """Elements of this bucket each rank owns."""
        return self.padded_size // self.world

    def shard(self, rank: int) -> slice:
        """Return the flat-buffer slice of this bucket owned by ``rank``."""
        begin = self.start + rank * self.shard_size
        return slice(begin, begin + self.shard_size)

    @property
    def whole(self) -> slice:
        """Return the bucket's slice of the flat buffer, padding included."""
        return slice(self.start, self.stop)


def plan_buckets(layer_numels: list[int], bucket_numel: int, world: int) -> list[Bucket]:
    """Group layers into buckets of at least ``bucket_numel`` elements, from the last layer back.

    Args:
        layer_numels: parameter elements of each layer, in forward order (0 for layers
            without parameters).
        bucket_numel: target elements per bucket: a bucket closes as soon as it holds at
            least this many (as PyTorch DDP's buckets), so one large layer fills it alone.
        world: number of ranks the buckets are sharded over.

    Returns:
        Buckets in forward (flat-buffer) order; bucket 0 starts at offset 0.
    """
    if bucket_numel < 1:
        raise ValueError(f"plan_buckets: bucket_numel must be >= 1; got {bucket_numel}")
    groups: list[tuple[int, int]] = []  # (first_layer, last_layer), built from the back
    last, total = len(layer_numels) - 1, 0
    for i in range(len(layer_numels) - 1, -1, -1):
        total += layer_numels[i]
        if total >= bucket_numel or i == 0:
            groups.append((i, last))
            last, total = i - 1, 0
    buckets, start = [], 0
    for index, (first, last_layer) in enumerate(reversed(groups)):
        numel = sum(layer_numels[first : last_layer + 1])
        padded = padded_size(max(numel, 1), world)
        buckets.append(Bucket(index, start, numel, padded, world, first, last_layer))
        start += padded
    return buckets
