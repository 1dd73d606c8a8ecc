"""OwnedLayout: where a stage's owned elements lie; decay spans, checkpoint shard out and in.

Imports meta_dist.xp (meta_dist.zero.flat, meta_dist.zero.partition and meta_dist.optim for
type hints only); meta_dist.zero.stages mixes it into ZeroStage. The optimizer sees this rank's
owned slices of the flat buffer end to end (``owned_slices``); a checkpoint stores each rank's
shard of every bucket (``shard_ranges``), named by parameter. These map one onto the other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meta_dist.xp import to_numpy

if TYPE_CHECKING:
    from meta_dist.optim import Optimizer
    from meta_dist.zero.flat import FlatModel
    from meta_dist.zero.partition import Slot


class OwnedLayout:
    """Mixin of ZeroStage: maps flat offsets into the owned layout and back.

    Uses the stage's ``flat``, ``rank``, ``optimizer``, ``master``, ``owned_slices()``,
    ``_owned_params()`` and ``_owned_working()``.
    """

    flat: FlatModel
    rank: int
    optimizer: Optimizer
    master: list[Any] | None

    def optimizer_spans(self, picked: Callable[[Slot], bool]) -> list[tuple[int, int]]:
        """Return where the parameters ``picked`` chooses lie in this rank's optimizer range.

        The optimizer sees the owned slices end to end; this maps each picked slot's flat
        elements into that range (for ``Optimizer.set_decay_spans``).
        """
        spans, at = [], 0
        for owned in self.owned_slices():
            for slot in self.flat.slots:
                lo, hi = max(owned.start, slot.offset), min(owned.stop, slot.offset + slot.numel)
                if lo < hi and picked(slot):
                    spans.append((at + lo - owned.start, at + hi - owned.start))
            at += owned.stop - owned.start
        return spans

    def shard_ranges(self) -> list[tuple[int, int]]:
        """This rank's shard of every bucket as flat ranges: what it writes to a checkpoint."""
        return [(b.shard(self.rank).start, b.shard(self.rank).stop) for b in self.flat.buckets]

    def export_shard(self) -> dict[str, list[Any]]:
        """Return this rank's shard of the fp32 parameters and of every optimizer state array.

        Each a list of host pieces (views where the data already is on the host), the rank's
        shard of every bucket end to end (``shard_ranges``).
        """
        out = {"params": self._shard_pieces(self._owned_params())}
        for key, state in self.optimizer.state.items():
            out[key] = self._shard_pieces([state])
        return out

    def _shard_pieces(self, owned: list[Any]) -> list[Any]:
        """Cut the shard ranges out of arrays laid out like ``owned_slices``."""
        bounds, at = [], 0
        for a in owned:
            bounds.append((at, a.reshape(-1)))
            at += a.size
        pieces = []
        for start, stop in self.shard_ranges():
            first = self._owned_at(start)
            for base, flat in bounds:  # a shard lies in one owned array (or one full one)
                if base <= first < base + flat.size:
                    pieces.append(to_numpy(flat[first - base : first - base + stop - start]))
                    break
        return pieces

    def _owned_at(self, offset: int) -> int:
        """Return where flat ``offset`` (inside an owned slice) lies in the owned layout."""
        at = 0
        for s in self.owned_slices():
            if s.start <= offset < s.stop:
                return at + offset - s.start
            at += s.stop - s.start
        raise ValueError(f"_owned_at: offset {offset} is not in this rank's owned slices")

    def import_values(self, read: Callable[[str, str, int, int], Any],
                      name_of: Callable[[Slot], str]) -> None:
        """Fill the parameters and the optimizer state from a checkpoint, element by element.

        Args:
            read: ``read(what, name, first, stop)`` returns elements of a parameter's values
                ("params") or optimizer state (its key) from the checkpoint.
            name_of: the checkpoint's name of a slot's parameter.
        """
        xp, flat = self.flat.xp, self.flat
        if flat.flat_params is not None:  # the whole working copy, where this rank holds it
            for slot in flat.slots:
                flat.view(flat.flat_params, slot)[...] = xp.asarray(
                    read("params", name_of(slot), 0, slot.numel).reshape(slot.shape))
        targets = [(key, [state]) for key, state in self.optimizer.state.items()]
        if self.master is not None:
            targets.append(("params", self.master))
        if flat.flat_params is None:  # level 3: only the owned working copy
            targets.append(("params", self._owned_working()))
        for what, arrays in targets:
            owned = xp.concatenate([a.reshape(-1) for a in arrays]) if len(arrays) > 1 \
                else arrays[0].reshape(-1)
            at = 0
            for s in self.owned_slices():
                for slot in flat.slots:
                    lo, hi = max(s.start, slot.offset), min(s.stop, slot.offset + slot.numel)
                    if lo < hi:
                        owned[at + lo - s.start : at + hi - s.start] = xp.asarray(read(
                            what, name_of(slot), lo - slot.offset, hi - slot.offset))
                at += s.stop - s.start
            if len(arrays) > 1:  # pieces of the master: copy back
                start = 0
                for a in arrays:
                    a.reshape(-1)[...] = owned[start : start + a.size]
                    start += a.size
