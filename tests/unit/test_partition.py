"""The partition plan and the flat buffers: pure maths, no MPI."""

import math
import random

import numpy as np
import pytest

from meta_dist.nn.conv import Conv2d
from meta_dist.nn.layers import Linear, ReLU, Tanh
from meta_dist.nn.model import Sequential
from meta_dist.nn.norm import BatchNorm
from meta_dist.zero import FlatModel, bucket_numel, padded_size, plan


@pytest.mark.parametrize("numel, world, expected", [(0, 4, 0), (1, 4, 4), (43, 2, 44),
                                                     (43, 3, 45), (44, 4, 44), (7, 1, 7)])
def test_padded_size(numel, world, expected):
    assert padded_size(numel, world) == expected


def test_padded_size_rejects_nonsense():
    with pytest.raises(ValueError, match="world=0"):
        padded_size(3, 0)


def test_bucket_numel_is_capped_and_gives_several_buckets():
    assert bucket_numel(1000, 10**6) == 250  # at least four buckets
    assert bucket_numel(1000, 100) == 100  # never more than the cap
    assert bucket_numel(3, 100) == 1


def check_plan(layers, size, world, splittable):
    """Return (slots, buckets) after checking every invariant the stages rely on."""
    slots, buckets = plan(layers, size, world, frozenset(splittable))
    assert buckets[0].start == 0
    for a, b in zip(buckets, buckets[1:], strict=False):
        assert a.stop == b.start
    spans = sorted((s.offset, s.offset + s.numel) for s in slots)
    for (_, end), (begin, _) in zip(spans, spans[1:], strict=False):
        assert end <= begin  # parameters never overlap
    assert spans[-1][1] <= buckets[-1].stop
    by_layer = {}
    for s in slots:
        by_layer.setdefault(s.layer, []).append(s)
    for i, params in enumerate(layers):  # each layer's parameters in reverse order
        assert [s.name for s in by_layer.get(i, [])] == [name for name, _ in params][::-1]
    for b in buckets:
        assert b.padded_size % world == 0
        shards = [b.shard(r) for r in range(world)]
        assert shards[0].start == b.start and shards[-1].stop == b.stop
        assert all(x.stop == y.start for x, y in zip(shards, shards[1:], strict=False))
    for s in slots:
        inside = [b for b in buckets if b.start < s.offset + s.numel and s.offset < b.stop]
        if len(inside) > 1:
            assert s.layer in splittable
        for b in inside[1:]:
            assert (b.start - s.offset) % s.row == 0, "a cut between rows"
    return slots, buckets


