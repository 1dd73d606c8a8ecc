"""The Layer contract and the plain layers: Linear, ReLU, Sigmoid, Tanh, GELU, Flatten, LogSoftmax.

Leaf module: imports numpy, ``meta_dist.xp``, ``nn.init`` and ``nn.grad_blocks`` only; the
other layer modules (``conv``, ``norm``, ``embedding``, ``composite``, ``dropout``,
``transformer``), ``nn.model``, ``meta_dist.models``, the benchmarks and the tests import it.
The checks and helpers here (``_positive``, ``_check_last_axis``, ``_uniform``, ``_matmul_into``)
serve those layer modules too. Every layer runs unchanged on numpy or CuPy arrays: the array
module comes from the input or a parameter, and numpy itself is used only to draw initial values
on the host.

Initialisation follows PyTorch's defaults (``torch.nn.Linear.reset_parameters``):
https://pytorch.org/docs/stable/generated/torch.nn.Linear.html
"""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np

from meta_dist.nn.grad_blocks import ParamBlocks, read_rows, sum_rows, write_grad
from meta_dist.nn.init import DeferredValues, draw
from meta_dist.xp import array_module

GELU_TANH_COEF = math.sqrt(2.0 / math.pi)
GELU_CUBIC_COEF = 0.044715


class Layer:
    """Base class: a layer with ``forward(x)`` and ``backward(dout)``.

    ``params`` maps a name to a parameter array and ``grads`` maps the same names to arrays of
    the same shapes; parameter-free layers have empty dicts. ``forward`` stores in named
    attributes exactly what ``backward`` needs. ``training`` is True by default and
    ``Sequential`` toggles it.

    Gradient contract: external code (the flat-parameter machinery of ZeRO) may REBIND
    ``params[name]`` and ``grads[name]`` to views into one flat contiguous buffer. Layers
    therefore read ``self.params[name]`` at call time and never keep another reference, and
    ``backward`` WRITES this pass's gradient INTO the existing ``grads[name]`` array in place
    (``out=`` or ``g[...] = value``), never rebinding the dict entry. Semantics are overwrite,
    not accumulate: after ``backward`` the grads hold exactly this pass's gradient. ``backward``
    writes the gradients in the order of ``params`` (ZeRO lays them out so that a backward pass
    writes at ever lower offsets). A layer whose class sets ``grad_rows`` writes each one
    through ``nn.grad_blocks.write_grad``, so ZeRO may hand it a GradBlocks instead of an
    array and take a gradient larger than a bucket one block of rows at a time.
    """

    grad_rows = False
    buffer_names: tuple[str, ...] = ()  # state that is not trained (BatchNorm's running stats)

    def __init__(self) -> None:
        self.params: dict[str, object] = {}
        self.grads: dict[str, object] = {}
        self.training = True
        # False for a model's first layer (Sequential sets it): nobody reads the gradient with
        # respect to the data, and for Linear/Conv2d it costs a matmul as big as dW.
        self.input_grad = True

    def forward(self, x):
        """Return the layer's output for ``x`` and keep what ``backward`` needs."""
        raise NotImplementedError

    def backward(self, dout):
        """Write param grads in place into ``self.grads`` and return the gradient w.r.t. x."""
        raise NotImplementedError

    def _add_param(self, name: str, value: Any, dtype, xp: types.ModuleType) -> None:
        """Move a host-drawn value onto ``xp`` as ``params[name]``, with a zero grad beside it.

        DeferredValues stay a recipe, for ``xp`` in ``dtype`` (``nn.init.deferred``).
        """
        if isinstance(value, DeferredValues):
            value.dtype, value.xp = np.dtype(dtype), xp
            self.params[name] = value
            # no memory either (a GPU's zeros are real): ZeRO binds its buffers before backward
            self.grads[name] = xp.broadcast_to(xp.zeros((), value.dtype), value.shape)
            return
        self.params[name] = xp.asarray(value, dtype=dtype)
        # zeros, not zeros_like: numpy's zeros leaves untouched pages to the kernel (no memory
        # until written), and ZeRO rebinds these grads to its own buffers before any write
        self.grads[name] = xp.zeros(self.params[name].shape, dtype=self.params[name].dtype)


def _uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...],
             dtype=np.float32) -> Any:
    """Draw U(-bound, bound) on the host (``nn.init.draw``: in blocks, or deferred)."""
    return draw(rng, "uniform", bound, shape, dtype)


def _positive(api: str, name: str, value) -> int:
    """Return ``value`` if it is a positive int, else raise TypeError or ValueError."""
    if not isinstance(value, int):
        raise TypeError(f"{api}: {name} has the wrong type; got {value!r}, expected an int")
    if value < 1:
        raise ValueError(f"{api}: {name} is not positive; got {value}, expected >= 1")
    return value


