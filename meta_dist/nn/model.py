"""Sequential: layers run in order, with hooks around each layer's forward and backward.

Leaf module: imports meta_dist.nn.layers only. The hooks are how ZeRO starts reducing a bucket
of gradients while backward is still running, and (level 3) gathers a layer's parameters just
before it runs, without the model knowing about ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from meta_dist.nn.layers import Layer

LayerHook = Callable[[int], None]


class Sequential:
    """Layers applied in order; ``backward`` runs them in reverse.

    Args:
        *layers: the layers, first to last.
    """

    def __init__(self, *layers: Layer) -> None:
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            layer.input_grad = i > 0  # the data needs no gradient
        self.before_forward: LayerHook | None = None
        self.before_backward: LayerHook | None = None
        self.after_backward: LayerHook | None = None

    def forward(self, x: Any) -> Any:
        """Return the output of the last layer; ``before_forward(i)``, when set, runs first."""
        for i, layer in enumerate(self.layers):
            if self.before_forward is not None:
                self.before_forward(i)
            x = layer.forward(x)
        return x

    __call__ = forward

    def backward(self, dout: Any) -> Any:
        """Backpropagate ``dout`` through every layer, writing each layer's grads.

        ``before_backward(i)`` and ``after_backward(i)``, when set, run around layer i.

        Returns:
            The gradient with respect to the input when the first layer computes one; None for
            Linear and Conv2d first layers, which skip it (``Layer.input_grad``).
        """
        for i in range(len(self.layers) - 1, -1, -1):
            if self.before_backward is not None:
                self.before_backward(i)
            dout = self.layers[i].backward(dout)
            if self.after_backward is not None:
                self.after_backward(i)
        return dout

    def train(self, mode: bool = True) -> Sequential:
        """Set training mode (batch statistics in BatchNorm) on every layer; return self."""
        for layer in self.layers:
            layer.training = mode
        return self

    def eval(self) -> Sequential:
        """Set evaluation mode; return self."""
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, int, str]]:
        """Yield (qualified name, layer index, parameter name) in forward order."""
        for i, layer in enumerate(self.layers):
            for name in layer.params:
                yield f"{i}.{type(layer).__name__}.{name}", i, name

    def layer_numels(self) -> list[int]:
        """Return the parameter elements of each layer, in order."""
        return [sum(int(p.size) for p in layer.params.values()) for layer in self.layers]

    def state(self) -> dict[str, Any]:
        """Return {qualified name: parameter array} (views; copy before keeping)."""
        return {q: self.layers[i].params[n] for q, i, n in self.named_parameters()}
