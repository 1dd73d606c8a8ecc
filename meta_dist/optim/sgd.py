"""SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD.

Leaf module: imports numpy and optim.base only; imported through meta_dist.optim.
Algorithm: https://pytorch.org/docs/stable/generated/torch.optim.SGD.html
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meta_dist.optim.base import Array, Optimizer, check_hyperparameter


class SGD(Optimizer):
    """Stochastic gradient descent with PyTorch's semantics, elementwise on a flat range.

    Per step, with ``g`` the gradient: ``g += weight_decay * p``; with momentum, ``buf = g`` on
    the first step and ``buf = momentum * buf + (1 - dampening) * g`` after, then
    ``g = g + momentum * buf`` (Nesterov) or ``g = buf``; finally ``p -= lr * g``.
    State: ``momentum_buffer`` when ``momentum != 0``, none otherwise.
    """

    name = "sgd"

    def __init__(
        self,
        numel: int,
        *,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        xp: Any = np,
        dtype: Any = np.float32,
    ) -> None:
        """Validate hyperparameters and allocate state with ``xp``.

        Args:
            numel: number of parameters updated (0 for an empty shard).
            lr: learning rate, >= 0.
            momentum: momentum factor, >= 0; 0 allocates no state.
            dampening: dampening for momentum.
            nesterov: use Nesterov momentum; needs momentum > 0 and dampening == 0.
            weight_decay: L2 penalty added to the gradient, >= 0.
            xp: array module for state (numpy or cupy).
            dtype: floating-point dtype of state and of the arrays given to ``step``.

        Raises:
            ValueError: a hyperparameter is out of range, or Nesterov is misconfigured.
            TypeError: a hyperparameter is not a number, or ``dtype`` is not floating point.
        """
        self.lr = check_hyperparameter("SGD", "lr", lr)
        self.momentum = check_hyperparameter("SGD", "momentum", momentum)
        self.dampening = check_hyperparameter("SGD", "dampening", dampening, lower=None)
        self.nesterov = bool(nesterov)
        self.weight_decay = check_hyperparameter("SGD", "weight_decay", weight_decay)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(
                "SGD: nesterov=True needs momentum > 0 and dampening == 0; "
                f"got momentum={momentum!r}, dampening={dampening!r}"
            )
        super().__init__(
            numel,
            xp=xp,
            dtype=dtype,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
        )
        self._use_l2_decay(self.weight_decay)

    def _state_keys(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def _update(self, param: Array, grad: Array, piece: slice) -> None:
        xp, scratch = self.xp, self._scratch[: piece.stop - piece.start]
        grad = self._add_l2_decay(param, grad, piece)
        if self.momentum != 0:
            buf = self.state["momentum_buffer"][piece]
            if self.step_count == 1:
                xp.copyto(buf, grad)
            else:
                buf *= self.momentum
                if self.dampening == 0:  # (1 - 0) * g == g exactly: skip a pass
                    buf += grad
                else:
                    xp.multiply(grad, 1 - self.dampening, out=scratch)
                    buf += scratch
            if self.nesterov:
                xp.multiply(buf, self.momentum, out=scratch)
                scratch += grad
                grad = scratch
            else:
                grad = buf
        xp.multiply(grad, self.lr, out=scratch)
        param -= scratch
