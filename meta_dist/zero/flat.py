"""FlatModel: a model whose parameters are views into one flat buffer laid out by the plan.

Imports meta_dist.nn (the model and GradBlocks) and meta_dist.zero.partition (meta_dist.comm.base
for type hints only). Optimizers and ZeRO stages then work on slices of one 1-D array and never
walk layers; ``broadcast_model`` gives every rank the root's values before a stage shards them.

Tied parameters (one array held by two layers, as a GPT's token embedding and its output
head): the first layer that holds it owns its one slot (one parameter, in one shard, at every
level); a later layer gets the same parameter view and a private gradient array, and the
owner's gradient adds those in as it is written (``GradBlocks.extra``). The owner comes first
in forward order, so its backward runs last, after every other use has written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meta_dist.nn.grad_blocks import GradBlocks
from meta_dist.nn.init import DeferredValues
from meta_dist.nn.model import Sequential
from meta_dist.zero.partition import Bucket, Slot, plan

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Communicator


class FlatModel:
    """A model's parameters moved into one flat buffer, ``flat_params``, the layers pointing at it.

    Padding is zero. With ``materialize=False`` (level 3's way) the parameters are read from
    the layers where they are instead.

    Layers whose class sets ``grad_rows = True`` (their backward writes through
    ``nn.grad_blocks.write_grad``) may be cut between buckets; others stay in one bucket.

    Args:
        model: the model; its current parameter values are copied in, one at a time (or,
            not materialised, read from it slice by slice).
        bucket_numel: elements per bucket (``partition.bucket_numel``).
        world: ranks the buckets are sharded over.
        xp: the array module of the buffers (numpy or cupy).
        dtype: the dtype the layers compute in (``flat_params``).
        master_dtype: under mixed precision, the dtype of ``master``, a full copy of the
            parameters made from the model's own values before they are rounded to ``dtype``
            (a ZeRO stage keeps its shard of it); None when it would equal ``dtype``.
        isolate_cut_layers: see ``partition.plan`` (ZeRO-3 asks for it).
        materialize: build ``flat_params`` (and ``master``). False (ZeRO-3): they read the
            layers' own arrays a slice at a time (``LayerValues``), so a stage that keeps only
            shards never holds a full copy beside the model (``release_below`` then frees the
            layers as their shards are taken).

    Raises:
        ValueError: one layer object appears twice in the model, or a tied parameter's owner
            does not write its gradients by rows (``write_grad``).
    """

    def __init__(self, model: Sequential, bucket_numel: int, world: int, xp: Any,
                 dtype: Any, master_dtype: Any = None, isolate_cut_layers: bool = False,
                 materialize: bool = True) -> None:
        self.model, self.xp, self.dtype = model, xp, xp.dtype(dtype)
        layers = model.layers
        self.ties = find_ties(layers)
        tied = {(t.layer, t.name) for t in self.ties}
        splittable = frozenset(i for i, layer in enumerate(layers)
                               if getattr(layer, "grad_rows", False))
        self.slots, self.buckets = plan(
            [[(n, p.shape) for n, p in layer.params.items() if (i, n) not in tied]
             for i, layer in enumerate(layers)],
            bucket_numel, world, splittable, isolate_cut_layers)
        mixed = master_dtype is not None and xp.dtype(master_dtype) != self.dtype
        if not materialize:
            self.flat_params: Any = LayerValues(self, self.dtype)
            self.master: Any = LayerValues(self, xp.dtype(master_dtype)) if mixed else None
        else:
            first = xp.zeros(self.buckets[-1].stop, master_dtype if mixed else dtype)
            for slot in self.slots:  # one at a time: the layer's own array is freed as it goes
                view, param = self.view(first, slot), layers[slot.layer].params[slot.name]
                if isinstance(param, DeferredValues):
                    param.fill(view, xp)  # drawn now, block by block
                else:
                    view[...] = param
                layers[slot.layer].params[slot.name] = view
            self.master = first if mixed else None
            self.flat_params = first.astype(self.dtype) if mixed else first
            if mixed:
                for slot in self.slots:
                    layers[slot.layer].params[slot.name] = self.view(self.flat_params, slot)
        self.bind_ties()
        self.tie_grads: dict[tuple[int, str], list[Any]] = {}  # owner -> the later uses' grads
        for tie in self.ties:
            grad = xp.zeros(layers[tie.layer].params[tie.name].shape, self.dtype)
            layers[tie.layer].grads[tie.name] = grad
            self.tie_grads.setdefault((tie.owner, tie.owner_name), []).append(grad)
        self.layer_slots: dict[int, list[Slot]] = {}
        for slot in self.slots:
            self.layer_slots.setdefault(slot.layer, []).append(slot)
        self.layer_buckets = {i: self.buckets_between(s[0].offset, s[-1].offset + s[-1].numel)
                              for i, s in self.layer_slots.items()}

    @property
    def numel(self) -> int:
        """Parameter elements of the model (padding excluded)."""
        return sum(s.numel for s in self.slots)

    @staticmethod
    def view(buffer: Any, slot: Slot, base: int = 0) -> Any:
        """Return the slot's parameter-shaped view of a flat buffer (starting at ``base``)."""
        begin = slot.offset - base
        return buffer[begin : begin + slot.numel].reshape(slot.shape)

    def buckets_between(self, begin: int, end: int) -> list[Bucket]:
        """Return the buckets overlapping flat elements ``[begin, end)``, lowest first."""
        return [b for b in self.buckets if b.start < end and begin < b.stop]

    def row_spans(self, slot: Slot) -> list[tuple[int, int, Bucket]]:
        """Return ``(first_row, stop_row, bucket)`` for each bucket ``slot`` lies in.

        Lowest first; a cut layer is cut between rows.
        """
        spans = []
        for bucket in self.buckets_between(slot.offset, slot.offset + slot.numel):
            first = max(bucket.start - slot.offset, 0) // slot.row
            stop = -(-min(bucket.stop - slot.offset, slot.numel) // slot.row)
            spans.append((first, stop, bucket))
        return spans

    def release_below(self, offset: int, placeholder: Any) -> None:
        """Point every parameter that lies wholly below flat ``offset`` at ``placeholder``.

        ``placeholder`` is a scalar broadcast to each shape; the layer's own array is dropped.
        """
        layers = self.model.layers
        for slot in self.slots:
            if slot.offset + slot.numel <= offset:
                layers[slot.layer].params[slot.name] = self.xp.broadcast_to(placeholder,
                                                                            slot.shape)
        self.bind_ties()

    def bind_ties(self, layers: set[int] | None = None) -> None:
        """Give the later uses of tied parameters the owner's current parameter views.

        Only the owners in ``layers`` (None: all).
        """
        model = self.model.layers
        for tie in self.ties:
            if layers is None or tie.owner in layers:
                model[tie.layer].params[tie.name] = model[tie.owner].params[tie.owner_name]

    def bind_grads(self, layer: int, buffer: Any, base: int = 0) -> None:
        """Point layer ``layer``'s grads at ``buffer``, whose element 0 is flat element ``base``."""
        grads = self.model.layers[layer].grads
        for slot in self.layer_slots.get(layer, ()):
            view = self.view(buffer, slot, base)
            extra = self.tie_grads.get((layer, slot.name))
            grads[slot.name] = view if extra is None else GradBlocks(
                slot.shape, [(0, slot.shape[0] if slot.shape else 1)],
                lambda first, stop, v=view: v[first:stop] if v.ndim else v,
                lambda first, stop: None, tuple(extra))

    def bind_blocks(self, layer: int, target: Callable[[Bucket, Slot, int, int], Any],
                    written: Callable[[int], None]) -> None:
        """Give layer ``layer`` GradBlocks, one block per bucket each parameter lies in.

        ``target(bucket, slot, first_row, stop_row)`` returns the array for a block;
        ``written(offset)`` is told the lowest flat element a finished block covered.
        """
        grads = self.model.layers[layer].grads
        for slot in self.layer_slots.get(layer, ()):
            spans = self.row_spans(slot)[::-1]  # backward writes the highest offsets first
            by_rows = {(first, stop): bucket for first, stop, bucket in spans}
            grads[slot.name] = GradBlocks(
                slot.shape, [(first, stop) for first, stop, _ in spans],
                lambda first, stop, s=slot, b=by_rows: target(b[(first, stop)], s, first, stop),
                lambda first, stop, s=slot: written(s.offset + first * s.row),
                tuple(self.tie_grads.get((layer, slot.name), ())))


class LayerValues:
    """The flat buffer's values, read from the layers' own arrays a slice at a time.

    Stands for ``flat_params`` (or ``master``) where none is materialised: ``values[a:b]`` is a
    new array of flat elements ``[a, b)`` in ``dtype`` (padding zero), ``values[a:b] = x``
    writes them back into the layers. ``size`` is the flat buffer's.
    """

    def __init__(self, flat: FlatModel, dtype: Any) -> None:
        self.flat, self.dtype = flat, dtype
        self.size = flat.buckets[-1].stop

    def _pieces(self, part: slice) -> list[tuple[Slot, int, int]]:
        return [(s, max(part.start, s.offset), min(part.stop, s.offset + s.numel))
                for s in self.flat.slots
                if s.offset < part.stop and part.start < s.offset + s.numel]

    def __getitem__(self, part: slice) -> Any:
        return self._read(part, draw=True)

    def drawn(self, part: slice) -> Any:
        """Return ``self[part]`` with the still-deferred parameters' elements left zero."""
        return self._read(part, draw=False)

    def _read(self, part: slice, draw: bool) -> Any:
        out = self.flat.xp.zeros(part.stop - part.start, self.dtype)
        layers = self.flat.model.layers
        for slot, lo, hi in self._pieces(part):
            source = layers[slot.layer].params[slot.name]
            if isinstance(source, DeferredValues) and not draw:
                continue
            if isinstance(source, DeferredValues):  # only these elements are drawn
                out[lo - part.start : hi - part.start] = self.flat.xp.asarray(
                    source.read(lo - slot.offset, hi - slot.offset))
            else:
                out[lo - part.start : hi - part.start] = \
                    source.reshape(-1)[lo - slot.offset : hi - slot.offset]
        return out

    def __setitem__(self, part: slice, values: Any) -> None:
        layers = self.flat.model.layers
        for slot, lo, hi in self._pieces(part):
            if isinstance(layers[slot.layer].params[slot.name], DeferredValues):
                continue  # a recipe: every rank holds the root's already (train.build.share_model)
            target = layers[slot.layer].params[slot.name].reshape(-1)  # a view: contiguous
            target[lo - slot.offset : hi - slot.offset] = values[lo - part.start : hi - part.start]


def broadcast_model(flat: FlatModel, comm: Communicator, root: int = 0) -> None:
    """Give every rank ``root``'s parameters: one in-place broadcast per bucket. Collective.

    Under mixed precision the fp32 master is broadcast, and the working copy made from it;
    call this before a stage takes its shard of the master. Parameters still deferred
    (``nn.init``; level 3) are recipes, not values: the caller gives every rank the root's
    recipes first (``train.build.share_model``), and their elements go as zeros here.
    """
    params = flat.flat_params if flat.master is None else flat.master
    if isinstance(params, LayerValues):  # no flat copy (level 3): through the layers' arrays
        for bucket in flat.buckets:
            values = params.drawn(bucket.whole)
            comm.broadcast(values, root, out=values)
            params[bucket.whole] = values
        return  # the working values are read from the same arrays
    for bucket in flat.buckets:
        comm.broadcast(params[bucket.whole], root, out=params[bucket.whole])
    if flat.master is not None:
        flat.flat_params[...] = flat.master


@dataclass(frozen=True)
class Tie:
    """Layer ``layer``'s parameter ``name`` is layer ``owner``'s ``owner_name`` (owner first)."""

    layer: int
    name: str
    owner: int
    owner_name: str


def find_ties(layers: list[Any]) -> list[Tie]:
    """Return the model's tied parameters: arrays held by more than one layer.

    Raises:
        ValueError: one layer object used at two places (its saved activations would be
            overwritten by the second use), or a tied parameter whose owner writes its
            gradients otherwise than by rows (the later uses could not be added in).
    """
    layer_at: dict[int, int] = {}
    array_at: dict[int, tuple[int, str]] = {}
    ties = []
    for i, layer in enumerate(layers):
        kind = type(layer).__name__
        if id(layer) in layer_at:
            raise ValueError(
                f"the model uses one {kind} object twice: layers {layer_at[id(layer)]} and {i}; "
                "a layer keeps one forward's inputs for its backward, so the second use would "
                f"overwrite the first's; build a second {kind} for the second place and tie "
                "its parameters to the first's (second.params[name] = first.params[name])")
        layer_at[id(layer)] = i
        for name, array in layer.params.items():
            if id(array) not in array_at:
                array_at[id(array)] = (i, name)
                continue
            owner, owner_name = array_at[id(array)]
            if not getattr(layers[owner], "grad_rows", False):
                raise ValueError(
                    f"layers {owner} ({owner_name}) and {i} ({name}) share one parameter array, "
                    f"and {type(layers[owner]).__name__} (layer {owner}) writes its gradient "
                    "whole, not by rows, so the later use's gradient cannot be added to it; "
                    "tie parameters of layers that write gradients by rows (Linear, Embedding, "
                    "LayerNorm) or give each layer its own array")
            ties.append(Tie(i, name, owner, owner_name))
    return ties
