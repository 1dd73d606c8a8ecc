"""StepGuard: one small exchange per step for what every rank must agree on before it updates.

Imports numpy and meta_dist.xp (and train.scaler); the trainer makes one per run. It carries
four things the ranks could otherwise get wrong alone:
- finite numbers: one NaN in one input row would train to ``loss nan`` for every epoch and
  exit 0 (``meta_dist_config.nonfinite``: stop, skip or ignore);
- fp16 overflow: every rank skips the same step and moves the loss scale alike;
- clipping by the global norm: from every rank's shard, each gradient counted once (DeepSpeed
  #6480, #7220 clipped by averaged per-rank norms);
- a stop signal (``train.signals``): a rank that caught SIGTERM votes, and every rank stops
  after the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from meta_dist.train.scaler import LossScaler, ScaleFloorError
from meta_dist.xp import array_module, to_numpy

WIDEN_BLOCK = 1 << 16  # elements widened to float32 at a time for a narrow gradient's norm


class NonFiniteError(FloatingPointError):
    """Raised on every rank when a step's loss or gradients were not finite."""


class StepGuard:
    """Check each step's loss and gradients, agree across ranks, clip, skip or stop.

    After the gradients are reduced, this rank looks at its loss and at its shard of the reduced
    gradients (the shards of all ranks cover every gradient once): one pass over 1/N of them
    for the sum of squares, which is non-finite exactly when some element is (mode ``ignore``
    without clipping or loss scale skips that pass). Four numbers (non-finite losses, the sum
    of squares, the loss, stop votes) are summed across ranks by one small allreduce on the
    communication thread. When nothing depends on the answer before the
    update (mode ``stop``, no clipping, no loss scale) the update runs meanwhile and the
    verdict is read after it, so the step does not wait for the exchange.

    Args:
        comm: the data-parallel communicator.
        names: maps a flat-buffer offset to the name of the parameter there (for messages).
        mode: "stop" (NonFiniteError on every rank), "skip" (that step's update left out on
            every rank) or "ignore" (only clipping and the loss scale use the exchange).
        clip: clip the gradients to this global L2 norm (None: no clipping).
        scaler: fp16's loss scale: an overflow skips the step and backs the scale off.
        max_skipped_steps: skipped steps in a row (mode skip) before NonFiniteError.
        stop_vote: returns True when this rank wants training to stop (a signal arrived).
    """

    def __init__(self, comm: Any, names: Any, *, mode: str = "stop", clip: float | None = None,
                 scaler: LossScaler | None = None, max_skipped_steps: int = 10,
                 stop_vote: Callable[[], bool] = lambda: False) -> None:
        self.comm, self.names, self.mode, self.clip, self.scaler = comm, names, mode, clip, scaler
        self.max_skipped_steps, self.stop_vote = max_skipped_steps, stop_vote
        self.stop_agreed = False  # some rank voted to stop in the step just settled
        self.skipped = self._in_a_row = 0
        self.norm = math.nan  # the last step's global gradient norm (after unscaling)
        self._loss: Any = None
        self._step: tuple[list[Any], list[int]] | None = None
        self._flags: Any = None
        self._handle: Any = None
        self._verdict: np.ndarray | None = None

    @property
    def measures(self) -> bool:
        """Whether steps are checked at all (the sum of squares, warnings silenced).

        Not in mode ignore without clipping or a loss scale, where only the stop vote is
        exchanged.
        """
        return self.mode != "ignore" or self.waits_before_update

    @property
    def waits_before_update(self) -> bool:
        """Whether the update needs the verdict (skipping, clipping, loss scaling)."""
        return self.mode == "skip" or self.clip is not None or self.scaler is not None

    def watch(self, loss: Any) -> None:
        """Note this step's local loss (a 0-d array; no host sync here)."""
        self._loss = loss

    def inspect(self, grads: list[Any], offsets: list[int], scale: float) -> tuple[bool, float]:
        """Start agreeing on this step; return (update or not, factor for the gradients).

        Args:
            grads: this rank's shard of every bucket's reduced gradient.
            offsets: where each lies in the flat buffer (for naming a parameter).
            scale: what the gradients will be multiplied by (unscaling, micro-batches).
        """
        xp = array_module(grads[0]) if grads else np
        flags = xp.zeros(4, np.float64)
        flags[0] = ~xp.isfinite(self._loss)
        if self.measures:
            flags[1] = _sum_of_squares(grads, xp) * scale * scale
        flags[2] = self._loss
        flags[3] = self.stop_vote()
        self._step, self._flags, self._verdict = (grads, offsets), flags, None
        try:
            self._handle = self.comm.allreduce_async(flags, "sum", out=flags)
        except RuntimeError:  # MPI without threads (refused on every rank before any call)
            self._handle = None
            self.comm.allreduce(flags, "sum", out=flags)
        if not self.waits_before_update:
            return True, scale
        if self._bad() and (self.mode != "ignore" or self.scaler is not None):
            return False, scale  # mode ignore updates anyway, as without a check (not fp16)
        if self.clip is not None and self.norm > self.clip:
            scale *= self.clip / (self.norm + 1e-6)
        return True, scale

    def settle(self, where: str) -> None:
        """Take the verdict of the step just taken: update the loss scale, count, or stop.

        Args:
            where: the step, for messages ("epoch 2 step 5").

        Raises:
            NonFiniteError: mode stop and the step was not finite, mode skip and too many
                steps in a row were skipped, or (fp16) steps keep overflowing with the loss
                scale at its floor or fixed (the scaler's ScaleFloorError, in the message).
        """
        if self._flags is None:
            return
        bad = self._bad()
        self.stop_agreed = bool(self._verdict[3])
        self._flags = None
        if self.scaler is not None:
            self.skipped += bad
            try:
                self.scaler.update(not bad)
            except ScaleFloorError as stuck:  # every rank has the same verdict: all come here
                self._fail(where, f"; {stuck}")
        elif not bad:
            self._in_a_row = 0
        elif self.mode == "skip":
            self.skipped += 1
            self._in_a_row += 1
            if self._in_a_row >= self.max_skipped_steps:
                self._fail(where, f"; {self._in_a_row} steps in a row were skipped")
        elif self.mode == "stop":
            self._fail(where, "")

    def _bad(self) -> bool:
        if self._verdict is None:
            if self._handle is not None:
                self._handle.wait()
                self._handle = None
            self._verdict = to_numpy(self._flags)
            self.norm = (math.sqrt(self._verdict[1]) if self.measures and self._verdict[1] >= 0
                         else math.nan)
        return bool(self._verdict[0]) or not math.isfinite(self._verdict[1])

    def _fail(self, where: str, streak: str) -> None:
        """Name the ranks and the first parameter where it appeared, on every rank. Collective."""
        loss = float(to_numpy(self._loss))
        first = None
        for g, offset in zip(*self._step, strict=True):
            bad = np.flatnonzero(~np.isfinite(to_numpy(g).astype(np.float32)))
            if bad.size:
                first = self.names(offset + int(bad[0]))
                break
        every = self.comm.connector.allgather((not math.isfinite(loss), loss, first))
        losses = [r for r, (bad, _, _) in enumerate(every) if bad]
        if losses:
            what = (f"non-finite loss at {where}: on rank {', '.join(map(str, losses))} ("
                    + ", ".join(f"rank {r}: {every[r][1]}" for r in losses) + ")")
        else:
            params = sorted({p for _, _, p in every if p is not None})
            ranks = [r for r, (_, _, p) in enumerate(every) if p is not None]
            what = (f"non-finite gradients at {where} (the loss was finite on every rank): in "
                    f"{', '.join(params) or 'the reduced gradients'}, held by rank"
                    f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}")
        raise NonFiniteError(
            f"{what}{streak}; training stopped on every rank; look for NaN or inf in that "
            "rank's data, lower the learning rate, or clip gradients (clip_grad_norm)"
            + ("" if streak else "; nonfinite: skip skips such steps instead"))


def _sum_of_squares(grads: list[Any], xp: Any) -> Any:
    """Return the sum of squares of ``grads`` (float64 0-d), without a full-size temporary."""
    total = xp.zeros((), np.float64)
    for g in grads:
        if g.dtype.itemsize >= 4:
            if g.size:
                total += xp.dot(g, g)
            continue
        for start in range(0, g.size, WIDEN_BLOCK):  # float16 would overflow at 65504
            block = g[start : start + WIDEN_BLOCK].astype(np.float32)
            total += xp.dot(block, block)
    return total