def _check_last_axis(api: str, x, width: int) -> None:
    """Raise ValueError unless the last axis of ``x`` has ``width`` elements."""
    if x.ndim < 1 or x.shape[-1] != width:
        raise ValueError(f"{api}: last axis of input is wrong; got shape {tuple(x.shape)}, "
                         f"expected (..., {width})")


def _matmul_into(a, b, grad) -> None:
    """Write ``a @ b`` into ``grad`` (any shape of the same size) without rebinding it."""
    xp = array_module(grad)
    if grad.flags.c_contiguous:
        xp.matmul(a, b, out=grad.reshape(a.shape[0], b.shape[-1]))  # reshape is a view here
    else:
        grad[...] = xp.matmul(a, b).reshape(grad.shape)


class Linear(Layer):
    """Fully connected layer ``y = x @ W + b`` with W of shape (in_features, out_features).

    W is stored input-major so forward needs no transpose. Leading axes of x beyond the last one
    are treated as batch axes.
    """

    grad_rows = True
    param_rows = True  # forward and backward read a ParamBlocks weight block by block

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 rng: np.random.Generator, dtype=np.float32, xp: types.ModuleType = np) -> None:
        """Create the layer with PyTorch's default initialisation.

        Args:
            in_features: size of the last input axis.
            out_features: size of the last output axis.
            bias: whether to add a learned bias.
            rng: host generator for the initial values; weight and bias ~ U(-k, k),
                k = 1/sqrt(in_features).
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: a size is not an int.
            ValueError: a size is not positive.
        """
        super().__init__()
        self.in_features = _positive("Linear", "in_features", in_features)
        self.out_features = _positive("Linear", "out_features", out_features)
        bound = 1.0 / math.sqrt(in_features)
        self._add_param("weight", _uniform(rng, bound, (in_features, out_features), dtype), dtype,
                        xp)
        if bias:
            self._add_param("bias", _uniform(rng, bound, (out_features,), dtype), dtype, xp)
        self.x = None

    def forward(self, x):
        """Return ``x @ W + b``; keeps x for the weight gradient.

        Raises:
            ValueError: the last axis of x is not in_features.
        """
        _check_last_axis("Linear.forward", x, self.in_features)
        self.x = x
        # one 2-D product: BLAS sees every row at once, where numpy would run a 3-D @ 2-D
        # product block by block (`bench train --model gpt` shows the difference)
        x2, weight = x.reshape(-1, self.in_features), self.params["weight"]
        if isinstance(weight, ParamBlocks):  # ZeRO-3, a layer larger than a bucket
            return self._forward_blocks(x2, weight).reshape(*x.shape[:-1], self.out_features)
        out = x2 @ weight
        if "bias" in self.params:  # in place: no second output-sized array
            out += self.params["bias"]
        return out.reshape(*x.shape[:-1], self.out_features)

    def _forward_blocks(self, x2, weight: ParamBlocks):
        """Return ``x2 @ W + b`` with W and b read a block of rows at a time.

        Each block is valid until the next is read: the bias first (it lies below the weight in
        the flat buffer, so its bucket is the weight's first), then x @ W as the sum of
        x[:, rows] @ W[rows], added up in float32 when the layer computes in 16 bits, and
        returned in the dtype one product gives (numpy's bfloat16 product is float32, CuPy's
        bfloat16): every ZeRO level computes in the same precision.
        """
        xp = array_module(x2)
        bias = None
        if "bias" in self.params:
            bias = xp.empty(self.out_features, x2.dtype)
            for first, stop, b in read_rows(self.params["bias"]):
                bias[first:stop] = b
        wide = x2.dtype.itemsize < 4
        out = None
        for first, stop, w in weight.blocks():
            part = x2[:, first:stop] @ w
            if out is None:
                out = part.astype(np.float32) if wide else part
            else:
                out += part
        if bias is not None:
            out += bias
        return out.astype(part.dtype) if wide else out

    def backward(self, dout):
        """Write dW = x.T @ dout and db = dout.sum(0) in place; return dout @ W.T.

        Returns None instead when ``input_grad`` is False (a model's first layer).
        """
        x2 = self.x.reshape(-1, self.in_features)
        d2 = dout.reshape(-1, self.out_features)
        write_grad(self.grads["weight"], lambda first, stop, out: _matmul_into(
            x2[:, first:stop].T, d2, out))
        if "bias" in self.grads:
            write_grad(self.grads["bias"],
                       lambda first, stop, out: sum_rows(d2[:, first:stop], out))
        if not self.input_grad:
            return None
        weight = self.params["weight"]
        if not isinstance(weight, ParamBlocks):
            return (d2 @ weight.T).reshape(*dout.shape[:-1], self.in_features)
        dx = None
        for first, stop, w in weight.blocks():  # dx[:, rows] = dout @ W[rows].T
            part = d2 @ w.T
            if dx is None:  # in the dtype one product gives, as forward
                dx = array_module(d2).empty((d2.shape[0], self.in_features), part.dtype)
            dx[:, first:stop] = part
        return dx.reshape(*dout.shape[:-1], self.in_features)


