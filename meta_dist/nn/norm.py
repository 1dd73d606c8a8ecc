"""Normalisation layers: BatchNorm (per channel, over the batch) and LayerNorm (over the last axis).

Leaf module: imports numpy, ``meta_dist.xp``, ``nn.layers`` and ``nn.grad_blocks`` only;
``nn.transformer``, ``meta_dist.models``, the example scripts and the tests import it. Both keep
xhat and 1/std for backward. BatchNorm's running statistics are buffers (``Layer.buffer_names``):
state that is not trained, which the trainer broadcasts and checkpoints save.

Batch normalisation: Ioffe and Szegedy, arXiv 1502.03167. Layer normalisation: Ba, Kiros and
Hinton, arXiv 1607.06450.
"""

from __future__ import annotations

import types

import numpy as np

from meta_dist.nn.grad_blocks import in_float32, sum_rows, write_grad
from meta_dist.nn.layers import Layer, _check_last_axis, _positive
from meta_dist.xp import array_module


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
        wide = in_float32(x)  # float16 squares overflow
        if self.training:
            count = x.size // self.num_features
            if count < 2:
                raise ValueError(f"BatchNorm.forward: too few values per channel in training; "
                                 f"got {count}, expected >= 2")
            mean = wide.mean(axis=axes)
            var = wide.var(axis=axes)
            m = self.momentum
            self.running_mean *= 1.0 - m
            self.running_mean += m * mean
            self.running_var *= 1.0 - m
            self.running_var += (m * count / (count - 1)) * var
        else:
            mean, var = self.running_mean, self.running_var
        inv_std = 1.0 / xp.sqrt(var + self.eps)
        self.xhat = ((wide - mean.reshape(bshape)) * inv_std.reshape(bshape)).astype(x.dtype)
        self.inv_std = inv_std.astype(x.dtype)
        weight, bias = self.params["weight"], self.params["bias"]
        return self.xhat * weight.reshape(bshape) + bias.reshape(bshape)

    def backward(self, dout):
        """Write dweight and dbias in place; return dx (through the batch stats in training)."""
        axes, bshape = self._axes_and_shape(dout)
        grad_w, grad_b = self.grads["weight"], self.grads["bias"]
        sum_rows(dout * self.xhat, grad_w, axes)  # 16 bits: in float32, rounded once
        sum_rows(dout, grad_b, axes)
        scale = (self.params["weight"] * self.inv_std).reshape(bshape)
        if not self.used_batch_stats:
            return dout * scale
        # dx = w/std * (dout - mean(dout) - xhat * mean(dout * xhat)); the two means are the
        # grads just written, divided by the count, so no extra reductions are needed. In at
        # least float32: a count above 65504 is inf in float16 (the means were 0).
        count = dout.size // self.num_features
        mean_b, mean_w = ((in_float32(g) / count).astype(dout.dtype).reshape(bshape)
                          for g in (grad_b, grad_w))
        return scale * (dout - mean_b - self.xhat * mean_w)


class LayerNorm(Layer):
    """Layer normalisation over the last axis: ``weight * (x - mean) / sqrt(var + eps) + bias``.

    The variance is the biased one, as in ``torch.nn.LayerNorm``.
    """

    grad_rows = True

    def __init__(self, dim: int, eps: float = 1e-5, *, dtype=np.float32,
                 xp: types.ModuleType = np) -> None:
        """Create the layer with weight 1 and bias 0.

        Args:
            dim: size of the last axis.
            eps: added to the variance before the square root, > 0.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: dim is not an int.
            ValueError: dim or eps is not positive.
        """
        super().__init__()
        self.dim = _positive("LayerNorm", "dim", dim)
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps is not positive; got {eps}, expected > 0")
        self.eps = eps
        self._add_param("weight", np.ones(dim), dtype, xp)
        self._add_param("bias", np.zeros(dim), dtype, xp)
        self.xhat = None
        self.inv_std = None

    def forward(self, x):
        """Return the normalised ``x``; keeps xhat and 1/std for backward.

        Raises:
            ValueError: the last axis of x is not dim.
        """
        _check_last_axis("LayerNorm.forward", x, self.dim)
        xp = array_module(x)
        wide = in_float32(x)  # float16 squares overflow
        centered = wide - wide.mean(axis=-1, keepdims=True)
        var = (centered * centered).mean(axis=-1, keepdims=True)
        inv_std = 1.0 / xp.sqrt(var + self.eps)
        self.xhat = (centered * inv_std).astype(x.dtype)
        self.inv_std = inv_std.astype(x.dtype)
        return self.xhat * self.params["weight"] + self.params["bias"]

    def backward(self, dout):
        """Write dweight and dbias in place; return dx (None when ``input_grad`` is False)."""
        d2 = dout.reshape(-1, self.dim)
        xhat2 = self.xhat.reshape(-1, self.dim)
        write_grad(self.grads["weight"], lambda first, stop, out: sum_rows(
            d2[:, first:stop] * xhat2[:, first:stop], out))
        write_grad(self.grads["bias"],
                   lambda first, stop, out: sum_rows(d2[:, first:stop], out))
        if not self.input_grad:
            return None
        # dx = (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) / std, means over the last axis
        dxhat = dout * self.params["weight"]
        return self.inv_std * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                               - self.xhat * (dxhat * self.xhat).mean(axis=-1, keepdims=True))
