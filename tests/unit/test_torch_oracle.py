"""PyTorch as the oracle: every layer, loss and optimizer of meta_dist beside torch; a tiny GPT.

Same weights and inputs on both sides; compared: forward output, input gradient, parameter
gradients (float64 to rtol 1e-10, float32 to 1e-5), optimizers after 50 steps on one fixed
sequence of gradients. Where meta_dist follows another convention on purpose, the test pins the
difference and says why. Skipped where torch is not installed (pip install -e '.[bench]').
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from meta_dist.models import gpt  # noqa: E402
from meta_dist.models.torch_gpt import (  # noqa: E402
    TorchAttention,
    TorchBlock,
    TorchMLP,
    gpt_names,
    is_linear_weight,
)
from meta_dist.models.torch_gpt import twin as torch_gpt_twin  # noqa: E402
from meta_dist.nn import conv, dropout, embedding, norm  # noqa: E402
from meta_dist.nn import layers as L  # noqa: E402
from meta_dist.nn import transformer as T  # noqa: E402
from meta_dist.nn.losses import (  # noqa: E402
    cross_entropy_tokens,
    mse_loss,
    nll_loss,
    softmax_cross_entropy,
)
from meta_dist.optim import make_optimizer  # noqa: E402

DTYPES = [np.float64, np.float32]
TOL = {np.float64: 1e-10, np.float32: 1e-5}  # rtol; atol is the same times the largest value
TORCH_DTYPE = {np.float64: torch.float64, np.float32: torch.float32}


def close(ours, theirs, dtype, what: str) -> None:
    theirs = theirs.detach().numpy() if isinstance(theirs, torch.Tensor) else theirs
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(theirs).max())) if np.size(theirs) else 1.0
    np.testing.assert_allclose(np.asarray(ours), theirs, err_msg=what, rtol=tol,
                               atol=tol * scale)


# ---- small torch modules beside meta_dist.models.torch_gpt's (the oracle side) ----


class TorchSDPA(nn.Module):
    """The attention core alone, through torch's own fused causal attention."""

    def __init__(self, n_head):
        super().__init__()
        self.n_head = n_head

    def forward(self, qkv):
        b, t, c3 = qkv.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2)
                   for z in qkv.split(c3 // 3, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, c3 // 3)


class TorchTokens(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))


class TorchTiedHead(nn.Module):
    def __init__(self, vocab_size, n_embd):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, n_embd))

    def forward(self, x):
        return F.linear(x, self.weight)


def compare_layer(layer, module, x, dtype, *, transposed=None):
    """Copy layer's params into module, run both forward and backward, compare everything."""
    module = module.to(TORCH_DTYPE[dtype])
    transposed = transposed or (lambda name: is_linear_weight(layer, name))
    torch_params = dict(module.named_parameters())
    assert set(torch_params) == set(layer.params), (sorted(torch_params), list(layer.params))
    with torch.no_grad():
        for name, value in layer.params.items():
            torch_params[name].copy_(torch.from_numpy(value.T if transposed(name) else value))
    out = layer.forward(x)
    r = np.random.default_rng(99).standard_normal(out.shape).astype(dtype)
    dx = layer.backward(r)
    is_float = np.issubdtype(x.dtype, np.floating)
    x_t = torch.from_numpy(x.copy()).requires_grad_(is_float)
    out_t = module(x_t)
    out_t.backward(torch.from_numpy(r))
    close(out, out_t, dtype, "forward output")
    assert out.dtype == dtype
    if is_float:
        close(dx, x_t.grad, dtype, "input gradient")
    else:
        assert dx is None  # integer ids have no gradient
    for name, grad in layer.grads.items():
        theirs = torch_params[name].grad.numpy()
        close(grad, theirs.T if transposed(name) else theirs, dtype, f"grad of {name}")
    return module