class ReLU(Layer):
    """Rectified linear unit ``max(x, 0)``."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = None

    def forward(self, x):
        """Return ``max(x, 0)``; keeps the boolean mask (1 byte per element)."""
        self.mask = x > 0
        return x * self.mask

    def backward(self, dout):
        """Return ``dout`` where x > 0, else 0."""
        return dout * self.mask


class Sigmoid(Layer):
    """Logistic function ``1 / (1 + exp(-x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.out = None

    def forward(self, x):
        """Return sigmoid(x), computed as 0.5 * (1 + tanh(x / 2)) so exp never overflows."""
        xp = array_module(x)
        self.out = 0.5 * (1.0 + xp.tanh(0.5 * x))
        return self.out

    def backward(self, dout):
        """Return ``dout * s * (1 - s)``."""
        return dout * self.out * (1.0 - self.out)


class Tanh(Layer):
    """Hyperbolic tangent."""

    def __init__(self) -> None:
        super().__init__()
        self.out = None

    def forward(self, x):
        """Return tanh(x); keeps it for backward."""
        self.out = array_module(x).tanh(x)
        return self.out

    def backward(self, dout):
        """Return ``dout * (1 - tanh(x)**2)``."""
        return dout * (1.0 - self.out * self.out)


class GELU(Layer):
    """GELU, tanh approximation (PyTorch ``approximate='tanh'``).

    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))``. The tanh form is used because
    numpy has no vectorised erf, and it keeps numpy and CuPy results identical.
    """

    def __init__(self) -> None:
        super().__init__()
        self.x = None
        self.t = None

    def forward(self, x):
        """Return GELU(x); keeps x and the tanh term."""
        xp = array_module(x)
        self.x = x
        t = x * GELU_CUBIC_COEF  # the tanh term, built in one array: passes, not temporaries
        t *= x  # scaled before the cube, so float16 overflows no sooner than the formula does
        t *= x
        t += x
        t *= GELU_TANH_COEF
        self.t = xp.tanh(t, out=t)
        out = t + 1.0
        out *= x
        out *= 0.5
        return out

    def backward(self, dout):
        """Return ``dout * d/dx GELU(x)``: ``0.5 (1 + t + x (1 - t^2) du/dx)``, in two arrays."""
        xp = array_module(dout)
        x, t = self.x, self.t
        du = x * (3.0 * GELU_CUBIC_COEF)  # du/dx of the tanh argument: sqrt(2/pi) (1 + 3c x^2),
        du *= x  # scaled before the square (float16: x*x overflows from |x| = 256)
        du += 1.0
        du *= GELU_TANH_COEF
        if du.dtype.itemsize < 4:  # float16's du is inf from |x| ~ 700, where 1 - t^2 is 0:
            xp.minimum(du, np.finfo(du.dtype).max, out=du)  # keep 0 * du a 0, not a NaN
        grad = t * t
        xp.subtract(1.0, grad, out=grad)
        grad *= x
        grad *= du
        grad += t
        grad += 1.0
        grad *= 0.5
        if grad.dtype != dout.dtype:  # promote as dout * grad would (fp16 x, fp32 dout)
            return grad * dout
        grad *= dout
        return grad


class Flatten(Layer):
    """Flatten every axis but the first: (N, ...) -> (N, prod(...))."""

    def __init__(self) -> None:
        super().__init__()
        self.x_shape = None

    def forward(self, x):
        """Return ``x.reshape(N, -1)`` (a view when x is contiguous)."""
        self.x_shape = x.shape
        return x.reshape(x.shape[0], -1)

    def backward(self, dout):
        """Return dout reshaped to the input's shape."""
        return dout.reshape(self.x_shape)


class LogSoftmax(Layer):
    """Log of softmax over axis 1, computed as ``x - max - log(sum(exp(x - max)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.out = None

    def forward(self, x):
        """Return log-softmax over axis 1; subtracting the max keeps exp from overflowing."""
        xp = array_module(x)
        shifted = x - x.max(axis=1, keepdims=True)
        self.out = shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))
        return self.out

    def backward(self, dout):
        """Return ``dout - softmax * sum(dout, axis=1)``."""
        xp = array_module(dout)
        return dout - xp.exp(self.out) * dout.sum(axis=1, keepdims=True)
