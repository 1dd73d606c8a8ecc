"""Layers with forward() and backward() side by side: Linear, Conv2d, BatchNorm, activations, pools.

Leaf module: imports numpy and ``meta_dist.xp`` only; ``nn.model`` and the tests import it.
Every layer runs unchanged on numpy or CuPy arrays: the array module comes from the input or a
parameter, and numpy itself is used only to draw initial values on the host.

Initialisation follows PyTorch's defaults (``torch.nn.Linear.reset_parameters``):
https://pytorch.org/docs/stable/generated/torch.nn.Linear.html
"""

from __future__ import annotations

import math
import types
from typing import Any

import numpy as np

from meta_dist.nn.grad_blocks import ParamBlocks, read_rows, write_grad
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
        """Move a host-drawn value onto ``xp`` as ``params[name]``, with a zero grad beside it
        (DeferredValues stay a recipe, for ``xp`` in ``dtype``: ``nn.init.deferred``)."""
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


def _pair(api: str, name: str, value, minimum: int) -> tuple[int, int]:
    """Return ``value`` (an int or a pair of ints) as a pair, checking each is >= minimum."""
    pair = (value, value) if isinstance(value, int) else value
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
        isinstance(v, int) for v in pair
    ):
        raise TypeError(
            f"{api}: {name} has the wrong type; got {value!r}, expected an int or a pair of ints"
        )
    if min(pair) < minimum:
        raise ValueError(
            f"{api}: {name} too small; got {value!r}, expected every entry >= {minimum}"
        )
    return tuple(pair)


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


def _check_4d(api: str, x, channels: int | None = None) -> None:
    """Raise ValueError unless ``x`` is NCHW (with ``channels`` channels when given)."""
    if x.ndim != 4 or (channels is not None and x.shape[1] != channels):
        rule = "(N, C, H, W)" if channels is None else f"(N, {channels}, H, W)"
        raise ValueError(f"{api}: input has the wrong shape; got {tuple(x.shape)}, expected {rule}")


