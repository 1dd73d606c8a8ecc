"""Unit tests for nn.layers, nn.conv and nn.norm: float64 finite differences, numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meta_dist.nn.conv import AvgPool2d, Conv2d, MaxPool2d
from meta_dist.nn.layers import GELU, Flatten, Layer, Linear, LogSoftmax, ReLU, Sigmoid, Tanh
from meta_dist.nn.norm import BatchNorm

F64 = np.float64
STEP = 1e-5


def make(name: str, seed: int = 0) -> tuple[Layer, tuple[int, ...]]:
    """Return a float64 layer and an input shape for it."""
    rng = np.random.default_rng(seed)
    return {
        "linear": lambda: (Linear(4, 3, rng=rng, dtype=F64), (5, 4)),
        "linear_nobias": lambda: (Linear(4, 3, bias=False, rng=rng, dtype=F64), (5, 4)),
        "linear_3d": lambda: (Linear(4, 3, rng=rng, dtype=F64), (2, 3, 4)),
        "conv": lambda: (Conv2d(2, 3, 3, rng=rng, dtype=F64), (2, 2, 5, 5)),
        "conv_stride_pad": lambda: (
            Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), rng=rng, dtype=F64),
            (2, 2, 6, 5),
        ),
        "conv_nobias": lambda: (Conv2d(2, 2, 2, bias=False, rng=rng, dtype=F64), (1, 2, 4, 4)),
        "bn_2d": lambda: (BatchNorm(3, rng=rng, dtype=F64), (6, 3)),
        "bn_4d": lambda: (BatchNorm(2, rng=rng, dtype=F64), (3, 2, 3, 2)),
        "relu": lambda: (ReLU(), (4, 5)),
        "sigmoid": lambda: (Sigmoid(), (4, 5)),
        "tanh": lambda: (Tanh(), (4, 5)),
        "gelu": lambda: (GELU(), (4, 5)),
        "avgpool": lambda: (AvgPool2d(2), (2, 2, 4, 5)),
        "avgpool_overlap": lambda: (AvgPool2d(3, stride=1), (2, 2, 5, 4)),
        "maxpool": lambda: (MaxPool2d(2), (2, 2, 4, 5)),
        "maxpool_overlap": lambda: (MaxPool2d(3, stride=2), (2, 2, 7, 6)),
        "flatten": lambda: (Flatten(), (2, 3, 2, 2)),
        "logsoftmax": lambda: (LogSoftmax(), (4, 6)),
        "logsoftmax_4d": lambda: (LogSoftmax(), (2, 3, 2, 2)),
    }[name]()


ALL = [
    "linear", "linear_nobias", "linear_3d", "conv", "conv_stride_pad", "conv_nobias", "bn_2d",
    "bn_4d", "relu", "sigmoid", "tanh", "gelu", "avgpool", "avgpool_overlap", "maxpool",
    "maxpool_overlap", "flatten", "logsoftmax", "logsoftmax_4d",
]
WITH_PARAMS = [n for n in ALL if n.startswith(("linear", "conv", "bn"))]


def loss_of(layer: Layer, x: np.ndarray, r: np.ndarray) -> float:
    return float((layer.forward(x) * r).sum())


def numeric_grad(f, arr: np.ndarray) -> np.ndarray:
    """Central differences of the scalar f() w.r.t. arr, perturbed in place."""
    grad = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + STEP
        plus = f()
        arr[idx] = old - STEP
        minus = f()
        arr[idx] = old
        grad[idx] = (plus - minus) / (2 * STEP)
    return grad


def assert_close(analytic: np.ndarray, numeric: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(numeric).max()))
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7 * scale)


@pytest.mark.parametrize("name", ALL)
def test_gradients_match_finite_differences(name):
    layer, shape = make(name)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    if name == "relu":
        x[np.abs(x) < 1e-2] = 0.5  # keep the kink farther away than the FD step
    r = rng.standard_normal(layer.forward(x).shape)
    dx = layer.backward(r)
    grads = {k: g.copy() for k, g in layer.grads.items()}
    assert dx.shape == x.shape
    assert_close(dx, numeric_grad(lambda: loss_of(layer, x, r), x))
    for key, param in layer.params.items():
        assert grads[key].shape == param.shape
        assert_close(grads[key], numeric_grad(lambda: loss_of(layer, x, r), param))


@pytest.mark.parametrize("name", ["bn_2d", "bn_4d"])
def test_batchnorm_eval_gradients_match_finite_differences(name):
    layer, shape = make(name)
    rng = np.random.default_rng(2)
    layer.forward(rng.standard_normal(shape) * 2 + 1)  # move the running stats off 0 and 1
    layer.training = False
    x = rng.standard_normal(shape)
    r = rng.standard_normal(shape)
    layer.forward(x)
    dx = layer.backward(r)
    grads = {k: g.copy() for k, g in layer.grads.items()}
    assert_close(dx, numeric_grad(lambda: loss_of(layer, x, r), x))
    for key, param in layer.params.items():
        assert_close(grads[key], numeric_grad(lambda: loss_of(layer, x, r), param))


@pytest.mark.parametrize("name", WITH_PARAMS)
def test_backward_overwrites_grads(name):
    layer, shape = make(name)
    x = np.random.default_rng(3).standard_normal(shape)
    r = np.ones_like(layer.forward(x))
    layer.backward(r)
    first = {k: g.copy() for k, g in layer.grads.items()}
    layer.forward(x)
    layer.backward(r)
    for key, grad in layer.grads.items():
        np.testing.assert_array_equal(grad, first[key])


@pytest.mark.parametrize("name", WITH_PARAMS)
def test_grads_land_in_rebound_views(name):
    layer, shape = make(name)
    reference, _ = make(name)
    x = np.random.default_rng(4).standard_normal(shape)
    r = np.random.default_rng(5).standard_normal(reference.forward(x).shape)
    reference.backward(r)
    total = sum(g.size for g in layer.grads.values())
    flat_grads = np.zeros(total + 6)  # 3 guard elements on each side
    offset = 3
    for key, grad in layer.grads.items():
        view = flat_grads[offset : offset + grad.size].reshape(grad.shape)
        layer.grads[key] = view
        offset += grad.size
    views = dict(layer.grads)
    layer.forward(x)
    layer.backward(r)
    offset = 3
    for key, view in views.items():
        assert layer.grads[key] is view
        np.testing.assert_allclose(flat_grads[offset : offset + view.size],
                                   reference.grads[key].ravel(), rtol=1e-12, atol=1e-12)
        offset += view.size
    np.testing.assert_array_equal(flat_grads[:3], 0)
    np.testing.assert_array_equal(flat_grads[offset:], 0)


@pytest.mark.parametrize("name", WITH_PARAMS)
def test_forward_reads_rebound_params(name):
    layer, shape = make(name)
    x = np.random.default_rng(6).standard_normal(shape)
    before = layer.forward(x)
    flat_params = np.concatenate([p.ravel() for p in layer.params.values()])
    offset = 0
    for key, param in layer.params.items():
        layer.params[key] = flat_params[offset : offset + param.size].reshape(param.shape)
        offset += param.size
    np.testing.assert_array_equal(layer.forward(x), before)
    flat_params *= 2.0  # an optimizer updating the flat buffer must reach the layer
    assert not np.allclose(layer.forward(x), before)


def test_float32_grads_stay_float32_in_place():
    layer = Linear(4, 3, rng=np.random.default_rng(0))
    assert layer.params["weight"].dtype == np.float32
    grad = layer.grads["weight"]
    x = np.ones((2, 4), np.float32)
    layer.backward(np.ones_like(layer.forward(x)))
    assert layer.grads["weight"] is grad and grad.dtype == np.float32
    np.testing.assert_array_equal(grad, np.full((4, 3), 2.0, np.float32))


def test_linear_forward_and_init():
    rng = np.random.default_rng(0)
    layer = Linear(6, 4, rng=rng, dtype=F64)
    w, b = layer.params["weight"], layer.params["bias"]
    assert w.shape == (6, 4) and b.shape == (4,)
    assert np.abs(w).max() <= 1 / math.sqrt(6) and np.abs(b).max() <= 1 / math.sqrt(6)
    again = Linear(6, 4, rng=np.random.default_rng(0), dtype=F64)
    np.testing.assert_array_equal(again.params["weight"], w)
    for key in layer.params:
        assert layer.grads[key].shape == layer.params[key].shape
        assert not layer.grads[key].any()
    x = rng.standard_normal((3, 6))
    np.testing.assert_allclose(layer.forward(x), x @ w + b, rtol=1e-12)


def pair(v):
    return (v, v) if isinstance(v, int) else v


def naive_conv(x, w, b, stride, padding):
    (sh, sw), (ph, pw) = stride, padding
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    n, _, h, wd = xp.shape
    o, _, kh, kw = w.shape
    oh, ow = (h - kh) // sh + 1, (wd - kw) // sw + 1
    out = np.zeros((n, o, oh, ow))
    for i in range(n):
        for k in range(o):
            for r in range(oh):
                for c in range(ow):
                    patch = xp[i, :, r * sh : r * sh + kh, c * sw : c * sw + kw]
                    out[i, k, r, c] = (patch * w[k]).sum() + (b[k] if b is not None else 0.0)
    return out


@pytest.mark.parametrize(
    ("kernel", "stride", "padding"), [(3, 1, 0), (3, 2, 1), ((2, 3), (1, 2), (0, 1)), (1, 1, 0)]
)
def test_conv2d_forward_matches_naive_loop(kernel, stride, padding):
    rng = np.random.default_rng(7)
    layer = Conv2d(3, 4, kernel, stride, padding, rng=rng, dtype=F64)
    x = rng.standard_normal((2, 3, 7, 6))
    expected = naive_conv(x, layer.params["weight"], layer.params["bias"], pair(stride),
                          pair(padding))
    np.testing.assert_allclose(layer.forward(x), expected, rtol=1e-12, atol=1e-12)
    fan_in = 3 * pair(kernel)[0] * pair(kernel)[1]
    assert np.abs(layer.params["weight"]).max() <= 1 / math.sqrt(fan_in)


def naive_pool(x, k, s, reduce):
    n, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    out = np.zeros((n, c, oh, ow))
    for r in range(oh):
        for col in range(ow):
            out[:, :, r, col] = reduce(x[:, :, r * s : r * s + k, col * s : col * s + k], (2, 3))
    return out


@pytest.mark.parametrize(("k", "s"), [(2, None), (3, 2), (2, 1), (3, None)])
def test_pools_match_naive_loop(k, s):
    x = np.random.default_rng(8).standard_normal((2, 3, 7, 8))
    stride = k if s is None else s
    np.testing.assert_allclose(AvgPool2d(k, s).forward(x), naive_pool(x, k, stride, np.mean))
    np.testing.assert_array_equal(MaxPool2d(k, s).forward(x), naive_pool(x, k, stride, np.max))


@pytest.mark.parametrize(("k", "s"), [(2, None), (3, 2)])
def test_maxpool_ties_route_gradient_to_one_element(k, s):
    layer = MaxPool2d(k, s)
    x = np.ones((1, 2, 7, 7))
    out = layer.forward(x)
    dout = np.random.default_rng(9).standard_normal(out.shape)
    dx = layer.backward(dout)
    np.testing.assert_allclose(dx.sum(), dout.sum())  # each window's grad is routed once
    if s is None:  # non-overlapping: exactly one element of each window is nonzero
        for r in range(out.shape[2]):
            for c in range(out.shape[3]):
                window = dx[:, :, r * k : r * k + k, c * k : c * k + k]
                assert ((window != 0).reshape(1, 2, -1).sum(axis=2) == 1).all()


def test_batchnorm_train_eval_and_running_stats():
    rng = np.random.default_rng(10)
    layer = BatchNorm(3, eps=1e-5, momentum=0.1, rng=rng, dtype=F64)
    layer.params["weight"][...] = [1.0, 2.0, 0.5]
    layer.params["bias"][...] = [0.0, -1.0, 3.0]
    w, b = layer.params["weight"].reshape(1, 3, 1, 1), layer.params["bias"].reshape(1, 3, 1, 1)
    running_mean, running_var = np.zeros(3), np.ones(3)
    for step in range(2):
        x = rng.standard_normal((4, 3, 2, 3)) * (step + 2) + step
        mean = x.mean(axis=(0, 2, 3))
        var = x.var(axis=(0, 2, 3))
        count = x.size // 3
        expected = (x - mean.reshape(1, 3, 1, 1)) / np.sqrt(var.reshape(1, 3, 1, 1) + 1e-5)
        np.testing.assert_allclose(layer.forward(x), expected * w + b, rtol=1e-12, atol=1e-12)
        running_mean = 0.9 * running_mean + 0.1 * mean
        running_var = 0.9 * running_var + 0.1 * var * count / (count - 1)
    np.testing.assert_allclose(layer.running_mean, running_mean, rtol=1e-12)
    np.testing.assert_allclose(layer.running_var, running_var, rtol=1e-12)
    assert set(layer.params) == {"weight", "bias"}
    layer.training = False
    x = rng.standard_normal((2, 3, 2, 2))
    rm, rv = running_mean.reshape(1, 3, 1, 1), running_var.reshape(1, 3, 1, 1)
    expected = (x - rm) / np.sqrt(rv + 1e-5) * w + b
    np.testing.assert_allclose(layer.forward(x), expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(layer.running_mean, running_mean, rtol=1e-12)  # eval: unchanged


def test_batchnorm_init_and_errors():
    layer = BatchNorm(4)
    np.testing.assert_array_equal(layer.params["weight"], np.ones(4, np.float32))
    np.testing.assert_array_equal(layer.params["bias"], np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="BatchNorm.forward: input has the wrong shape"):
        layer.forward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="too few values per channel"):
        layer.forward(np.ones((1, 4)))


def test_activation_formulas():
    x = np.linspace(-6, 6, 49).reshape(7, 7)
    np.testing.assert_allclose(ReLU().forward(x), np.maximum(x, 0))
    np.testing.assert_allclose(Sigmoid().forward(x), 1 / (1 + np.exp(-x)), rtol=1e-12)
    np.testing.assert_allclose(Tanh().forward(x), np.tanh(x))
    gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(GELU().forward(x), gelu, rtol=1e-12)
    exact = np.vectorize(lambda v: 0.5 * v * (1 + math.erf(v / math.sqrt(2))))(x)
    np.testing.assert_allclose(GELU().forward(x), exact, atol=1e-3)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no overflow for large |x|
        assert Sigmoid().forward(np.array([-1000.0, 1000.0])).tolist() == [0.0, 1.0]


def test_logsoftmax_is_stable_and_normalised():
    x = np.array([[1000.0, 1001.0, 1002.0], [-1000.0, 0.0, 1000.0]])
    out = LogSoftmax().forward(x)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(np.exp(out).sum(axis=1), 1.0)
    shifted = x[0] - x[0].max()
    np.testing.assert_allclose(out[0], shifted - np.log(np.exp(shifted).sum()))


def test_flatten_keeps_batch_axis():
    layer = Flatten()
    x = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_array_equal(layer.forward(x), x.reshape(2, 12))
    assert layer.backward(np.ones((2, 12))).shape == (2, 3, 4)


def test_parameter_free_layers_have_empty_dicts():
    for layer in (ReLU(), Sigmoid(), Tanh(), GELU(), AvgPool2d(2), MaxPool2d(2), Flatten(),
                  LogSoftmax()):
        assert layer.params == {} and layer.grads == {} and layer.training is True


def test_bad_arguments_raise():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="Linear: in_features is not positive"):
        Linear(0, 3, rng=rng)
    with pytest.raises(TypeError, match="Conv2d: kernel_size has the wrong type"):
        Conv2d(1, 1, (1, 2, 3), rng=rng)
    with pytest.raises(ValueError, match="Conv2d: padding too small"):
        Conv2d(1, 1, 3, padding=-1, rng=rng)
    with pytest.raises(ValueError, match=r"Linear.forward: .*expected \(\.\.\., 3\)"):
        Linear(3, 2, rng=rng).forward(np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"Conv2d.forward: .*expected \(N, 2, H, W\)"):
        Conv2d(2, 1, 3, rng=rng).forward(np.ones((1, 3, 5, 5)))
    with pytest.raises(ValueError, match="smaller than the kernel"):
        MaxPool2d(3).forward(np.ones((1, 1, 2, 5)))


def test_linear_reads_a_weight_in_row_blocks_as_it_reads_it_whole():
    """ZeRO-3 hands a Linear larger than a bucket ParamBlocks (grad_blocks.py): forward sums
    x[:, rows] @ W[rows] over the blocks, backward writes dx[:, rows] = dout @ W[rows].T, and
    the bias is read first; each block is fetched once per pass, lowest rows first."""
    from meta_dist.nn.grad_blocks import ParamBlocks

    rng = np.random.default_rng(3)
    whole = Linear(7, 5, rng=rng, dtype=np.float64)
    blocked = Linear(7, 5, rng=np.random.default_rng(0), dtype=np.float64)
    x, dout = rng.standard_normal((4, 3, 7)), rng.standard_normal((4, 3, 5))
    fetched = []

    def blocks(name, spans):
        value = whole.params[name]

        def fetch(first, stop):
            fetched.append((name, first, stop))
            return value[first:stop].copy()  # a piece buffer's copy, as a gather gives
        return ParamBlocks(value.shape, spans, fetch)

    blocked.params["weight"] = blocks("weight", [(0, 3), (3, 6), (6, 7)])
    blocked.params["bias"] = blocks("bias", [(0, 4), (4, 5)])
    np.testing.assert_allclose(blocked.forward(x), whole.forward(x), rtol=1e-13, atol=1e-14)
    assert fetched == [("bias", 0, 4), ("bias", 4, 5), ("weight", 0, 3), ("weight", 3, 6),
                       ("weight", 6, 7)]  # the bias lies below the weight: its bucket first
    fetched.clear()
    dx = blocked.backward(dout)
    np.testing.assert_allclose(dx, whole.backward(dout), rtol=1e-13, atol=1e-14)
    assert fetched == [("weight", 0, 3), ("weight", 3, 6), ("weight", 6, 7)]
    for name in ("weight", "bias"):  # the gradients need no parameter: the same arithmetic
        np.testing.assert_array_equal(blocked.grads[name], whole.grads[name])


def test_a_blocked_16_bit_linear_adds_its_blocks_in_float32():
    """fp16 blocks summed in fp16 lose bits a single product keeps: the blocked forward adds
    them in float32 and rounds once, so it stays as close to the exact result as one product."""
    from meta_dist.nn.grad_blocks import ParamBlocks

    rng = np.random.default_rng(4)
    layer = Linear(1024, 64, rng=rng, dtype=np.float16)
    weight, bias = layer.params["weight"].copy(), layer.params["bias"].copy()
    x = rng.standard_normal((8, 1024)).astype(np.float16)
    exact = x.astype(np.float64) @ weight.astype(np.float64) + bias.astype(np.float64)
    whole = np.abs(layer.forward(x) - exact).max()
    spans = [(r, r + 32) for r in range(0, 1024, 32)]
    layer.params["weight"] = ParamBlocks(weight.shape, spans, lambda a, b: weight[a:b])
    layer.params["bias"] = ParamBlocks(bias.shape, [(0, 64)], lambda a, b: bias[a:b])
    blocked = layer.forward(x)
    assert blocked.dtype == np.float16
    assert np.abs(blocked - exact).max() <= 1.5 * whole


def test_a_blocked_bfloat16_linear_gives_what_one_product_gives():
    """numpy's bfloat16 product (ml_dtypes) is float32, so levels 0-2 compute on in float32
    after a Linear; the blocked forward and backward (level 3) give the same dtype and values
    (they gave bfloat16, rounding every layer's output: 8x the drift from one process)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from meta_dist.nn.grad_blocks import ParamBlocks

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(5)
    layer = Linear(256, 64, rng=rng, dtype=bf16)
    weight, bias = layer.params["weight"].copy(), layer.params["bias"].copy()
    x = rng.standard_normal((16, 256)).astype(bf16)
    dout = rng.standard_normal((16, 64)).astype(bf16)
    whole, whole_dx = layer.forward(x), layer.backward(dout)
    spans = [(r, r + 16) for r in range(0, 256, 16)]
    layer.params["weight"] = ParamBlocks(weight.shape, spans, lambda a, b: weight[a:b])
    layer.params["bias"] = ParamBlocks(bias.shape, [(0, 64)], lambda a, b: bias[a:b])
    blocked, blocked_dx = layer.forward(x), layer.backward(dout)
    assert blocked.dtype == whole.dtype and blocked_dx.dtype == whole_dx.dtype
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(blocked_dx, whole_dx)  # each block's rows: one product


def test_float16_extremes_give_the_float64_result_rounded():
    """float16 overflowed inside four layers where the result is in range: GELU's backward at
    |x| >= 700 (its du was inf where 1 - t^2 is 0: NaN), LayerNorm and BatchNorm with
    deviations above 256 (their squares were inf: every output 0), and attention with a q.k
    above 65504 (a NaN row). Each now matches float64, rounded once (a reviewer compared
    PyTorch's float16 layers, which give these values)."""
    from meta_dist.nn.norm import LayerNorm
    from meta_dist.nn.transformer import CausalScaledDotProduct

    gelu = GELU()
    x = np.array([-1000, -700, -600, 100, 600, 700, 1000, 5000], np.float16)
    gelu.forward(x)
    np.testing.assert_array_equal(gelu.backward(np.ones_like(x)), [0, 0, 0, 1, 1, 1, 1, 1])

    row = np.array([[0, 100, -300, 300, 50, -50, 10, 1]], np.float16)
    exact = (row - row.astype(np.float64).mean()) / np.sqrt(row.astype(np.float64).var() + 1e-5)
    np.testing.assert_allclose(LayerNorm(8, dtype=np.float16).forward(row), exact, atol=2e-3)

    batch = np.array([[-300, 0.1], [300, 0.2], [100, 0.3], [-100, 0.4]], np.float16)
    norm = BatchNorm(2, dtype=np.float16)
    wide = batch.astype(np.float64)
    exact = (wide - wide.mean(0)) / np.sqrt(wide.var(0) + 1e-5)
    np.testing.assert_allclose(norm.forward(batch), exact, atol=2e-3)
    assert np.isfinite(norm.running_var).all()

    attention = CausalScaledDotProduct(64, 1)
    qkv = np.zeros((1, 2, 192), np.float16)
    qkv[0, :, :64] = 32.0  # q . k = 64 * 32 * 32 = 65536 (inf in float16); scaled, 8192
    qkv[0, :, 64:128] = 32.0
    qkv[0, :, 128:] = np.array([[1.0], [3.0]], np.float16)
    out = attention.forward(qkv)
    np.testing.assert_array_equal(out[0, 1], np.full(64, 2.0, np.float16))  # equal scores


def test_16_bit_parameter_gradients_summed_over_rows_add_up_in_float32():
    """numpy adds float16 rows one at a time in float16: 4096 ones summed to 2048, so a bias
    gradient over 4096 tokens was half what it is (PyTorch's AMP keeps these in float32). The
    sums over rows (Linear's bias, LayerNorm's weight and bias, the position embedding) add
    up in float32 and round once."""
    from meta_dist.nn.norm import LayerNorm

    layer = Linear(3, 2, rng=np.random.default_rng(0), dtype=np.float16)
    layer.forward(np.zeros((4096, 3), np.float16))
    layer.backward(np.ones((4096, 2), np.float16))
    np.testing.assert_array_equal(layer.grads["bias"], [4096, 4096])
    norm = LayerNorm(2, dtype=np.float16)
    norm.forward(np.tile(np.array([[-1, 1]], np.float16), (4096, 1)))
    norm.backward(np.ones((4096, 2), np.float16))
    np.testing.assert_array_equal(norm.grads["bias"], [4096, 4096])
    np.testing.assert_allclose(norm.grads["weight"], [-4096, 4096], rtol=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_conv_and_batchnorm_gradients_add_up_in_float32(dtype):
    """Conv2d's bias and weight and BatchNorm's weight and bias sum over the batch (and the
    pixels) too: added in 16 bits, 4096 ones gave 2048 (bfloat16 256), so a CNN trained in
    fp16 or bf16 (dist_example.py's) took these gradients too small. They add up in float32
    and round once, as the sums over rows do."""
    dtype = np.dtype(dtype) if dtype == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    conv = Conv2d(1, 2, 1, rng=np.random.default_rng(0), dtype=dtype)
    conv.forward(np.ones((64, 1, 8, 8), dtype))  # 4096 values per channel
    conv.backward(np.ones((64, 2, 8, 8), dtype))
    np.testing.assert_array_equal(conv.grads["bias"].astype(np.float32), [4096, 4096])
    conv.forward(np.ones((4096, 1, 1, 1), dtype))  # the weight's sum over 4096 samples
    conv.backward(np.ones((4096, 2, 1, 1), dtype))
    np.testing.assert_array_equal(conv.grads["weight"].astype(np.float32).ravel(), [4096, 4096])
    norm = BatchNorm(2, dtype=dtype)
    x = np.tile(np.array([[1], [-1]], dtype), (2048, 2))  # xhat = +-1, 4096 per channel
    norm.forward(x)
    norm.backward(np.ones_like(x))
    np.testing.assert_array_equal(norm.grads["bias"].astype(np.float32), [4096, 4096])
    norm.forward(x)
    norm.backward(x)  # dout * xhat = 1 everywhere
    np.testing.assert_allclose(norm.grads["weight"].astype(np.float32), [4096, 4096], rtol=1e-3)


def test_a_float16_batchnorm_over_more_than_65504_values_per_channel_keeps_its_means():
    """BatchNorm's dx subtracts the means of dout and dout * xhat, its gradients divided by
    the count: a count above 65504 (64 images of 32x32) is inf in float16, so both means were
    0 and dx was dout * w / std, as in eval mode, for every layer below. Here dout is the
    constant 0.5, whose mean it is: dx is 0."""
    norm = BatchNorm(1, dtype=np.float16)
    x = np.tile(np.array([1, -1], np.float16), 35000).reshape(70000, 1)  # xhat = +-1
    norm.forward(x)
    dx = norm.backward(np.full_like(x, 0.5))
    assert dx.dtype == np.float16
    np.testing.assert_array_equal(dx, np.zeros_like(x))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_16_bit_embedding_gradient_adds_repeated_ids_in_float32(dtype):
    """Tokens seen 4000 and 1000 times: added one id at a time in float16 a gradient stopped at
    2048 (bfloat16 at 256), where PyTorch's embedding backward accumulates in float32."""
    from meta_dist.nn.embedding import Embedding

    dtype = np.dtype(dtype) if dtype == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    layer = Embedding(3, 2, rng=np.random.default_rng(0), dtype=dtype)
    ids = np.zeros(5000, np.int64)
    ids[::5] = 2  # 4000 of id 0 and 1000 of id 2, interleaved: both exact in either dtype
    layer.forward(ids)
    layer.backward(np.ones((5000, 2), dtype))
    np.testing.assert_array_equal(layer.grads["weight"].astype(np.float32),
                                  [[4000, 4000], [0, 0], [1000, 1000]])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_embedding_with_narrow_ids_writes_its_gradient_in_row_blocks(dtype):
    """ZeRO hands Embedding.backward row blocks (grad_blocks.py); uint8 ids under a block that
    starts at row 280 raised OverflowError (ids - 280 in uint8) instead of writing the rows."""
    from meta_dist.nn.embedding import Embedding
    from meta_dist.nn.grad_blocks import GradBlocks

    layer = Embedding(600, 2, rng=np.random.default_rng(0), dtype=dtype)
    layer.forward(np.array([1, 5, 100, 5], np.uint8))
    store = np.full((600, 2), 7, dtype)
    layer.grads["weight"] = GradBlocks((600, 2), [(0, 280), (280, 600)],
                                       lambda first, stop: store[first:stop], lambda *_: None)
    layer.backward(np.ones((4, 2), dtype))
    want = np.zeros((600, 2), dtype)
    want[[1, 100]], want[5] = 1, 2
    np.testing.assert_array_equal(store, want)


def test_a_16_bit_embedding_gradient_widens_only_the_rows_it_touches():
    """Backward holds float32 copies of the rows its ids touch, not of the table: a 100000 x 64
    float16 table (12.2 MiB) widened whole took 24.4 MiB more each backward."""
    import tracemalloc

    from meta_dist.nn.embedding import Embedding

    layer = Embedding(100_000, 64, rng=np.random.default_rng(0), dtype=np.float16)
    ids = np.array([3, 99_999, 3, 7], np.int64)
    layer.forward(ids)
    layer.backward(np.ones((4, 64), np.float16))  # the first may allocate the gradient itself
    tracemalloc.start()
    try:
        layer.backward(np.ones((4, 64), np.float16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"backward allocated {peak / 2**20:.1f} MiB at its peak"
    grad = layer.grads["weight"]
    np.testing.assert_array_equal(grad[[3, 7, 99_999]], np.repeat([[2], [1], [1]], 64, axis=1))
    assert np.count_nonzero(grad) == 3 * 64
