"""meta_dist.nn.init: initial values drawn now, or deferred and read a slice at a time."""

import numpy as np
import pytest

from meta_dist.nn.conv import Conv2d
from meta_dist.nn.embedding import Embedding
from meta_dist.nn.init import INIT_BLOCK, DeferredValues, deferred, draw
from meta_dist.nn.layers import Linear


@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_deferred_values_read_as_drawn_values(kind):
    """Any slice, in any order, equals the eager draw's; the caller's generator moves on
    exactly as far (the next draw agrees); reading upwards never restarts the stream."""
    shape = (3 * INIT_BLOCK // 100 + 7, 100)
    eager_rng, lazy_rng = np.random.default_rng(5), np.random.default_rng(5)
    eager = draw(eager_rng, kind, 0.5, shape, np.float32)
    with deferred():
        lazy = draw(lazy_rng, kind, 0.5, shape, np.float32)
    assert isinstance(lazy, DeferredValues) and lazy.shape == shape and lazy.size == eager.size
    assert eager_rng.random() == lazy_rng.random()
    flat = eager.reshape(-1)
    cuts = [0, 17, INIT_BLOCK - 1, INIT_BLOCK + 5, 2 * INIT_BLOCK, flat.size - 3, flat.size]
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):  # upwards, across block edges
        np.testing.assert_array_equal(lazy.read(lo, hi), flat[lo:hi])
    np.testing.assert_array_equal(lazy.read(10, 20), flat[10:20])  # downwards: restarts
    whole = np.empty(shape, np.float32)
    lazy.fill(whole)
    np.testing.assert_array_equal(whole, eager)


def test_layers_built_deferred_hold_recipes_of_their_eager_values():
    def build():
        rng = np.random.default_rng(11)
        return [Linear(300, 40, rng=rng), Conv2d(3, 4, 3, rng=rng), Embedding(50, 8, rng=rng)]

    eager = build()
    with deferred():
        lazy = build()
    for a, b in zip(eager, lazy, strict=True):
        for name, value in a.params.items():
            held = b.params[name]
            assert isinstance(held, DeferredValues) and held.dtype == value.dtype
            np.testing.assert_array_equal(held.read(0, held.size).reshape(held.shape), value)
    with pytest.raises(ValueError, match="unknown kind 'gauss'"):
        draw(np.random.default_rng(0), "gauss", 1.0, (2,))


def test_reading_upwards_never_restarts_the_stream():
    """Consecutive slices, even ones starting inside the block drawn last, continue the same
    generator; only a read below that block starts again (one draw per element upwards)."""
    with deferred():
        values = draw(np.random.default_rng(2), "normal", 1.0, (5 * INIT_BLOCK,))
    values.read(0, 100)
    stream = values._cursor[0]
    for lo in (100, 50, INIT_BLOCK - 10, INIT_BLOCK + 3, 3 * INIT_BLOCK):
        values.read(lo, lo + 1000)
        assert values._cursor[0] is stream, lo
    values.read(10, 20)  # below the block drawn last
    assert values._cursor[0] is not stream
