"""LossScaler: fp16's loss scale, kept where gradients neither overflow nor vanish.

Leaf module: imports nothing of meta_dist; the trainer owns one when ``precision: fp16``.
Gradients in float16 underflow below 6e-8; multiplying the loss (so every gradient) by a large
scale keeps them representable, and the update divides it out again (Micikevicius et al.,
arXiv 1710.03740, section 3.2). With a dynamic scale a step whose gradients overflowed is skipped
and the scale halved; after ``growth_interval`` good steps in a row it doubles. A scale stuck at
its floor while steps keep overflowing means the model has stopped learning (DeepSpeed #697):
after ``max_skipped_steps`` such skips in a row the run stops with an error instead.
"""

from __future__ import annotations

from typing import Any


class ScaleFloorError(FloatingPointError):
    """Raised when fp16 steps keep overflowing with the loss scale at its floor."""


class LossScaler:
    """The loss scale of fp16 training, and its update after each step's overflow verdict.

    Args:
        scale: the initial scale (dynamic) or the fixed one.
        dynamic: halve on overflow and grow after ``growth_interval`` good steps.
        growth_interval: good steps in a row before the scale doubles.
        min_scale: the floor of a dynamic scale.
        max_skipped_steps: skipped steps in a row at the floor (or with a fixed scale) before
            ScaleFloorError.
    """

    def __init__(self, scale: float = 2.0**16, *, dynamic: bool = True,
                 growth_interval: int = 2000, min_scale: float = 1.0,
                 max_skipped_steps: int = 10) -> None:
        if not scale > 0:
            raise ValueError(f"LossScaler: scale must be > 0; got {scale!r}")
        self.scale, self.dynamic = float(scale), dynamic
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.max_skipped_steps = max_skipped_steps
        self.good_steps = 0  # in a row, since the last overflow or growth
        self.stuck = 0  # skipped steps in a row at the floor (fixed scale: every skip)
        self.skipped = 0  # in all

    def update(self, finite: bool) -> None:
        """Take one step's verdict (agreed by every rank): grow, hold, or back off.

        Raises:
            ScaleFloorError: too many overflowing steps in a row at the floor.
        """
        if finite:
            self.stuck = 0
            self.good_steps += 1
            if self.dynamic and self.good_steps >= self.growth_interval:
                self.scale *= 2.0
                self.good_steps = 0
            return
        self.skipped += 1
        self.good_steps = 0
        at_floor = not self.dynamic or self.scale <= self.min_scale
        if self.dynamic:
            self.scale = max(self.scale / 2.0, self.min_scale)
        self.stuck = self.stuck + 1 if at_floor else 0
        if self.stuck >= self.max_skipped_steps:
            where = "fixed at" if not self.dynamic else "at its floor of"
            raise ScaleFloorError(
                f"fp16: {self.stuck} steps in a row overflowed with the loss scale {where} "
                f"{self.scale:g}, so the model has stopped learning; expected at most "
                f"{self.max_skipped_steps - 1} (meta_dist_config.max_skipped_steps); lower the "
                "learning rate, clip gradients (clip_grad_norm), use loss_scale: dynamic, or "
                "train in bf16 or fp32")

    def state_dict(self) -> dict[str, Any]:
        """Return the scaler's state (for checkpoints)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "stuck": self.stuck,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from ``state_dict``."""
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.stuck, self.skipped = int(state["stuck"]), int(state["skipped"])
