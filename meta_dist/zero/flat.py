"""FlatModel: a Sequential whose parameters are views into one flat buffer laid out by a plan.

Imports meta_dist.nn.model, meta_dist.zero.partition and meta_dist.xp. Optimizers and ZeRO
stages then work on slices of one 1-D array and never walk layers.
"""

from __future__ import annotations

from typing import Any

from meta_dist.nn.model import Sequential
from meta_dist.zero.partition import Bucket


class FlatModel:
    """Move a model's parameters into ``flat_params`` (padding zero) and point the layers at it.

    Args:
        model: the model; its current parameter values are copied in.
        buckets: the plan from ``plan_buckets`` over ``model.layer_numels()``.
        xp: the array module of the buffers (numpy or cupy).
        dtype: the buffer dtype (float32 or float64).
    """

    def __init__(self, model: Sequential, buckets: list[Bucket], xp: Any, dtype: Any) -> None:
        self.model = model
        self.buckets = buckets
        self.xp = xp
        self.dtype = xp.dtype(dtype)
        self.flat_params = xp.zeros(buckets[-1].stop, dtype)
        self.offsets: dict[tuple[int, str], int] = {}
        self.bucket_of_layer: dict[int, Bucket] = {}
        for bucket in buckets:
            offset = bucket.start
            for i in range(bucket.first_layer, bucket.last_layer + 1):
                self.bucket_of_layer[i] = bucket
                layer = model.layers[i]
                for name, value in layer.params.items():
                    view = self.flat_params[offset : offset + value.size].reshape(value.shape)
                    view[...] = value
                    layer.params[name] = view
                    self.offsets[(i, name)] = offset
                    offset += value.size

    @property
    def numel(self) -> int:
        """Parameter elements of the model (padding excluded)."""
        return sum(b.numel for b in self.buckets)

    def bind_grads(self, buffer: Any, bucket: Bucket, base: int) -> None:
        """Point the grads of the bucket's layers at ``buffer``, from element ``base`` on.

        The bucket's padding in ``buffer`` is zeroed (padding never has gradients).
        """
        for i in range(bucket.first_layer, bucket.last_layer + 1):
            layer = self.model.layers[i]
            for name, grad in layer.grads.items():
                begin = self.offsets[(i, name)] - bucket.start + base
                layer.grads[name] = buffer[begin : begin + grad.size].reshape(grad.shape)
        buffer[base + bucket.numel : base + bucket.padded_size] = 0