def test_random_plans_keep_every_invariant_and_the_size():
    for trial in range(1500):
        rnd = random.Random(trial)
        layers = []
        for _ in range(rnd.randint(1, 6)):
            a, c = rnd.randint(1, 40), rnd.randint(1, 40)
            layers.append(rnd.choice([[], [("weight", (a, c)), ("bias", (c,))], [("w", (a,))]]))
        if not any(layers):
            continue
        size, world = rnd.randint(1, 200), rnd.randint(1, 8)
        splittable = {i for i in range(len(layers)) if rnd.random() < 0.7}
        slots, buckets = check_plan(layers, size, world, splittable)
        for b in buckets:  # larger than size only for what cannot be cut any finer
            if b.padded_size > padded_size(size, world):
                held = [s for s in slots if s.offset < b.stop and b.start < s.offset + s.numel]
                whole_layer = len({s.layer for s in held}) == 1
                rows = max(world // math.gcd(s.row, world) * s.row for s in held)
                assert whole_layer or rows + world > size, (trial, b)


def test_a_large_splittable_layer_is_cut_between_rows():
    layers = [[("weight", (784, 3000)), ("bias", (3000,))], [],
              [("weight", (3000, 10)), ("bias", (10,))]]
    size = 3000 * 300
    slots, buckets = check_plan(layers, size, 4, {0, 2})
    assert len(buckets) == 3 and all(b.padded_size <= size for b in buckets)
    bias, weight = slots[:2]
    assert bias.offset == 0 and weight.offset == 3000  # the bias, then 299 rows fill bucket 0
    assert [b.start for b in buckets[1:]] == [weight.offset + 299 * 3000,
                                             weight.offset + 599 * 3000]


def test_a_layer_that_cannot_be_cut_gets_a_bucket_of_its_own():
    layers = [[("w", (5,))], [("weight", (10, 10)), ("bias", (10,))], [("w", (3,))]]
    slots, buckets = check_plan(layers, 20, 2, set())
    assert [(b.start, b.padded_size) for b in buckets] == [(0, 6), (6, 110), (116, 4)]


def test_padding_goes_below_a_cut_parameter_not_inside_it():
    """World 4, rows of 3: cuts keep buckets multiples of 4 by cutting every 4 rows (12
    elements), and the 3 elements of padding that bucket 0 needs lie between the bias and the
    weight, so the weight stays one contiguous view."""
    layers = [[("weight", (20, 3)), ("bias", (5,))]]
    slots, buckets = check_plan(layers, 30, 4, {0})
    assert [(s.name, s.offset) for s in slots] == [("bias", 0), ("weight", 8)]
    assert [(b.start, b.padded_size) for b in buckets] == [(0, 20), (20, 24), (44, 24)]


def test_a_layer_object_used_twice_is_refused():
    """Sequential(l, ReLU(), l) used to build two slots for l and train them apart (its
    gradients wrong against finite differences by 0.03-0.04); a layer keeps one forward's
    inputs, so it is refused, naming both places and how to tie instead."""
    rng = np.random.default_rng(0)
    twice = Linear(4, 4, rng=rng, dtype=np.float64)
    with pytest.raises(ValueError, match=r"one Linear object twice: layers 0 and 2.*tie"):
        FlatModel(Sequential(twice, ReLU(), twice), 13, 2, np, np.float64)
    relu = ReLU()
    with pytest.raises(ValueError, match=r"one ReLU object twice: layers 1 and 3"):
        FlatModel(Sequential(twice, relu, Linear(4, 4, rng=rng, dtype=np.float64), relu),
                  13, 2, np, np.float64)


def tied_model(seed=0):
    """Linear(3,4) Tanh A=Linear(4,4, no bias) Tanh B (A's weight) Tanh Linear(4,2)."""
    rng = np.random.default_rng(seed)
    first = Linear(4, 4, bias=False, rng=rng, dtype=np.float64)
    second = Linear(4, 4, bias=False, rng=rng, dtype=np.float64)
    second.params["weight"] = first.params["weight"]
    return Sequential(Linear(3, 4, rng=rng, dtype=np.float64), Tanh(), first, Tanh(), second,
                      Tanh(), Linear(4, 2, rng=rng, dtype=np.float64))


@pytest.mark.parametrize("bucket_numel", [1000, 6])  # one bucket; the tied weight in blocks
def test_a_tied_parameter_is_one_slot_whose_gradient_sums_both_uses(bucket_numel):
    """The shared weight is one parameter (one slot, one view both layers read), and its
    gradient, written by the owner after the later use, equals finite differences of the loss:
    the sum of both uses' gradients."""
    model = tied_model()
    flat = FlatModel(model, bucket_numel, 1, np, np.float64)
    assert [(s.layer, s.name) for s in flat.slots if s.layer in (2, 4)] == [(2, "weight")]
    assert model.layers[4].params["weight"] is model.layers[2].params["weight"]
    grads = np.zeros(flat.buckets[-1].stop)
    written = []
    for layer, buckets in flat.layer_buckets.items():
        if len(buckets) > 1:
            flat.bind_blocks(layer, lambda b, s, first, stop: flat.view(grads, s)[first:stop],
                             written.append)
        else:
            flat.bind_grads(layer, grads)
    x = np.random.default_rng(1).standard_normal((5, 3))

    def loss():
        return 0.5 * float(np.sum(model.forward(x) ** 2))

    out = model.forward(x)
    model.backward(out)
    slot = next(s for s in flat.slots if s.layer == 2)
    weight, got = flat.view(flat.flat_params, slot), flat.view(grads, slot)
    want = np.zeros_like(weight)
    for index in np.ndindex(*weight.shape):
        keep = weight[index]
        weight[index] = keep + 1e-6
        up = loss()
        weight[index] = keep - 1e-6
        want[index] = (up - loss()) / 2e-6
        weight[index] = keep
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)
    assert np.abs(model.layers[4].grads["weight"]).max() > 0  # the later use's own part


