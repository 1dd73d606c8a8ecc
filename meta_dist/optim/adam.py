"""Adam (L2 weight decay) and AdamW (decoupled weight decay), as torch.optim.Adam / AdamW.

Leaf module: imports numpy and optim.base only; imported through meta_dist.optim.
Algorithm: Kingma & Ba, arXiv 1412.6980, Alg. 1; decoupled decay: Loshchilov & Hutter,
arXiv 1711.05101; formulas as in https://pytorch.org/docs/stable/generated/torch.optim.Adam.html
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meta_dist.optim.base import Array, Optimizer, check_hyperparameter


class Adam(Optimizer):
    """Adam with PyTorch's semantics, elementwise on a flat range; AdamW is a parameter of it.

    Per step t, with ``g`` the gradient: ``p *= 1 - lr * weight_decay`` (decoupled) or
    ``g += weight_decay * p`` (L2); ``m += (1 - beta1) * (g - m)``;
    ``v = beta2 * v + (1 - beta2) * g * g``;
    ``p -= (lr / (1 - beta1**t)) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)``.
    State: ``exp_avg`` (m) and ``exp_avg_sq`` (v).
    """

    name = "adam"

    def __init__(
        self,
        numel: int,
        *,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled_weight_decay: bool = False,
        xp: Any = np,
        dtype: Any = np.float32,
    ) -> None:
        """Validate hyperparameters and allocate state with ``xp``.

        Args:
            numel: number of parameters updated (0 for an empty shard).
            lr: learning rate, >= 0.
            betas: decay rates (beta1, beta2) of the moment averages, each in [0, 1).
            eps: added to the denominator for stability, >= 0.
            weight_decay: weight decay factor, >= 0.
            decoupled_weight_decay: decay the weights directly (AdamW) instead of adding
                ``weight_decay * param`` to the gradient (Adam's L2 form).
            xp: array module for state (numpy or cupy).
            dtype: floating-point dtype of state and of the arrays given to ``step``.

        Raises:
            ValueError: a hyperparameter is out of range, or ``betas`` is not a pair.
            TypeError: a hyperparameter is not a number, or ``dtype`` is not floating point.
        """
        api = type(self).__name__
        if isinstance(betas, str) or not isinstance(betas, Sequence) or len(betas) != 2:
            raise ValueError(f"{api}: invalid betas; got {betas!r}, expected a pair (beta1, beta2)")
        self.lr = check_hyperparameter(api, "lr", lr)
        self.beta1 = check_hyperparameter(api, "betas[0]", betas[0], upper=1)
        self.beta2 = check_hyperparameter(api, "betas[1]", betas[1], upper=1)
        self.eps = check_hyperparameter(api, "eps", eps)
        self.weight_decay = check_hyperparameter(api, "weight_decay", weight_decay)
        self.decoupled_weight_decay = bool(decoupled_weight_decay)
        super().__init__(
            numel,
            xp=xp,
            dtype=dtype,
            lr=self.lr,
            betas=(self.beta1, self.beta2),
            eps=self.eps,
            weight_decay=self.weight_decay,
            decoupled_weight_decay=self.decoupled_weight_decay,
        )
        self._use_l2_decay(0.0 if self.decoupled_weight_decay else self.weight_decay)

    def _state_keys(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _update(self, param: Array, grad: Array, piece: slice) -> None:
        xp, scratch = self.xp, self._scratch[: piece.stop - piece.start]
        exp_avg, exp_avg_sq = self.state["exp_avg"][piece], self.state["exp_avg_sq"][piece]
        if self.decoupled_weight_decay and self.weight_decay != 0:
            for a, b in self._decay_ranges(piece):
                param[a:b] *= 1 - self.lr * self.weight_decay
        grad = self._add_l2_decay(param, grad, piece)
        xp.subtract(grad, exp_avg, out=scratch)  # PyTorch's exp_avg.lerp_(grad, 1 - beta1)
        scratch *= 1 - self.beta1
        exp_avg += scratch
        exp_avg_sq *= self.beta2
        xp.multiply(grad, 1 - self.beta2, out=scratch)
        scratch *= grad
        exp_avg_sq += scratch
        # Python floats, as in PyTorch: no device round trip, same value on every rank.
        bias_correction1 = 1 - self.beta1**self.step_count
        bias_correction2 = 1 - self.beta2**self.step_count
        xp.sqrt(exp_avg_sq, out=scratch)
        scratch /= bias_correction2**0.5
        scratch += self.eps
        # m / denom first, then * step_size: keeps one workspace; PyTorch's addcdiv multiplies
        # first, which may differ in the last bit of the update.
        xp.divide(exp_avg, scratch, out=scratch)
        scratch *= self.lr / bias_correction1
        param -= scratch


class AdamW(Adam):
    """Adam with decoupled weight decay (``decoupled_weight_decay=True``), weight_decay 0.01.

    See ``Adam`` for the update and the arguments.
    """

    name = "adamw"

    def __init__(
        self,
        numel: int,
        *,
        lr: float = 1e-3,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        xp: Any = np,
        dtype: Any = np.float32,
    ) -> None:
        """Build Adam with decoupled weight decay; see ``Adam.__init__``."""
        super().__init__(
            numel,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=True,
            xp=xp,
            dtype=dtype,
        )
        # Implied by the name; dropping it keeps make_optimizer(name, numel, **hyperparameters)
        # a round trip of state_dict() for every rule.
        del self.hyperparameters["decoupled_weight_decay"]
