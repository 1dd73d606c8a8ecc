"""The partition plan: where each parameter lies in the flat buffer, the buckets, who owns what.

Pure maths; imports nothing of meta_dist. The flat buffer holds the layers in forward order and
each layer's parameters in the reverse of the order its backward writes them, so a backward pass
writes gradients at ever lower offsets. It is cut into buckets of at most the configured size,
each a multiple of the world size and split into equal shards: rank r owns ``[start +
r*shard_size, start + (r+1)*shard_size)`` of every bucket. With one bucket this is DESIGN.md's
layout (rank r owns slice r of the whole buffer). A bucket ends between layers where it can; a
layer larger than what is left of a bucket is cut between rows of its parameters, so backward
can hand a large layer's gradient over one bucket at a time. The padding that makes buckets
multiples of the world size lies at a bucket's end, or just below a parameter that is cut, never
inside a parameter: every parameter stays one contiguous view. Padding is zero and stays zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_BUCKETS = 4  # buckets per model at least, so reduction overlaps backward on any model


def padded_size(numel: int, world: int) -> int:
    """Return numel rounded up to a multiple of world (padding keeps shards equal)."""
    if world < 1 or numel < 0:
        raise ValueError(f"padded_size: got numel={numel}, world={world}; expected numel >= 0, "
                         "world >= 1")
    return -(-numel // world) * world


@dataclass(frozen=True)
class Slot:
    """Where one parameter lies in the flat buffer (offsets without the buckets' padding)."""

    layer: int
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)

    @property
    def row(self) -> int:
        """Elements in one row (one index along axis 0; 1 for a vector)."""
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Bucket:
    """A contiguous run of the flat buffer whose size is a multiple of world."""

    index: int
    start: int
    padded_size: int
    world: int

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


def bucket_numel(total: int, cap: int) -> int:
    """Return the elements per bucket: at most ``cap``, and at least MIN_BUCKETS buckets."""
    return max(1, min(cap, -(-total // MIN_BUCKETS)))


def plan(layers: list[list[tuple[str, tuple[int, ...]]]], size: int, world: int,
         splittable: frozenset[int] = frozenset(),
         isolate_cut_layers: bool = False) -> tuple[list[Slot], list[Bucket]]:
    """Lay the parameters out and cut the flat buffer into buckets of at most ``size`` elements.

    A layer that does not fit the rest of the open bucket starts the next one, unless it is in
    ``splittable`` (its backward can write its gradients row block by row block): then the
    bucket is filled with the layer's lowest rows and the layer goes on in the next buckets. A
    layer that cannot be cut and is larger than ``size`` gets a bucket of its own that large.

    Args:
        layers: per layer, its (name, shape) pairs in the order its backward writes them.
        size: elements per bucket (``bucket_numel``).
        world: number of ranks the buckets are sharded over.
        splittable: indices of the layers that may be cut.
        isolate_cut_layers: give a layer that is cut buckets of its own (ZeRO-3 gathers a
            layer's buckets together: a bucket shared with the next layer would chain them).

    Returns:
        The parameters' slots (in flat order) and the buckets (bucket 0 at offset 0).
    """
    if size < 1 or world < 1:
        raise ValueError(f"plan: got size={size}, world={world}; expected both >= 1")
    slots: list[Slot] = []
    buckets: list[Bucket] = []
    start = pos = 0  # the open bucket begins at start; the next element goes to pos

    def close() -> None:
        nonlocal start, pos
        if pos > start:
            buckets.append(Bucket(len(buckets), start, padded_size(pos - start, world), world))
            start = pos = buckets[-1].stop

    for i, params in enumerate(layers):
        ordered = [(name, tuple(shape)) for name, shape in reversed(params)]
        cuttable = i in splittable
        fits = pos - start + sum(math.prod(shape) for _, shape in ordered) <= size
        if not fits and (not cuttable or isolate_cut_layers):
            close()
        for name, shape in ordered:
            rows, row = (shape[0] if shape else 1), math.prod(shape[1:])
            offset = None  # where the parameter starts, once placed
            while cuttable and rows * row > size - (pos - start):
                if pos - start >= size:  # an oversized layer below filled the bucket
                    close()
                    continue
                step = world // math.gcd(row, world)  # rows per cut that keep shards equal
                fit = (size - (pos - start)) // row // step * step
                if offset is None:  # pad below the parameter so the cut lands on a multiple
                    pad = (-(pos - start + fit * row)) % world
                    while fit and pos - start + pad + fit * row > size:
                        fit -= step
                        pad = (-(pos - start + fit * row)) % world
                    if not fit and pos > start:
                        close()  # nothing fits: cut below the parameter instead
                        continue
                    offset = pos = pos + (pad if fit else 0)
                fit = fit or step  # a block of rows larger than a bucket goes alone
                if fit >= rows:
                    break  # the rest stays whole
                pos += fit * row
                rows -= fit
                close()
            slots.append(Slot(i, name, shape, pos if offset is None else offset))
            pos += rows * row
        if isolate_cut_layers and cuttable and not fits:
            close()
    close()
    return slots, buckets