def _windows(x, kernel: tuple[int, int], stride: tuple[int, int], api: str):
    """Return a strided view of shape (N, C, kh, kw, OH, OW) over ``x`` (NCHW); no copy."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw) = kernel, stride
    if h < kh or w < kw:
        raise ValueError(
            f"{api}: input (after padding) is smaller than the kernel; got {h}x{w}, "
            f"expected at least {kh}x{kw}"
        )
    oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    s_n, s_c, s_h, s_w = x.strides
    xp = array_module(x)
    return xp.lib.stride_tricks.as_strided(
        x, shape=(n, c, kh, kw, oh, ow), strides=(s_n, s_c, s_h, s_w, s_h * sh, s_w * sw)
    )


def _scatter_windows(dwin, out_hw: tuple[int, int], stride: tuple[int, int]):
    """Sum a (N, C, kh, kw, OH, OW) window gradient back onto an (N, C, H, W) zero image.

    Loops over the kh*kw kernel offsets only; each pass is one strided add over the whole batch,
    and it is right for overlapping windows where a pixel gets several contributions.
    """
    xp = array_module(dwin)
    n, c, kh, kw, oh, ow = dwin.shape
    (sh, sw) = stride
    dx = xp.zeros((n, c, *out_hw), dtype=dwin.dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i, i + sh * (oh - 1) + 1, sh)
            cols = slice(j, j + sw * (ow - 1) + 1, sw)
            dx[:, :, rows, cols] += dwin[:, :, i, j]
    return dx


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
        """``x2 @ W + b`` with W and b read a block of rows at a time (each block valid until
        the next is read): the bias first (it lies below the weight in the flat buffer, so
        its bucket is the weight's first), then x @ W as the sum of x[:, rows] @ W[rows],
        added up in float32 when the layer computes in 16 bits (as one product would)."""
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
        return out.astype(x2.dtype) if wide else out

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
                       lambda first, stop, out: d2[:, first:stop].sum(axis=0, out=out))
        if not self.input_grad:
            return None
        weight = self.params["weight"]
        if not isinstance(weight, ParamBlocks):
            return (d2 @ weight.T).reshape(*dout.shape[:-1], self.in_features)
        dx = array_module(d2).empty((d2.shape[0], self.in_features), d2.dtype)
        for first, stop, w in weight.blocks():  # dx[:, rows] = dout @ W[rows].T
            dx[:, first:stop] = d2 @ w.T
        return dx.reshape(*dout.shape[:-1], self.in_features)


class Conv2d(Layer):
    """2-D convolution over NCHW input, weight of shape (out, in, kh, kw).

    Forward is im2col (a strided view, materialised once as (N, in*kh*kw, OH*OW)) and one
    batched matmul, which yields NCHW output directly with no transpose copy. Backward computes
    dW by a batched matmul summed over the batch, and col2im by looping over kernel offsets.
    """

    grad_rows = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, *,
                 bias: bool = True, rng: np.random.Generator, dtype=np.float32,
                 xp: types.ModuleType = np) -> None:
        """Create the layer with PyTorch's default initialisation.

        Args:
            in_channels: channels of the input.
            out_channels: channels of the output.
            kernel_size: int or (kh, kw).
            stride: int or (sh, sw).
            padding: int or (ph, pw) zeros added on each side.
            bias: whether to add a learned per-channel bias.
            rng: host generator; weight and bias ~ U(-k, k), k = 1/sqrt(in_channels*kh*kw).
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            ValueError: a size is not positive (padding may be 0).
            TypeError: a size is not an int (or, where allowed, a pair of ints).
        """
        super().__init__()
        self.in_channels = _positive("Conv2d", "in_channels", in_channels)
        self.out_channels = _positive("Conv2d", "out_channels", out_channels)
        self.kernel_size = _pair("Conv2d", "kernel_size", kernel_size, 1)
        self.stride = _pair("Conv2d", "stride", stride, 1)
        self.padding = _pair("Conv2d", "padding", padding, 0)
        kh, kw = self.kernel_size
        bound = 1.0 / math.sqrt(in_channels * kh * kw)
        shape = (out_channels, in_channels, kh, kw)
        self._add_param("weight", _uniform(rng, bound, shape, dtype), dtype, xp)
        if bias:
            self._add_param("bias", _uniform(rng, bound, (out_channels,), dtype), dtype, xp)
        self.cols = None
        self.padded_hw = None
        self.x_hw = None

    def forward(self, x):
        """Return the convolution of ``x``; keeps the im2col matrix for backward.

        Raises:
            ValueError: x is not (N, in_channels, H, W) or is smaller than the kernel.
        """
        _check_4d("Conv2d.forward", x, self.in_channels)
        xp = array_module(x)
        ph, pw = self.padding
        self.x_hw = x.shape[2:]
        if ph or pw:
            x = xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))  # a copy, as im2col needs one
        self.padded_hw = x.shape[2:]
        win = _windows(x, self.kernel_size, self.stride, "Conv2d.forward")
        n, _, _, _, oh, ow = win.shape
        self.cols = win.reshape(n, -1, oh * ow)  # the one im2col copy
        out = xp.matmul(self.params["weight"].reshape(self.out_channels, -1), self.cols)
        if "bias" in self.params:
            out += self.params["bias"][:, None]
        return out.reshape(n, self.out_channels, oh, ow)

    def backward(self, dout):
        """Write dW and db in place; return dx by col2im over the kernel offsets."""
        xp = array_module(dout)
        n, _, oh, ow = dout.shape
        d3 = dout.reshape(n, self.out_channels, oh * ow)
        weight = self.params["weight"]
        grad_w = self.grads["weight"]
        # (N, out, in*kh*kw) temporary, then a sum over N: measured faster than one tensordot,
        # which would copy the whole im2col matrix into a transposed layout first.
        def weight_rows(first: int, stop: int, out) -> None:
            per_sample = xp.matmul(d3[:, first:stop], self.cols.transpose(0, 2, 1))
            if out.flags.c_contiguous:
                per_sample.sum(axis=0, out=out.reshape(per_sample.shape[1:]))
            else:
                out[...] = per_sample.sum(axis=0).reshape(out.shape)

        write_grad(grad_w, weight_rows)
        if "bias" in self.grads:
            write_grad(self.grads["bias"],
                       lambda first, stop, out: d3[:, first:stop].sum(axis=(0, 2), out=out))
        if not self.input_grad:
            return None
        dcols = xp.matmul(weight.reshape(self.out_channels, -1).T, d3)
        dwin = dcols.reshape(n, self.in_channels, *self.kernel_size, oh, ow)
        dx = _scatter_windows(dwin, self.padded_hw, self.stride)
        (ph, pw), (h, w) = self.padding, self.x_hw
        return dx[:, :, ph : ph + h, pw : pw + w]


class BatchNorm(Layer):
    """Batch normalisation over every axis except 1, for (N, C) or (N, C, H, W) input.

    Training mode normalises with this batch's statistics (biased variance) and updates
    ``running_mean`` and ``running_var`` as PyTorch does, the latter with the unbiased batch
    variance. Eval mode normalises with the running statistics. The statistics are over this
    rank's own part of the batch, not the global batch (PyTorch DDP's default, no SyncBatchNorm).
    The running statistics are buffers (plain attributes), not params.
    """

    buffer_names = ("running_mean", "running_var")

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, *,
                 rng: np.random.Generator | None = None, dtype=np.float32,
                 xp: types.ModuleType = np) -> None:
        """Create the layer with weight 1, bias 0, running mean 0 and running variance 1.

        Args:
            num_features: size of axis 1 (channels).
            eps: added to the variance before the square root.
            momentum: weight of the new batch in the running statistics.
            rng: accepted for a uniform constructor across layers; unused (init is constant).
            dtype: parameter and buffer dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: num_features is not an int.
            ValueError: num_features is not positive or momentum is outside [0, 1].
        """
        super().__init__()
        self.num_features = _positive("BatchNorm", "num_features", num_features)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm: momentum out of range; got {momentum}, expected [0, 1]")
        self.eps = eps
        self.momentum = momentum
        self._add_param("weight", np.ones(num_features), dtype, xp)
        self._add_param("bias", np.zeros(num_features), dtype, xp)
        self.running_mean = xp.zeros(num_features, dtype=dtype)
        self.running_var = xp.ones(num_features, dtype=dtype)
        self.xhat = None
        self.inv_std = None
        self.used_batch_stats = False

    def _axes_and_shape(self, x) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Return the reduction axes and the broadcast shape of a per-channel vector."""
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm.forward: input has the wrong shape; got "
                             f"{tuple(x.shape)}, expected (N, {self.num_features}, ...)")
        axes = (0, *range(2, x.ndim))
        return axes, (1, self.num_features) + (1,) * (x.ndim - 2)

    def forward(self, x):
        """Return ``weight * xhat + bias``; keeps xhat and 1/std for backward.

        Raises:
            ValueError: axis 1 of x is not num_features, or training sees one value per channel.
        """
        xp = array_module(x)
        axes, bshape = self._axes_and_shape(x)
        self.used_batch_stats = self.training
        if self.training:
            count = x.size // self.num_features
            if count < 2:
                raise ValueError(f"BatchNorm.forward: too few values per channel in training; "
                                 f"got {count}, expected >= 2")
            mean = x.mean(axis=axes)
            var = x.var(axis=axes)
            m = self.momentum
            self.running_mean *= 1.0 - m
            self.running_mean += m * mean
            self.running_var *= 1.0 - m
            self.running_var += (m * count / (count - 1)) * var
        else:
            mean, var = self.running_mean, self.running_var
        self.inv_std = 1.0 / xp.sqrt(var + self.eps)
        self.xhat = (x - mean.reshape(bshape)) * self.inv_std.reshape(bshape)
        weight, bias = self.params["weight"], self.params["bias"]
        return self.xhat * weight.reshape(bshape) + bias.reshape(bshape)

    def backward(self, dout):
        """Write dweight and dbias in place; return dx (through the batch stats in training)."""
        axes, bshape = self._axes_and_shape(dout)
        grad_w, grad_b = self.grads["weight"], self.grads["bias"]
        (dout * self.xhat).sum(axis=axes, out=grad_w)
        dout.sum(axis=axes, out=grad_b)
        scale = (self.params["weight"] * self.inv_std).reshape(bshape)
        if not self.used_batch_stats:
            return dout * scale
        # dx = w/std * (dout - mean(dout) - xhat * mean(dout * xhat)); the two means are the
        # grads just written, divided by the count, so no extra reductions are needed.
        count = dout.size // self.num_features
        return scale * (dout - grad_b.reshape(bshape) / count
                        - self.xhat * (grad_w.reshape(bshape) / count))


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


