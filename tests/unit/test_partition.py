"""The partition plan and the flat buffers: pure maths, no MPI."""

import numpy as np
import pytest

from meta_dist.nn.layers import Linear, ReLU
from meta_dist.nn.model import Sequential
from meta_dist.zero import FlatModel, padded_size, plan_buckets


@pytest.mark.parametrize("numel, world, expected", [(0, 4, 0), (1, 4, 4), (43, 2, 44),
                                                     (43, 3, 45), (44, 4, 44), (7, 1, 7)])
def test_padded_size(numel, world, expected):
    assert padded_size(numel, world) == expected


def test_padded_size_rejects_nonsense():
    with pytest.raises(ValueError, match="world=0"):
        padded_size(3, 0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 10, 50, 10**6])
def test_buckets_tile_the_buffer_and_shards_tile_each_bucket(world, bucket):
    numels = [25, 0, 18, 7, 0, 1]
    buckets = plan_buckets(numels, bucket, world)
    assert buckets[0].start == 0 and buckets[0].first_layer == 0
    assert buckets[-1].last_layer == len(numels) - 1
    assert sum(b.numel for b in buckets) == sum(numels)
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.stop == b.start and a.last_layer + 1 == b.first_layer
    for b in buckets:
        assert b.padded_size % world == 0 and b.padded_size >= b.numel
        shards = [b.shard(r) for r in range(world)]
        assert shards[0].start == b.start and shards[-1].stop == b.stop
        assert all(s.stop - s.start == b.shard_size for s in shards)
        assert all(x.stop == y.start for x, y in zip(shards, shards[1:], strict=False))


def test_buckets_fill_from_the_last_layer():
    buckets = plan_buckets([10, 10, 10, 10], 20, 1)
    assert [(b.first_layer, b.last_layer) for b in buckets] == [(0, 1), (2, 3)]
    big = plan_buckets([5, 100, 5], 20, 1)  # a bucket closes once it holds >= 20 elements
    assert [(b.first_layer, b.last_layer) for b in big] == [(0, 0), (1, 2)]


def test_flat_model_views_and_padding():
    rng = np.random.default_rng(0)
    model = Sequential(Linear(4, 5, rng=rng, dtype=np.float64), ReLU(),
                       Linear(5, 3, rng=rng, dtype=np.float64))
    before = {k: v.copy() for k, v in model.state().items()}
    buckets = plan_buckets(model.layer_numels(), 20, 4)
    flat = FlatModel(model, buckets, np, np.float64)
    assert flat.numel == 43 and flat.flat_params.dtype == np.float64
    for name, value in model.state().items():
        np.testing.assert_array_equal(value, before[name])
        assert np.shares_memory(value, flat.flat_params)
    flat.flat_params[:] += 1.0  # the layers see changes to the flat buffer
    np.testing.assert_array_equal(model.layers[0].params["weight"], before[next(iter(before))] + 1)
    grads = np.full(flat.flat_params.size, 7.0)
    for b in buckets:
        flat.bind_grads(grads, b, b.start)
        assert np.all(grads[b.start + b.numel:b.stop] == 0)  # padding zeroed
    assert np.shares_memory(model.layers[2].grads["bias"], grads)
