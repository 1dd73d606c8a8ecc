"""Mixed precision's loss scale, learning-rate schedules, and the optimizer's gradient factor."""

import math

import numpy as np
import pytest

from meta_dist.config import check_world, load_config
from meta_dist.optim import make_optimizer
from meta_dist.train.scaler import LossScaler, ScaleFloorError
from meta_dist.train.schedule import learning_rate


def test_dynamic_scale_halves_on_overflow_and_grows_after_a_run_of_good_steps():
    s = LossScaler(1024.0, growth_interval=3, min_scale=1.0)
    s.update(False)
    assert s.scale == 512.0 and s.skipped == 1
    for _ in range(2):
        s.update(True)
    assert s.scale == 512.0  # two good steps: not yet
    s.update(True)
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(True)
    s.update(False)  # an overflow restarts the count
    s.update(True)
    s.update(True)
    assert s.scale == 512.0


def test_the_floor_holds_and_a_model_stuck_there_stops():
    s = LossScaler(4.0, min_scale=1.0, max_skipped_steps=3)
    for expected in (2.0, 1.0, 1.0, 1.0):  # 4 -> 2 -> 1, then at the floor
        s.update(False)
        assert s.scale == expected
    assert s.stuck == 2  # two skips in a row at the floor
    s.update(True)
    assert s.stuck == 0
    for _ in range(2):
        s.update(False)
    with pytest.raises(ScaleFloorError, match="3 steps in a row overflowed with the loss scale at "
                                              "its floor of 1.*max_skipped_steps"):
        s.update(False)


def test_a_fixed_scale_never_moves_but_still_stops():
    s = LossScaler(128.0, dynamic=False, growth_interval=1, max_skipped_steps=2)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0
    with pytest.raises(ScaleFloorError, match="fixed at 128"):
        s.update(False)


def test_scaler_state_round_trips():
    s = LossScaler(64.0)
    s.update(False)
    s.update(True)
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 32.0, "good_steps": 1, "stuck": 0,
                                                "skipped": 1}


def test_cosine_with_warmup_against_its_closed_form():
    total, warmup, base = 20, 5, 0.3
    got = [learning_rate("cosine", base, t, total, warmup) for t in range(total)]
    for t in range(warmup):
        assert got[t] == pytest.approx(base * (t + 1) / (warmup + 1))
    for t in range(warmup, total):
        assert got[t] == pytest.approx(
            base * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup))))
    assert got[warmup] == pytest.approx(base) and 0 < got[-1] < 0.02 * base
    assert all(a >= b for a, b in zip(got[warmup:], got[warmup + 1:], strict=False))
    assert [learning_rate("constant", base, t, total, 2) for t in range(4)] == pytest.approx(
        [0.1, 0.2, 0.3, 0.3])
    with pytest.raises(ValueError, match="unknown schedule"):
        learning_rate("linear", base, 0, total, 0)


@pytest.mark.parametrize("grad_dtype", ["float32", "float16"])
def test_optimizer_gradient_factor_and_narrow_gradients(grad_dtype):
    """step(grad_scale=f) with float16 gradients equals step on float32 gradients * f."""
    rng = np.random.default_rng(0)
    p = rng.standard_normal(50000).astype(np.float32)
    g = rng.standard_normal(50000).astype(grad_dtype)
    a = make_optimizer("adam", p.size, lr=0.01)
    b = make_optimizer("adam", p.size, lr=0.01)
    pa, pb = p.copy(), p.copy()
    a.step(pa, g, grad_scale=0.125)
    b.step(pb, g.astype(np.float32) * np.float32(0.125))
    np.testing.assert_array_equal(pa, pb)
    with pytest.raises(TypeError, match="params piece 0 has the wrong dtype"):
        a.step(pa.astype(np.float16), g.astype(np.float32))


@pytest.mark.parametrize("given, words", [
    ({"precision": "fp16", "dtype": "float64"}, "precision fp16 needs a float32 model"),
    ({"precision": "bf16", "loss_scale": 128.0}, "loss_scale is for fp16 only"),
    ({"clip_grad_norm": 0}, "clip_grad_norm is out of range; got 0, expected null or > 0"),
    ({"clip_grad_norm": -1.5}, "clip_grad_norm is out of range"),
    ({"loss_scale": "static"}, "loss_scale is out of range; got 'static', expected 'dynamic'"),
    ({"grad_accum_steps": 0}, "grad_accum_steps is out of range; got 0, expected >= 1"),
    ({"warmup_steps": -1}, "warmup_steps is out of range"),
    ({"lr_schedule": "linear"}, "lr_schedule is not a valid choice; got 'linear'"),
    ({"precision": "fp8"}, "precision is not a valid choice; got 'fp8'"),
])
def test_bad_training_features_are_refused_before_any_work(given, words):
    with pytest.raises(ValueError, match=words):
        load_config(given)


def test_a_batch_that_does_not_split_into_micro_batches():
    config = load_config({"batch_size": 64, "grad_accum_steps": 3})
    with pytest.raises(ValueError, match="batch_size does not split across 2 ranks x 3 "
                                         "micro-batches .* expected a multiple of 6; use "
                                         "batch_size=60 or 66, or a rank count whose "
                                         "product with grad_accum_steps=3 divides 64$"):
        check_world(config, 2)
    check_world(load_config({"batch_size": 60, "grad_accum_steps": 3}), 2)