class _Pool2d(Layer):
    """Shared constructor of the pooling layers: NCHW, no padding, stride defaults to kernel."""

    def __init__(self, kernel_size, stride=None) -> None:
        """Create the layer.

        Args:
            kernel_size: int or (kh, kw).
            stride: int or (sh, sw); None means kernel_size (non-overlapping windows).

        Raises:
            ValueError: a size is not positive.
            TypeError: kernel_size or stride is not an int or a pair of ints.
        """
        super().__init__()
        name = type(self).__name__
        self.kernel_size = _pair(name, "kernel_size", kernel_size, 1)
        self.stride = _pair(name, "stride", kernel_size if stride is None else stride, 1)
        self.x_hw = None


class AvgPool2d(_Pool2d):
    """Average pooling over NCHW input, no padding; ``stride`` defaults to ``kernel_size``."""

    def forward(self, x):
        """Return the mean over each window."""
        _check_4d("AvgPool2d.forward", x)
        self.x_hw = x.shape[2:]
        return _windows(x, self.kernel_size, self.stride, "AvgPool2d.forward").mean(axis=(2, 3))

    def backward(self, dout):
        """Spread each output gradient evenly over its window."""
        xp = array_module(dout)
        kh, kw = self.kernel_size
        n, c, oh, ow = dout.shape
        share = dout / (kh * kw)
        dwin = xp.broadcast_to(share[:, :, None, None], (n, c, kh, kw, oh, ow))
        return _scatter_windows(dwin, self.x_hw, self.stride)


