"""Convolution and pooling over NCHW images: Conv2d, AvgPool2d, MaxPool2d and their window views.

Leaf module: imports numpy, ``meta_dist.xp``, ``nn.layers`` and ``nn.grad_blocks`` only; the
example scripts and the tests import it. Every layer here reads its input through one strided
view of its windows, (N, C, kh, kw, OH, OW), made without a copy (``_windows``), and sends the
gradient back onto the image by one strided add per kernel offset (``_scatter_windows``).

Conv2d's initialisation is PyTorch's default, as ``nn.layers.Linear``'s:
https://pytorch.org/docs/stable/generated/torch.nn.Conv2d.html
"""

from __future__ import annotations

import math
import types

import numpy as np

from meta_dist.nn.grad_blocks import sum_rows, write_grad
from meta_dist.nn.layers import Layer, _positive, _uniform
from meta_dist.xp import array_module


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
            if out.flags.c_contiguous:  # 16 bits: added up in float32, rounded once
                sum_rows(per_sample, out.reshape(per_sample.shape[1:]))
            else:
                out[...] = sum_rows(per_sample).reshape(out.shape)

        write_grad(grad_w, weight_rows)
        if "bias" in self.grads:
            write_grad(self.grads["bias"],
                       lambda first, stop, out: sum_rows(d3[:, first:stop], out, (0, 2)))
        if not self.input_grad:
            return None
        dcols = xp.matmul(weight.reshape(self.out_channels, -1).T, d3)
        dwin = dcols.reshape(n, self.in_channels, *self.kernel_size, oh, ow)
        dx = _scatter_windows(dwin, self.padded_hw, self.stride)
        (ph, pw), (h, w) = self.padding, self.x_hw
        return dx[:, :, ph : ph + h, pw : pw + w]


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
