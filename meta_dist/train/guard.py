"""FiniteGuard: no step trains on a non-finite loss or gradient without every rank knowing.

Imports numpy and meta_dist.xp; the trainer makes one per run (``meta_dist_config.nonfinite``).
One NaN in one input row would otherwise train to ``loss nan`` for every epoch and exit 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meta_dist.xp import array_module, to_numpy


class NonFiniteError(FloatingPointError):
    """Raised on every rank when a step's loss or gradients were not finite."""


class FiniteGuard:
    """Check each step's loss and gradients, and agree on the verdict across ranks.

    After the gradients are reduced, this rank looks at its loss and at its shard of the reduced
    gradients (the shards of all ranks cover every gradient once; one pass over 1/N of them:
    their dot product, non-finite exactly when some element is), and three numbers
    (non-finite loss, non-finite gradients, the loss itself) are summed across ranks by one
    small allreduce started on the communication thread. Mode ``stop`` lets the update run
    meanwhile and waits after it, so the step does not wait for the exchange; a non-finite
    verdict then raises NonFiniteError on every rank. Mode ``skip`` waits before the update and
    leaves the parameters (and optimizer state) of that step untouched on every rank.

    Args:
        mode: "stop" or "skip".
        comm: the data-parallel communicator.
        names: maps a flat-buffer offset to the name of the parameter there (for messages).
    """

    def __init__(self, mode: str, comm: Any, names: Any) -> None:
        self.mode, self.comm, self.names = mode, comm, names
        self.skipped = 0
        self._loss: Any = None
        self._grads: list[Any] = []
        self._offsets: list[int] = []
        self._flags: Any = None
        self._handle: Any = None
        self._verdict: Any = None

    def watch(self, loss: Any) -> None:
        """Note this step's local loss (a 0-d array; no host sync here)."""
        self._loss = loss

    def inspect(self, grads: list[Any], offsets: list[int]) -> bool:
        """Start agreeing on this step; return whether the update may run (``skip`` waits)."""
        xp = array_module(grads[0]) if grads else np
        total = xp.zeros((), np.float64)
        for g in grads:
            if g.size:
                total += xp.dot(g, g)  # inf or nan exactly when an element is
        flags = xp.zeros(3, np.float64)
        flags[0] = ~xp.isfinite(self._loss)
        flags[1] = ~xp.isfinite(total)
        flags[2] = self._loss
        self._grads, self._offsets, self._flags, self._verdict = grads, offsets, flags, None
        try:
            self._handle = self.comm.allreduce_async(flags, "sum", out=flags)
        except RuntimeError:  # MPI without threads (refused on every rank before any call)
            self._handle = _Done(self.comm.allreduce(flags, "sum", out=flags))
        if self.mode != "skip":
            return True
        return not self._verdict_bad()

    def settle(self, where: str) -> None:
        """Wait for the verdict of the step just taken; raise NonFiniteError if it failed.

        Args:
            where: the step, for the message ("epoch 2 step 5").
        """
        if self._flags is None:
            return
        bad = self._verdict_bad()
        self._flags = None
        if bad and self.mode == "skip":
            self.skipped += 1
        elif bad:
            self._fail(where)

    def _verdict_bad(self) -> bool:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            self._verdict = to_numpy(self._flags)
        return bool(self._verdict[0] or self._verdict[1])

    def _fail(self, where: str) -> None:
        """Name the ranks and the first parameter where it appeared, on every rank. Collective."""
        loss_bad = not np.isfinite(float(to_numpy(self._loss)))
        first = None
        for g, offset in zip(self._grads, self._offsets, strict=True):
            bad = np.flatnonzero(~np.isfinite(to_numpy(g)))
            if bad.size:
                first = self.names(offset + int(bad[0]))
                break
        every = self.comm.connector.allgather((loss_bad, float(to_numpy(self._loss)), first))
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
            f"{what}; training stopped on every rank; look for NaN or inf in that rank's data, "
            "lower the learning rate, or clip gradients (clip_grad_norm); nonfinite: skip "
            "skips such steps instead")


class _Done:
    """A handle whose operation already ran (the blocking fallback)."""

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result
