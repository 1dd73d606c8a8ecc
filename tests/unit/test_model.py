"""Sequential: order of the backward hooks, and the first layer's skipped input gradient."""

import numpy as np

from meta_dist.nn.conv import Conv2d
from meta_dist.nn.layers import Flatten, Linear, ReLU
from meta_dist.nn.model import Sequential


def build(rng):
    return Sequential(Conv2d(2, 3, 3, padding=1, rng=rng, dtype=np.float64), ReLU(), Flatten(),
                      Linear(3 * 4 * 4, 5, rng=rng, dtype=np.float64))


def test_hooks_run_around_each_layer_in_reverse():
    model = build(np.random.default_rng(0))
    calls = []
    model.before_backward = lambda i: calls.append(("before", i))
    model.after_backward = lambda i: calls.append(("after", i))
    model.backward(np.ones((2, 5)) if model.forward(np.ones((2, 2, 4, 4))) is not None else None)
    assert calls == [(w, i) for i in (3, 2, 1, 0) for w in ("before", "after")]


def test_first_layer_skips_input_gradient_with_the_same_weight_grads():
    x = np.random.default_rng(1).standard_normal((2, 2, 4, 4))
    dout = np.random.default_rng(2).standard_normal((2, 5))
    model = build(np.random.default_rng(0))
    assert [layer.input_grad for layer in model.layers] == [False, True, True, True]
    model.forward(x)
    assert model.backward(dout) is None
    skipped = {k: v.copy() for k, v in model.layers[0].grads.items()}
    model.layers[0].input_grad = True
    model.forward(x)
    assert model.backward(dout).shape == x.shape
    for name, grad in model.layers[0].grads.items():
        np.testing.assert_array_equal(grad, skipped[name])