def floats(shape, dtype, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


RNG = np.random.default_rng
LAYER_CASES = {
    # name: (meta_dist layer for a dtype, torch module, input shape)
    "linear": (lambda d: L.Linear(4, 3, rng=RNG(0), dtype=d), lambda: nn.Linear(4, 3), (5, 4)),
    "linear_nobias": (lambda d: L.Linear(4, 3, bias=False, rng=RNG(0), dtype=d),
                      lambda: nn.Linear(4, 3, bias=False), (5, 4)),
    "linear_3d": (lambda d: L.Linear(4, 3, rng=RNG(0), dtype=d), lambda: nn.Linear(4, 3),
                  (2, 3, 4)),
    "conv": (lambda d: conv.Conv2d(2, 3, 3, rng=RNG(0), dtype=d), lambda: nn.Conv2d(2, 3, 3),
             (2, 2, 5, 5)),
    "conv_stride_pad": (
        lambda d: conv.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2), rng=RNG(0), dtype=d),
        lambda: nn.Conv2d(2, 3, (3, 2), stride=(2, 1), padding=(1, 2)), (2, 2, 6, 5)),
    "conv_nobias": (lambda d: conv.Conv2d(2, 2, 2, bias=False, rng=RNG(0), dtype=d),
                    lambda: nn.Conv2d(2, 2, 2, bias=False), (1, 2, 4, 4)),
    "batchnorm_2d": (lambda d: norm.BatchNorm(3, dtype=d), lambda: nn.BatchNorm1d(3), (6, 3)),
    "batchnorm_4d": (lambda d: norm.BatchNorm(2, dtype=d), lambda: nn.BatchNorm2d(2), (3, 2, 3, 2)),
    "relu": (lambda d: L.ReLU(), nn.ReLU, (4, 5)),
    "sigmoid": (lambda d: L.Sigmoid(), nn.Sigmoid, (4, 5)),
    "tanh": (lambda d: L.Tanh(), nn.Tanh, (4, 5)),
    "gelu_tanh": (lambda d: L.GELU(), lambda: nn.GELU(approximate="tanh"), (4, 5)),
    "avgpool": (lambda d: conv.AvgPool2d(2), lambda: nn.AvgPool2d(2), (2, 2, 4, 5)),
    "avgpool_overlap": (lambda d: conv.AvgPool2d(3, stride=1), lambda: nn.AvgPool2d(3, stride=1),
                        (2, 2, 5, 4)),
    "maxpool": (lambda d: conv.MaxPool2d(2), lambda: nn.MaxPool2d(2), (2, 2, 4, 5)),
    "maxpool_overlap": (lambda d: conv.MaxPool2d(3, stride=2), lambda: nn.MaxPool2d(3, stride=2),
                        (2, 2, 7, 6)),
    "flatten": (lambda d: L.Flatten(), nn.Flatten, (2, 3, 2, 2)),
    "logsoftmax": (lambda d: L.LogSoftmax(), lambda: nn.LogSoftmax(dim=1), (4, 6)),
    "logsoftmax_4d": (lambda d: L.LogSoftmax(), lambda: nn.LogSoftmax(dim=1), (2, 3, 2, 2)),
    # transformer layers
    "layernorm": (lambda d: norm.LayerNorm(6, dtype=d), lambda: nn.LayerNorm(6), (2, 3, 6)),
    "layernorm_eps": (lambda d: norm.LayerNorm(5, eps=1e-2, dtype=d),
                      lambda: nn.LayerNorm(5, eps=1e-2), (4, 5)),
    "attention_core": (lambda d: T.CausalScaledDotProduct(8, 2), lambda: TorchSDPA(2),
                       (2, 5, 24)),
    "attention": (lambda d: T.CausalSelfAttention(8, 2, rng=RNG(0), dtype=d),
                  lambda: TorchAttention(8, 2), (2, 5, 8)),
    "mlp": (lambda d: T.MLP(6, rng=RNG(0), dtype=d), lambda: TorchMLP(6), (2, 3, 6)),
    "block": (lambda d: T.Block(8, 2, rng=RNG(0), dtype=d), lambda: TorchBlock(8, 2), (2, 5, 8)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_matches_torch(name, dtype):
    build, build_torch, shape = LAYER_CASES[name]
    layer = build(dtype)
    rng = np.random.default_rng(3)
    for param in layer.params.values():  # off their constant init (BatchNorm, LayerNorm)
        param[...] = rng.standard_normal(param.shape)
    x = floats(shape, dtype)
    if name == "relu":
        x[np.abs(x) < 1e-3] = 0.5  # torch and meta_dist agree on the kink, but keep clear of it
    compare_layer(layer, build_torch(), x, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("shape", [(6, 3), (3, 3, 2, 2)])
def test_batchnorm_running_stats_and_eval_match_torch(shape, dtype):
    # meta_dist's momentum is PyTorch's convention (weight of the NEW batch: running =
    # (1 - m) * running + m * batch, with the unbiased batch variance), not Keras' (weight of
    # the old value); a momentum of 0.3 would read 0.7 in Keras.
    layer = norm.BatchNorm(3, momentum=0.3, dtype=dtype)
    module = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(3, momentum=0.3)
    module = module.to(TORCH_DTYPE[dtype])
    for seed in range(3):
        x = floats(shape, dtype, seed) * 2 + 1
        layer.forward(x)
        module(torch.from_numpy(x))
    close(layer.running_mean, module.running_mean, dtype, "running_mean")
    close(layer.running_var, module.running_var, dtype, "running_var")
    layer.training = False
    compare_layer(layer, module.eval(), floats(shape, dtype, 7), dtype)


def test_gelu_is_the_tanh_form():
    # On purpose: meta_dist's GELU is the tanh approximation (numpy has no vectorised erf), as
    # GPT-2; torch's default nn.GELU() is the exact erf form. Pinned: equal to approximate='tanh'
    # (test_layer_matches_torch[gelu_tanh]), and off the exact form by a small, nonzero amount.
    x = np.linspace(-5, 5, 201)
    exact = F.gelu(torch.from_numpy(x)).numpy()
    gap = np.abs(L.GELU().forward(x) - exact).max()
    assert 1e-5 < gap < 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_embedding_matches_torch(dtype):
    layer = embedding.Embedding(7, 4, rng=RNG(0), dtype=dtype)
    ids = np.array([[0, 3, 3, 6], [6, 1, 3, 0]])  # repeated ids: the gradient rows add up
    compare_layer(layer, nn.Embedding(7, 4), ids, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_token_and_position_matches_torch(dtype):
    layer = T.TokenAndPosition(11, 6, 4, rng=RNG(0), dtype=dtype)
    ids = np.random.default_rng(2).integers(0, 11, (3, 5))  # T=5 < block_size=6
    compare_layer(layer, TorchTokens(11, 6, 4), ids, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_tied_head_matches_torch(dtype):
    table = embedding.Embedding(9, 4, rng=RNG(0), dtype=dtype)
    head = T.TiedHead(table)
    assert head.params["weight"] is table.params["weight"]
    assert head.grads["weight"] is not table.grads["weight"]
    # the head's weight is (vocab, width) like torch's Linear(width, vocab): no transpose
    compare_layer(head, TorchTiedHead(9, 4), floats((2, 3, 4), dtype), dtype,
                  transposed=lambda name: False)
    assert not table.grads["weight"].any()  # the head wrote only its own grads


def test_dropout_scaling_and_eval_match_torch():
    # The masks come from meta_dist's own host generator (seed, rank, call), not from torch's
    # RNG, so they differ from torch's on purpose; the convention is the same: inverted
    # dropout (kept elements scaled by 1/(1-p)), identity in eval mode.
    p, x = 0.3, floats((200, 50), np.float64)
    layer = dropout.Dropout(p, seed=5)
    out = layer.forward(x)
    out_t = F.dropout(torch.from_numpy(x), p, training=True).numpy()
    for y in (out, out_t):
        kept = y != 0
        np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-15)
        assert abs(kept.mean() - (1 - p)) < 0.02
    dout = floats(x.shape, np.float64, 2)
    np.testing.assert_allclose(layer.backward(dout), dout * (out / x), rtol=1e-15)
    layer.training = False
    np.testing.assert_array_equal(layer.forward(x), F.dropout(torch.from_numpy(x), p,
                                                              training=False).numpy())


# ---- losses ----


def torch_loss_and_grad(fn, scores, *args):
    scores_t = torch.from_numpy(scores.copy()).requires_grad_()
    loss = fn(scores_t, *(torch.from_numpy(a) for a in args))
    loss.backward()
    return loss, scores_t.grad


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_losses_match_torch(dtype):
    rng = np.random.default_rng(4)
    logits, labels = floats((6, 5), dtype), rng.integers(0, 5, 6)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    target = floats((3, 2, 4), dtype, 5)
    tokens, token_targets = floats((2, 3, 5), dtype, 6), rng.integers(0, 5, (2, 3))
    cases = [
        (softmax_cross_entropy, F.cross_entropy, logits, labels),
        (nll_loss, F.nll_loss, log_probs, labels),
        (mse_loss, F.mse_loss, floats((3, 2, 4), dtype, 7), target),
        (cross_entropy_tokens,
         lambda s, t: F.cross_entropy(s.view(-1, s.shape[-1]), t.view(-1)), tokens,
         token_targets),
    ]
    for ours, theirs, scores, other in cases:
        loss, grad = ours(scores, other)
        loss_t, grad_t = torch_loss_and_grad(theirs, scores, other)
        close(loss, loss_t, dtype, f"{ours.__name__} loss")
        close(grad, grad_t, dtype, f"{ours.__name__} grad")
        assert loss.dtype == dtype and grad.dtype == dtype


# ---- optimizers: 50 steps on one fixed sequence of gradients ----

OPTIMIZER_CASES = [
    ("sgd", {"lr": 0.1}, torch.optim.SGD, {}),
    ("sgd", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD, {}),
    ("sgd", {"lr": 0.1, "momentum": 0.8, "dampening": 0.2}, torch.optim.SGD, {}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True}, torch.optim.SGD, {}),
    ("sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
     torch.optim.SGD, {}),
    ("sgd", {"lr": 0.1, "weight_decay": 0.05}, torch.optim.SGD, {}),
    ("adam", {}, torch.optim.Adam, {}),
    ("adam", {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6}, torch.optim.Adam, {}),
    # Adam's weight_decay is the L2 form (added to the gradient), as torch.optim.Adam; the
    # decoupled form is AdamW (or decoupled_weight_decay=True). Pinned in the test below.
    ("adam", {"lr": 0.01, "weight_decay": 0.1}, torch.optim.Adam, {}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
     torch.optim.AdamW, {"decoupled_weight_decay": None}),
    ("adamw", {}, torch.optim.AdamW, {}),  # both default to weight_decay 0.01
    ("adamw", {"lr": 0.01, "betas": (0.85, 0.98), "weight_decay": 0.1}, torch.optim.AdamW, {}),
]
NUMEL, STEPS = 29, 50


def run_both(name, config, torch_cls, dtype, torch_config=None):
    rng = np.random.default_rng(8)
    start = rng.standard_normal(NUMEL).astype(dtype)
    grads = [rng.standard_normal(NUMEL).astype(dtype) for _ in range(STEPS)]
    opt = make_optimizer(name, NUMEL, dtype=dtype, **config)
    params = start.copy()
    param_t = torch.from_numpy(start.copy()).requires_grad_()
    opt_t = torch_cls([param_t], foreach=False, **(torch_config or config))
    for g in grads:
        opt.step(params, g)
        param_t.grad = torch.from_numpy(g.copy())
        opt_t.step()
    return params, param_t


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(("name", "config", "torch_cls", "drop"), OPTIMIZER_CASES,
                         ids=[f"{n}-{'-'.join(map(str, c.values())) or 'default'}"
                              for n, c, _, _ in OPTIMIZER_CASES])
def test_optimizer_matches_torch(name, config, torch_cls, drop, dtype):
    torch_config = {k: v for k, v in config.items() if k not in drop}
    params, param_t = run_both(name, config, torch_cls, dtype, torch_config)
    close(params, param_t, dtype, f"{name} after {STEPS} steps")


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize(("name", "torch_cls"), [("adamw", torch.optim.AdamW),
                                                 ("adam", torch.optim.Adam),
                                                 ("sgd", torch.optim.SGD)])
def test_decay_spans_are_torch_parameter_groups(name, torch_cls, dtype):
    """set_decay_spans equals PyTorch with two parameter groups (nanoGPT's: the decayed one,
    and weight_decay 0 for the rest), 50 steps, elements 3-10 and 20-27 decayed."""
    config = {"lr": 0.01, "weight_decay": 0.1}
    rng = np.random.default_rng(9)
    start = rng.standard_normal(NUMEL).astype(dtype)
    grads = [rng.standard_normal(NUMEL).astype(dtype) for _ in range(STEPS)]
    spans = [(3, 10), (20, 27)]
    opt = make_optimizer(name, NUMEL, dtype=dtype, **config)
    opt.set_decay_spans(spans)
    params = start.copy()
    cuts = [0, 3, 10, 20, 27, NUMEL]
    pieces = [torch.from_numpy(start[a:b].copy()).requires_grad_()
              for a, b in itertools.pairwise(cuts)]
    decayed = [pieces[1], pieces[3]]
    rest = [pieces[0], pieces[2], pieces[4]]
    opt_t = torch_cls([{"params": decayed}, {"params": rest, "weight_decay": 0.0}],
                      foreach=False, **config)
    for g in grads:
        opt.step(params, g)
        for p, (a, b) in zip(pieces, itertools.pairwise(cuts), strict=True):
            p.grad = torch.from_numpy(g[a:b].copy())
        opt_t.step()
    close(params, torch.cat([p.detach() for p in pieces]), dtype, f"{name} with decay spans")


def test_adam_weight_decay_is_l2_not_decoupled():
    config = {"lr": 0.01, "weight_decay": 0.1}
    params, adamw_t = run_both("adam", config, torch.optim.AdamW, np.float64)
    assert np.abs(params - adamw_t.detach().numpy()).max() > 1e-4


# ---- a whole tiny GPT ----

VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 17, 8, 2, 2, 16


def torch_twin(model):
    """Return TorchGPT holding the weights of the meta_dist ``model`` (float64)."""
    return torch_gpt_twin(model, VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD)


def meta_grad(model, layer, name):
    """The gradient of one parameter; the tied weight's is the sum of embedding's and head's."""
    grad = layer.grads[name]
    if isinstance(layer, T.TokenAndPosition) and name == "wte.weight":
        grad = grad + model.layers[-1].grads["weight"]
    return grad


def test_gpt_matches_torch():
    model = gpt(VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD, dtype=np.float64, seed=3)
    head, tokens = model.layers[-1], model.layers[0]
    assert head.params["weight"] is tokens.params["wte.weight"]
    twin = torch_twin(model)
    rng = np.random.default_rng(11)
    batches = [(rng.integers(0, VOCAB, (3, BLOCK)), rng.integers(0, VOCAB, (3, BLOCK)))
               for _ in range(4)]
    names = gpt_names(model)
    lr, losses, losses_t = 0.3, [], []
    for step in range(21):
        ids, targets = batches[step % len(batches)]
        logits = model.forward(ids)
        loss, dlogits = cross_entropy_tokens(logits, targets)
        model.backward(dlogits)
        logits_t = twin(torch.from_numpy(ids))
        loss_t = F.cross_entropy(logits_t.view(-1, VOCAB), torch.from_numpy(targets).view(-1))
        twin.zero_grad()
        loss_t.backward()
        losses.append(float(loss))
        losses_t.append(float(loss_t.detach()))
        if step == 0:  # one forward/backward: logits, loss and every gradient
            close(logits, logits_t, np.float64, "logits")
            assert set(names) == {n for n, _ in twin.named_parameters()}
            for torch_name, (layer, name) in names.items():
                theirs = twin.get_parameter(torch_name).grad.numpy()
                close(meta_grad(model, layer, name),
                      theirs.T if is_linear_weight(layer, name) else theirs, np.float64,
                      f"grad of {torch_name}")
        if step == 20:
            break
        # SGD by hand on both sides; the tied weight is one parameter with the summed grads
        for layer, name in names.values():
            layer.params[name] -= lr * meta_grad(model, layer, name)
        with torch.no_grad():
            for param in twin.parameters():  # parameters() yields the tied weight once
                param -= lr * param.grad
    np.testing.assert_allclose(losses, losses_t, rtol=0, atol=1e-9)
    assert losses[-1] < losses[0] - 0.2  # it learned: the comparison is not of a frozen model
