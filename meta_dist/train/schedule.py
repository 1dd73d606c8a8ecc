"""Learning-rate schedules: constant, or cosine decay after a linear warmup.

Leaf module: pure maths; the trainer sets the optimizer's ``lr`` from it before each step.
Cosine decay as in Loshchilov & Hutter, arXiv 1608.03983 (without restarts), toward zero, which
it would reach one step after the last (PyTorch's CosineAnnealingLR with T_max the steps after
warmup: the last step still trains); the warmup rises linearly so that step 0 already trains
(nanoGPT's form).
"""

from __future__ import annotations

import math


def learning_rate(schedule: str, base: float, step: int, total: int, warmup: int) -> float:
    """Return the learning rate of optimizer step ``step`` (0-based) of ``total``.

    Args:
        schedule: "constant" or "cosine".
        base: the configured lr.
        step: this step's index.
        total: optimizer steps in the whole run.
        warmup: steps of linear warmup first (0: none): lr * (step + 1) / (warmup + 1).

    Raises:
        ValueError: an unknown schedule.
    """
    if step < warmup:
        return base * (step + 1) / (warmup + 1)
    if schedule == "constant":
        return base
    if schedule == "cosine":
        span = max(total - warmup, 1)
        progress = min(step - warmup, span) / span
        return base * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"learning_rate: unknown schedule; got {schedule!r}, expected constant or "
                     "cosine")