class MaxPool2d(_Pool2d):
    """Max pooling over NCHW input, no padding; ``stride`` defaults to ``kernel_size``.

    On ties the gradient goes to the first maximal element of the window (row-major order).
    """

    def __init__(self, kernel_size, stride=None) -> None:
        """Create the layer; see ``_Pool2d``. Keeps each window's argmax for backward."""
        super().__init__(kernel_size, stride)
        self.argmax = None

    def forward(self, x):
        """Return the max over each window; keeps the argmax within each window."""
        _check_4d("MaxPool2d.forward", x)
        self.x_hw = x.shape[2:]
        win = _windows(x, self.kernel_size, self.stride, "MaxPool2d.forward")
        n, c, kh, kw, oh, ow = win.shape
        flat = win.reshape(n, c, kh * kw, oh, ow)  # copies the windows once
        self.argmax = flat.argmax(axis=2)
        return flat.max(axis=2)

    def backward(self, dout):
        """Route each output gradient to its window's (first) maximum."""
        xp = array_module(dout)
        kh, kw = self.kernel_size
        offsets = xp.arange(kh * kw).reshape(1, 1, kh, kw, 1, 1)
        dwin = (self.argmax[:, :, None, None] == offsets) * dout[:, :, None, None]
        return _scatter_windows(dwin, self.x_hw, self.stride)


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
