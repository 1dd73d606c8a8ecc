"""ZeroStage3: parameters sharded too, gathered layer by layer just in time.

Imports meta_dist.zero.stages (level 2, which level 3 extends), meta_dist.zero.flat and
meta_dist.nn.grad_blocks (ParamBlocks). Memory per rank: 16Ψ/N of model state (fp32 Adam),
plus the staging (as level 2), the gather buffer(s) of the largest layer that is read whole,
and for the layers cut over several buckets that read their parameters by rows (Linear) one
bucket-sized piece buffer (two with overlap): such a layer is never gathered whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meta_dist.nn.grad_blocks import ParamBlocks
from meta_dist.zero.flat import FlatModel
from meta_dist.zero.partition import Bucket, Slot
from meta_dist.zero.stages import OptimizerFactory, ZeroStage2

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Communicator, Handle


class ZeroStage3(ZeroStage2):
    """ZeRO-3: the parameters are sharded too; each group of buckets is gathered just in time.

    Between steps a rank holds only its shard of every bucket: parameters, gradients and
    optimizer state; the model's own arrays are dropped as the shards are taken (the whole
    working copy never exists: ``FlatModel(materialize=False)``). Forward gathers a layer's
    buckets (one allgather each) into a gather buffer just before the layer runs; backward
    does the same from the last layer down, then reduce-scatters the gradients as level 2
    does. A group is the buckets one layer spans (``zero.partition`` may cut a large layer),
    and a gather buffer holds the largest group. With overlap, a second buffer receives the
    next group on the communication thread while the current one computes (FSDP2's
    prefetch); without it, a gather could only wait, so one buffer serves.

    A cut layer that reads its parameters by rows (``param_rows``: Linear) is streamed
    instead: it finds ParamBlocks in its params, and each block gathers one bucket into a
    piece buffer when the layer asks for it (with overlap the next bucket arrives in a second
    piece buffer meanwhile), so no buffer holds more than a bucket of it. With
    ``reshard_after_forward`` off, the gather buffer is the whole model: forward's gathers
    stay for backward (no second allgather, level 2's parameter memory).
    Memory: 16Ψ/N of model state (fp32 Adam), plus the staging, the gather buffer(s) and the
    piece buffer(s).
    """

    level = 3
    gathers_params = True  # zero.partition gives a cut layer buckets of its own

    def __init__(self, flat: FlatModel, comm: Communicator, make_optimizer: OptimizerFactory,
                 overlap: bool = True, accumulate: int = 1,
                 reshard_after_forward: bool = True) -> None:
        super().__init__(flat, comm, make_optimizer, overlap, accumulate)
        xp, buckets = flat.xp, flat.buckets
        self.params_shard = xp.zeros(sum(b.shard_size for b in buckets), flat.dtype)
        nan = xp.full((), xp.nan, flat.dtype)
        for bucket in buckets:  # keep this rank's shard of the working copy, drop the rest
            self._param_shard(bucket)[...] = flat.flat_params[bucket.shard(self.rank)]
            flat.release_below(bucket.stop, nan)  # the model's own arrays go as we pass them
        self.groups = _groups(flat)
        self.group_of = {layer: g for g, group in enumerate(self.groups)
                         for layer in group["layers"]}
        for tie in flat.ties:  # a later use of a tied parameter reads its owner's group
            if tie.layer in self.group_of and self.group_of[tie.layer] != self.group_of[
                    tie.owner]:
                raise ValueError(
                    f"ZeRO-3: layer {tie.layer} ({type(flat.model.layers[tie.layer]).__name__}) "
                    f"has parameters of its own and {tie.name!r} tied to layer {tie.owner}'s, "
                    "and level 3 gathers one layer's parameters at a time; tie whole layers "
                    "(all of a later layer's parameters tied, as a GPT's output head), or use "
                    "zero_opt_level 2")
            self.group_of[tie.layer] = self.group_of[tie.owner]
        self.keep = not reshard_after_forward
        self.streamed = set() if self.keep else {
            g for g, group in enumerate(self.groups) if _streams(flat, group)}
        size = flat.flat_params.size if self.keep else max(
            (g["stop"] - g["start"] for i, g in enumerate(self.groups) if i not in self.streamed),
            default=0)
        buffers = 2 if overlap and not self.keep else 1
        self._gather = [xp.zeros(size, flat.dtype) for _ in range(buffers)]
        piece = max((b.padded_size for g in self.streamed for b in self.groups[g]["buckets"]),
                    default=0)
        self._pieces = [xp.zeros(piece, flat.dtype) for _ in range(2 if overlap else 1)] \
            if piece else []
        self._piece_of: list[int | None] = [None] * len(self._pieces)  # bucket each holds
        self._piece_arriving: dict[int, Handle] = {}  # piece buffer -> its allgather
        self._piece_active: int | None = None  # the piece buffer the layer now reads
        self._held: list[set[int]] = [set() for _ in self._gather]  # groups each buffer holds
        self._arriving: dict[int, list[Handle]] = {}  # buffer -> its allgathers in flight
        self._active: int | None = None  # the buffer the layers now read
        flat.flat_params = None  # the full working copy is gone; layers see gather buffers
        self._unbind()

    def import_values(self, read: Any, name_of: Any) -> None:
        """See ``OwnedLayout.import_values``; what the buffers gathered before is stale now."""
        super().import_values(read, name_of)
        self._after_update()

    def _unbind(self) -> None:
        """Point every layer's parameters at NaN placeholders until a gather binds them.

        Between steps the values live in the shards only (``Trainer.parameters()`` gathers
        them); a layer run outside forward and backward would compute NaN, not stale values.
        """
        xp = self.flat.xp
        nan = xp.full((), xp.nan, self.flat.dtype)
        for slot in self.flat.slots:
            self.flat.model.layers[slot.layer].params[slot.name] = xp.broadcast_to(nan, slot.shape)
        self.flat.bind_ties()

    def _param_shard(self, bucket: Bucket) -> Any:
        start = self._shard_start[bucket.index]
        return self.params_shard[start : start + bucket.shard_size]

    def _owned_working(self) -> list[Any]:
        return [self._param_shard(b) for b in self.flat.buckets]

    def _after_update(self) -> None:
        """The shards changed: nothing gathered before the update is current any more."""
        self._settle_gathers()
        self._held = [set() for _ in self._gather]
        self._active = None
        self._unbind()

    def _settle_gathers(self) -> None:
        for which in list(self._arriving):
            for handle in self._arriving.pop(which):
                handle.wait()
        for which in list(self._piece_arriving):
            self._piece_arriving.pop(which).wait()
        self._piece_of = [None] * len(self._pieces)
        self._piece_active = None

    def full_params(self) -> Any:
        """Return a new full working copy of the parameters (allgathers). Collective."""
        full = self.flat.xp.zeros(self.flat.buckets[-1].stop, self.flat.dtype)
        for bucket in self.flat.buckets:
            self.comm.allgather(self._param_shard(bucket), out=full[bucket.whole])
        return full

    def attach(self) -> None:
        """Install the backward hooks and the forward hook that gathers parameters."""
        super().attach()
        self.flat.model.before_forward = self._before_forward

    def _before_forward(self, layer: int) -> None:
        group = self.group_of.get(layer)
        if group is not None:
            self._use(group, group + 1)

    def _before_layer(self, layer: int) -> None:
        group = self.group_of.get(layer)
        if group is not None:
            self._use(group, group - 1)
        super()._before_layer(layer)

    def _use(self, group: int, upcoming: int) -> None:
        """Make ``group``'s parameters the layers' (gathering them unless held); prefetch."""
        if group in self.streamed:
            self._bind_blocks(self.groups[group]["layers"][0])
            if 0 <= upcoming < len(self.groups) and upcoming not in self.streamed and \
                    self._buffer_of(upcoming) is None:  # no layer reads a gather buffer now
                self._active = None
                self._start_gather(upcoming)
            return
        which = self._buffer_of(group)
        if which is None:
            which = self._start_gather(group)
        for handle in self._arriving.pop(which, []):
            handle.wait()
        self._active = which
        base = 0 if self.keep else self.groups[group]["start"]
        for layer in self.groups[group]["layers"]:
            params = self.flat.model.layers[layer].params
            for slot in self.flat.layer_slots[layer]:
                params[slot.name] = self.flat.view(self._gather[which], slot, base)
        self.flat.bind_ties(set(self.groups[group]["layers"]))
        prefetch = self.keep or len(self._gather) > 1  # else the one buffer is in use
        if prefetch and 0 <= upcoming < len(self.groups) and upcoming not in self.streamed \
                and self._buffer_of(upcoming) is None:
            self._start_gather(upcoming)

    def _bind_blocks(self, layer: int) -> None:
        """Give a streamed layer ParamBlocks: one block per bucket each parameter lies in."""
        params = self.flat.model.layers[layer].params
        for slot in self.flat.layer_slots[layer]:
            where = {(first, stop): bucket for first, stop, bucket in self.flat.row_spans(slot)}
            params[slot.name] = ParamBlocks(
                slot.shape, list(where),
                lambda first, stop, s=slot, w=where: self._piece(w[(first, stop)], s, first,
                                                                 stop))

    def _piece(self, bucket: Bucket, slot: Slot, first: int, stop: int) -> Any:
        """Return rows ``[first, stop)`` of ``slot``, gathering ``bucket`` if need be.

        Unless a piece buffer holds it already; with two buffers, the layer's next bucket
        starts too.
        """
        which = self._fetch_piece(bucket)
        self._piece_active = which
        following = bucket.index + 1
        group = self.groups[self.group_of[slot.layer]]
        if len(self._pieces) > 1 and following <= group["buckets"][-1].index:
            self._fetch_piece(self.flat.buckets[following], wait=False)
        begin = slot.offset + first * slot.row - bucket.start
        return self._pieces[which][begin : begin + (stop - first) * slot.row].reshape(
            (stop - first, *slot.shape[1:]))

    def _fetch_piece(self, bucket: Bucket, wait: bool = True) -> int:
        """Return the piece buffer holding ``bucket``.

        Unless one holds it, it is gathered into the buffer the layer is not reading;
        ``wait``: until it has landed.
        """
        which = next((i for i, held in enumerate(self._piece_of) if held == bucket.index), None)
        if which is None:
            which = next((i for i in range(len(self._pieces)) if i != self._piece_active), 0)
            arriving = self._piece_arriving.pop(which, None)
            if arriving is not None:  # what it gathered before must land first
                arriving.wait()
            out = self._pieces[which][: bucket.padded_size]
            handle = self._run("allgather", self._param_shard(bucket), out=out)
            self._piece_of[which] = bucket.index
            if handle is not None:
                self._piece_arriving[which] = handle
        if wait and which in self._piece_arriving:
            self._piece_arriving.pop(which).wait()
        return which

    def _buffer_of(self, group: int) -> int | None:
        return next((i for i, held in enumerate(self._held) if group in held), None)

    def _start_gather(self, group: int) -> int:
        """Start the allgathers of ``group`` into a buffer the layers are not reading.

        With one buffer, that is the only one: the layer that read it has finished.
        """
        which = next((i for i in range(len(self._gather)) if i != self._active), 0)
        for handle in self._arriving.pop(which, []):  # what it gathered before must land first
            handle.wait()
        gather = self._gather[which]
        base = 0 if self.keep else self.groups[group]["start"]
        handles = []
        for bucket in self.groups[group]["buckets"]:
            out, send = gather[bucket.start - base : bucket.stop - base], self._param_shard(bucket)
            handle = self._run("allgather", send, out=out)
            if handle is not None:
                handles.append(handle)
        self._arriving[which] = handles
        self._held[which] = self._held[which] | {group} if self.keep else {group}
        return which

    def memory_report(self) -> dict[str, int]:
        """See ``ZeroStage.memory_report``; the gather and piece buffers count as buffers."""
        report = super().memory_report()
        report["buffers"] += int(sum(g.nbytes for g in self._gather + self._pieces))
        return report


def _groups(flat: FlatModel) -> list[dict[str, Any]]:
    """Group the buckets so that no layer spans two groups, in flat order (level 3's unit)."""
    groups: list[dict[str, Any]] = []
    for layer in sorted(flat.layer_buckets):
        buckets = flat.layer_buckets[layer]
        if groups and buckets[0].index <= groups[-1]["buckets"][-1].index:
            group = groups[-1]  # shares a bucket with the group below: the same group
            group["layers"].append(layer)
            group["buckets"] += [b for b in buckets if b.index > group["buckets"][-1].index]
        else:
            groups.append({"layers": [layer], "buckets": list(buckets)})
    for group in groups:
        group["start"], group["stop"] = group["buckets"][0].start, group["buckets"][-1].stop
    return groups


def _streams(flat: FlatModel, group: dict[str, Any]) -> bool:
    """Whether level 3 streams ``group`` by rows.

    It does for one layer, cut over several buckets, whose class reads ParamBlocks
    (``param_rows``), with no parameter tied to another layer.
    """
    if len(group["layers"]) != 1 or len(group["buckets"]) < 2:
        return False
    layer = group["layers"][0]
    tied = any(layer in (tie.layer, tie.owner) for tie in flat.ties)
    return bool(getattr(flat.model.layers[layer], "param_rows", False)) and not tied
