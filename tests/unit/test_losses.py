"""Unit tests for meta_dist.nn.losses: formulas, finite differences and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from meta_dist.nn.losses import mse_loss, nll_loss, softmax_cross_entropy

STEP = 1e-5


def numeric_grad(f, arr: np.ndarray) -> np.ndarray:
    grad = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + STEP
        plus = float(f())
        arr[idx] = old - STEP
        minus = float(f())
        arr[idx] = old
        grad[idx] = (plus - minus) / (2 * STEP)
    return grad


@pytest.fixture
def batch():
    rng = np.random.default_rng(0)
    return rng.standard_normal((5, 4)), np.array([0, 3, 1, 1, 2])


def test_softmax_cross_entropy_formula_and_grad(batch):
    logits, labels = batch
    loss, dlogits = softmax_cross_entropy(logits, labels)
    assert isinstance(loss, np.ndarray) and loss.ndim == 0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loss, -np.log(probs[np.arange(5), labels]).mean(), rtol=1e-12)
    onehot = np.eye(4)[labels]
    np.testing.assert_allclose(dlogits, (probs - onehot) / 5, rtol=1e-12, atol=1e-15)
    numeric = numeric_grad(lambda: softmax_cross_entropy(logits, labels)[0], logits)
    np.testing.assert_allclose(dlogits, numeric, rtol=1e-6, atol=1e-9)


def test_softmax_cross_entropy_is_stable():
    logits = np.array([[1000.0, 0.0, -1000.0], [5000.0, 5000.0, 5000.0]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        loss, dlogits = softmax_cross_entropy(logits, np.array([0, 1]))
    np.testing.assert_allclose(loss, np.log(3.0) / 2, rtol=1e-12)
    assert np.isfinite(dlogits).all()


def test_softmax_cross_entropy_keeps_float32(batch):
    logits, labels = batch
    loss, dlogits = softmax_cross_entropy(logits.astype(np.float32), labels)
    assert dlogits.dtype == np.float32 and loss.dtype == np.float32


def test_nll_loss_formula_and_grad(batch):
    logits, labels = batch
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    loss, dlog = nll_loss(log_probs, labels)
    assert isinstance(loss, np.ndarray) and loss.ndim == 0
    np.testing.assert_allclose(loss, -log_probs[np.arange(5), labels].mean(), rtol=1e-12)
    numeric = numeric_grad(lambda: nll_loss(log_probs, labels)[0], log_probs)
    np.testing.assert_allclose(dlog, numeric, rtol=1e-6, atol=1e-9)
    ce_loss, _ = softmax_cross_entropy(logits, labels)
    np.testing.assert_allclose(loss, ce_loss, rtol=1e-12)


def test_mse_loss_formula_and_grad():
    rng = np.random.default_rng(1)
    pred, target = rng.standard_normal((3, 2, 2)), rng.standard_normal((3, 2, 2))
    loss, dpred = mse_loss(pred, target)
    assert isinstance(loss, np.ndarray) and loss.ndim == 0
    np.testing.assert_allclose(loss, ((pred - target) ** 2).mean(), rtol=1e-12)
    numeric = numeric_grad(lambda: mse_loss(pred, target)[0], pred)
    np.testing.assert_allclose(dpred, numeric, rtol=1e-6, atol=1e-9)
    assert dpred.shape == pred.shape


@pytest.mark.parametrize("fn", [softmax_cross_entropy, nll_loss])
def test_label_errors(fn, batch):
    scores, labels = batch
    with pytest.raises(ValueError, match=r"labels have the wrong shape; got \(5, 1\)"):
        fn(scores, labels.reshape(5, 1))
    with pytest.raises(ValueError, match=r"labels have the wrong shape; got \(4,\)"):
        fn(scores, labels[:4])
    with pytest.raises(ValueError, match="input must be 2-D"):
        fn(scores.ravel(), labels)
    with pytest.raises(ValueError, match=r"label out of range; got labels in \[0, 4\]"):
        fn(scores, np.array([0, 4, 1, 1, 2]))
    with pytest.raises(ValueError, match="label out of range"):
        fn(scores, np.array([0, -1, 1, 1, 2]))
    with pytest.raises(TypeError, match="labels must be integer class indices"):
        fn(scores, labels.astype(np.float64))


def test_mse_shape_mismatch():
    with pytest.raises(ValueError, match=r"mse_loss: pred and target shapes differ; got \(2, 3\)"):
        mse_loss(np.ones((2, 3)), np.ones((3, 2)))


def test_float16_logits_give_a_float32_gradient_for_the_loss_scale():
    """(softmax - onehot) / N in float16 underflowed before fp16's loss scale was applied: at
    2048 tokens over 2048 classes about half the entries were 0 (PyTorch's autocast takes the
    loss in float32). Taken in float32, scaled, then rounded once, none is lost."""
    rng = np.random.default_rng(0)
    n = v = 2048
    logits = rng.standard_normal((n, v)).astype(np.float16)
    labels = rng.integers(0, v, n)
    loss, dlogits = softmax_cross_entropy(logits, labels)
    assert dlogits.dtype == np.float32 and np.isfinite(loss)
    wide = logits.astype(np.float64)
    exact = np.exp(wide - wide.max(axis=1, keepdims=True))
    exact /= exact.sum(axis=1, keepdims=True)
    exact[np.arange(n), labels] -= 1
    exact *= 2.0**16 / n
    scaled = (dlogits * np.float32(2.0**16)).astype(np.float16)
    assert not ((scaled == 0) & (exact != 0)).any()
    np.testing.assert_allclose(scaled, exact, rtol=2e-3, atol=1e-3)


def _sixteen_bit(name):
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_nll_and_mse_are_taken_in_float32(name):
    """As softmax_cross_entropy: -1/N was held in 16 bits (float16: subnormal from N = 2**14,
    0 from about 2**25; bfloat16 keeps 8 bits of it), and mse squared in 16 bits (float16: inf
    past 256). Both come back in float32, for the loss scale to multiply before rounding."""
    dtype = _sixteen_bit(name)
    n = 3 * 2**14 + 5
    log_probs = np.full((n, 2), -0.5, dtype)
    loss, dlog_probs = nll_loss(log_probs, np.zeros(n, np.int64))
    assert dlog_probs.dtype == np.float32 and loss == 0.5
    np.testing.assert_array_equal(dlog_probs[:, 0], np.float32(-1.0 / n))
    pred = np.array([300.0, -300.0, 1.5, 0.0]).astype(dtype)
    loss, dpred = mse_loss(pred, np.zeros(4, dtype))
    assert dpred.dtype == np.float32
    np.testing.assert_allclose(float(loss), (2 * 300.0**2 + 1.5**2) / 4, rtol=1e-6)
    np.testing.assert_allclose(dpred, [150.0, -150.0, 0.75, 0.0], rtol=1e-6)