def test_a_tie_to_a_layer_that_writes_its_gradient_whole_is_refused():
    rng = np.random.default_rng(0)
    norm = BatchNorm(4, dtype=np.float64)
    other = BatchNorm(4, dtype=np.float64)
    other.params["weight"] = norm.params["weight"]
    with pytest.raises(ValueError, match=r"layers 0 \(weight\) and 2 \(weight\) share one "
                                         r"parameter array, and BatchNorm .* by rows"):
        FlatModel(Sequential(norm, ReLU(), other, Linear(4, 2, rng=rng, dtype=np.float64)),
                  13, 2, np, np.float64)


def test_flat_model_views_and_padding():
    rng = np.random.default_rng(0)
    model = Sequential(Linear(4, 5, rng=rng, dtype=np.float64), ReLU(),
                       Linear(5, 3, rng=rng, dtype=np.float64))
    before = {k: v.copy() for k, v in model.state().items()}
    flat = FlatModel(model, 13, 4, np, np.float64)
    assert flat.numel == 43 and flat.flat_params.dtype == np.float64
    for name, value in model.state().items():
        np.testing.assert_array_equal(value, before[name])
        assert np.shares_memory(value, flat.flat_params)
    flat.flat_params[:] += 1.0  # the layers see changes to the flat buffer
    np.testing.assert_array_equal(model.layers[0].params["weight"], before[next(iter(before))] + 1)
    # 13 per bucket, but a cut in a 5-wide weight must keep shards equal: 4 rows (20) at least
    assert all(b.padded_size <= 20 for b in flat.buckets) and len(flat.buckets) >= 3
    grads = np.zeros(flat.flat_params.size)
    flat.bind_grads(2, grads)
    assert np.shares_memory(model.layers[2].grads["bias"], grads)
    assert len(flat.layer_buckets[0]) > 1 and len(flat.layer_buckets[2]) > 1


@pytest.mark.parametrize("layer", [
    lambda rng: Linear(6, 5, rng=rng, dtype=np.float64),
    lambda rng: Conv2d(2, 6, 3, padding=1, rng=rng, dtype=np.float64)])
def test_grad_blocks_give_the_same_gradient_top_rows_first(layer):
    """A layer across buckets writes its gradients block by block, at ever lower offsets, and
    the blocks hold exactly the gradient a plain backward writes."""
    rng = np.random.default_rng(1)
    plain, blocked = layer(np.random.default_rng(2)), layer(np.random.default_rng(2))
    x = rng.standard_normal((3, 6) if isinstance(plain, Linear) else (3, 2, 4, 4))
    dout = rng.standard_normal(plain.forward(x).shape)
    blocked.forward(x)
    plain.backward(dout)
    model = Sequential(blocked)
    flat = FlatModel(model, 8, 2, np, np.float64)
    staging, order = np.full(flat.flat_params.size, np.nan), []
    flat.bind_blocks(0, lambda b, s, first, stop: flat.view(staging, s)[first:stop],
                     order.append)
    blocked.backward(dout)
    assert order == sorted(order, reverse=True) and len(order) > 2
    for name, want in plain.grads.items():
        slot = next(s for s in flat.slots if s.name == name)
        np.testing.assert_allclose(flat.view(staging, slot), want, rtol=1e-12, atol=1e-12)
