"""Unit tests for meta_dist.optim: update rules against a plain numpy oracle, pieces, ZeRO splits,
checkpoints and error messages. numpy only, single process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meta_dist.optim import SGD, Adam, AdamW, Optimizer, make_optimizer

NUMEL = 37
STEPS = 5

SGD_CONFIGS = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.3},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"lr": 0.1, "weight_decay": 0.01},
    {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    {"lr": 0.1, "momentum": 0.8, "dampening": 0.2, "weight_decay": 0.05},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
]
ADAM_CONFIGS = [
    {},
    {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
    {"lr": 0.01, "weight_decay": 0.1},
    {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
]
ADAMW_CONFIGS = [{}, {"lr": 0.01, "weight_decay": 0.1}]
ALL_CASES = (
    [("sgd", c) for c in SGD_CONFIGS]
    + [("adam", c) for c in ADAM_CONFIGS]
    + [("adamw", c) for c in ADAMW_CONFIGS]
)
CASE_IDS = [
    f"{name}-{'-'.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for name, c in ALL_CASES
]


def make_data(numel=NUMEL, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(numel)
    grads = [rng.standard_normal(numel) for _ in range(steps)]
    return params, grads


def reference_sgd(params, grads, lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD, written out plainly."""
    p, buf = params.copy(), None
    for g in grads:
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            buf = g.copy() if buf is None else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr * g
    return p, {"momentum_buffer": buf} if momentum != 0 else {}


def reference_adam(
    params, grads, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False
):
    """torch.optim.Adam / AdamW, written out plainly."""
    beta1, beta2 = betas
    p, m, v = params.copy(), np.zeros_like(params), np.zeros_like(params)
    for t, g in enumerate(grads, start=1):
        if weight_decay != 0:
            if decoupled:
                p = p * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        denom = np.sqrt(v) / bias_correction2**0.5 + eps
        p = p - (lr / bias_correction1) * m / denom
    return p, {"exp_avg": m, "exp_avg_sq": v}


def run(opt, params, grads, split=None):
    """Step ``opt`` over ``grads``; with ``split`` (cut points) pass the vectors as pieces."""
    p = params.copy()
    for g in grads:
        if split is None:
            opt.step(p, g)
        else:
            opt.step(np.split(p, split), np.split(g, split))
    return p


def build(name, config, numel=NUMEL, dtype=np.float64):
    return make_optimizer(name, numel, dtype=dtype, **config)


# ---- against the oracle ----


@pytest.mark.parametrize("config", SGD_CONFIGS)
def test_sgd_matches_reference_exactly(config):
    params, grads = make_data()
    opt = SGD(NUMEL, dtype=np.float64, **config)
    expected, expected_state = reference_sgd(params, grads, **config)
    np.testing.assert_array_equal(run(opt, params, grads), expected)
    assert opt.state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        np.testing.assert_array_equal(opt.state[key], value)
    assert opt.step_count == STEPS


@pytest.mark.parametrize("config", ADAM_CONFIGS)
def test_adam_matches_reference(config):
    params, grads = make_data()
    opt = Adam(NUMEL, dtype=np.float64, **config)
    ref = dict(config)
    ref["decoupled"] = ref.pop("decoupled_weight_decay", False)
    expected, expected_state = reference_adam(params, grads, **ref)
    # The last update is computed as step_size * (m / denom) rather than (step_size * m) / denom,
    # so params may differ in the last bit of an update; the moments are exact.
    np.testing.assert_allclose(run(opt, params, grads), expected, rtol=1e-15, atol=1e-15)
    for key, value in expected_state.items():
        np.testing.assert_array_equal(opt.state[key], value)


@pytest.mark.parametrize("config", ADAMW_CONFIGS)
def test_adamw_matches_reference(config):
    params, grads = make_data()
    opt = AdamW(NUMEL, dtype=np.float64, **config)
    ref = {"weight_decay": 0.01, **config}
    expected, _ = reference_adam(params, grads, decoupled=True, **ref)
    np.testing.assert_allclose(run(opt, params, grads), expected, rtol=1e-15, atol=1e-15)


def test_adamw_is_adam_with_decoupled_decay_and_default_weight_decay():
    params, grads = make_data()
    adamw = AdamW(NUMEL, dtype=np.float64)
    adam = Adam(NUMEL, dtype=np.float64, weight_decay=0.01, decoupled_weight_decay=True)
    assert adamw.hyperparameters["weight_decay"] == 0.01
    np.testing.assert_array_equal(run(adamw, params, grads), run(adam, params, grads))
    # L2 and decoupled decay really differ
    l2 = Adam(NUMEL, dtype=np.float64, weight_decay=0.01)
    assert not np.array_equal(run(l2, params, grads), run(adam, params, grads))


def test_float32_state_and_params_stay_float32():
    params, grads = make_data()
    for name, config in [("sgd", {"lr": 0.1, "momentum": 0.9}), ("adam", {"lr": 0.01})]:
        opt = build(name, config, dtype=np.float32)
        assert all(arr.dtype == np.float32 for arr in opt.state.values())
        p = run(opt, params.astype(np.float32), [g.astype(np.float32) for g in grads])
        assert p.dtype == np.float32
        reference = build(name, config, dtype=np.float64)
        np.testing.assert_allclose(p, run(reference, params, grads), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "config"), ALL_CASES, ids=CASE_IDS)
def test_grads_are_not_written(name, config):
    params, grads = make_data()
    saved = [g.copy() for g in grads]
    run(build(name, config), params, grads)
    for g, s in zip(grads, saved, strict=True):
        np.testing.assert_array_equal(g, s)


# ---- pieces and shards ----


@pytest.mark.parametrize(("name", "config"), ALL_CASES, ids=CASE_IDS)
def test_pieces_are_bit_identical_to_one_array(name, config):
    params, grads = make_data()
    whole, pieces = build(name, config), build(name, config)
    # three uneven pieces and an empty one
    split = [5, 5, 19]
    np.testing.assert_array_equal(run(pieces, params, grads, split), run(whole, params, grads))
    for key in whole.state:
        np.testing.assert_array_equal(pieces.state[key], whole.state[key])
    assert pieces.step_count == whole.step_count == STEPS


@pytest.mark.parametrize(("name", "config"), ALL_CASES, ids=CASE_IDS)
def test_two_owners_of_halves_match_one_owner_of_the_whole(name, config):
    """The ZeRO property: sharding the state changes no bit of the result."""
    params, grads = make_data()
    cut = 15
    whole = build(name, config)
    first, second = build(name, config, numel=cut), build(name, config, numel=NUMEL - cut)
    p = params.copy()
    for g in grads:
        first.step(p[:cut], g[:cut])
        second.step(p[cut:], g[cut:])
    np.testing.assert_array_equal(p, run(whole, params, grads))
    for key in whole.state:
        np.testing.assert_array_equal(
            np.concatenate([first.state[key], second.state[key]]), whole.state[key]
        )


def test_step_count_counts_calls_not_pieces():
    opt = SGD(NUMEL, lr=0.1, dtype=np.float64)
    params, grads = make_data()
    run(opt, params, grads[:2], split=[3, 10, 20])
    assert opt.step_count == 2


# ---- checkpoints ----


@pytest.mark.parametrize(("name", "config"), ALL_CASES, ids=CASE_IDS)
def test_state_dict_round_trip_continues_the_run(name, config):
    params, grads = make_data(steps=6)
    uninterrupted = run(build(name, config), params, grads)

    before = build(name, config)
    p = run(before, params, grads[:3])
    saved = before.state_dict()
    run(before, p.copy(), grads[3:])  # the saved dict must be a copy, not a view
    after = make_optimizer(
        saved["name"], saved["numel"], dtype=np.float64, **saved["hyperparameters"]
    )
    after.load_state_dict(saved)
    assert after.step_count == 3
    np.testing.assert_array_equal(run(after, p, grads[3:]), uninterrupted)


def test_state_dict_layout():
    opt = Adam(4, lr=0.01, dtype=np.float64)
    opt.step(np.ones(4), np.ones(4))
    d = opt.state_dict()
    assert d["name"] == "adam"
    assert d["numel"] == 4
    assert d["step_count"] == 1
    assert d["hyperparameters"] == {
        "lr": 0.01,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "decoupled_weight_decay": False,
    }
    assert set(d["state"]) == {"exp_avg", "exp_avg_sq"}
    assert all(type(v) is np.ndarray for v in d["state"].values())
    assert d["state"]["exp_avg"] is not opt.state["exp_avg"]


def test_load_state_dict_casts_to_own_dtype():
    source = SGD(3, lr=0.1, momentum=0.9, dtype=np.float64)
    source.step(np.ones(3), np.full(3, 0.5))
    target = SGD(3, lr=0.1, momentum=0.9, dtype=np.float32)
    target.load_state_dict(source.state_dict())
    assert target.state["momentum_buffer"].dtype == np.float32
    np.testing.assert_array_equal(target.state["momentum_buffer"], np.full(3, 0.5, np.float32))


@pytest.mark.parametrize(
    ("source", "target", "match"),
    [
        (SGD(4, lr=0.1), Adam(4), "name differs; got 'sgd', expected 'adam'"),
        (
            Adam(4, decoupled_weight_decay=True),
            AdamW(4),
            "name differs; got 'adam', expected 'adamw'",
        ),
        (Adam(4), Adam(5), "numel differs; got 4, expected 5"),
        (SGD(0, lr=0.1), SGD(3, lr=0.1), "numel differs; got 0, expected 3"),
        (
            SGD(4, lr=0.1),
            SGD(4, lr=0.1, momentum=0.9),
            r"state keys differ; got \[\], expected \['momentum_buffer'\]",
        ),
    ],
)
def test_load_state_dict_rejects_mismatch(source, target, match):
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(source.state_dict())


def test_load_state_dict_rejects_bad_contents():
    opt = Adam(4)
    d = opt.state_dict()
    with pytest.raises(ValueError, match=r"state\['exp_avg'\] has the wrong shape; got \(3,\)"):
        opt.load_state_dict({**d, "state": {**d["state"], "exp_avg": np.zeros(3)}})
    with pytest.raises(ValueError, match="invalid step_count; got -1"):
        opt.load_state_dict({**d, "step_count": -1})
    with pytest.raises(ValueError, match=r"lacks \['numel'\]"):
        opt.load_state_dict({k: v for k, v in d.items() if k != "numel"})


# ---- empty shards and memory ----


@pytest.mark.parametrize(("name", "config"), ALL_CASES, ids=CASE_IDS)
def test_numel_zero(name, config):
    opt = build(name, config, numel=0)
    opt.step(np.zeros(0), np.zeros(0))
    opt.step([], [])
    opt.step([np.zeros(0), np.zeros(0)], [np.zeros(0), np.zeros(0)])
    assert opt.step_count == 3
    assert opt.state_bytes() == 0
    fresh = build(name, config, numel=0)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.step_count == 3


@pytest.mark.parametrize(
    ("opt", "expected"),
    [
        (SGD(10, lr=0.1), 0),
        (SGD(10, lr=0.1, weight_decay=0.1), 0),
        (SGD(10, lr=0.1, momentum=0.9), 40),
        (SGD(10, lr=0.1, momentum=0.9, dtype=np.float64), 80),
        (Adam(10), 80),
        (Adam(10, dtype=np.float64), 160),
        (AdamW(10, dtype=np.float64), 160),
    ],
)
def test_state_bytes(opt, expected):
    assert opt.state_bytes() == expected
    assert isinstance(opt, Optimizer)


# ---- bad input ----


def test_step_rejects_wrong_total_length():
    opt = SGD(10, lr=0.1, dtype=np.float64)
    with pytest.raises(ValueError, match="got 9, expected numel = 10"):
        opt.step(np.zeros(9), np.zeros(9))
    with pytest.raises(ValueError, match="got 11, expected numel = 10"):
        opt.step([np.zeros(5), np.zeros(6)], [np.zeros(5), np.zeros(6)])
    assert opt.step_count == 0


@pytest.mark.parametrize(
    ("params", "grads", "error", "match"),
    [
        ([np.zeros(4)], [np.zeros(2), np.zeros(2)], ValueError, "params has 1 pieces, grads has 2"),
        (
            [np.zeros(3), np.zeros(1)],
            [np.zeros(2), np.zeros(2)],
            ValueError,
            "piece 0 has 3 params and 2 grads",
        ),
        (np.zeros((2, 2)), np.zeros((2, 2)), ValueError, r"piece 0 is 2-D; got shape \(2, 2\)"),
        (np.zeros(4), [np.zeros(4)], TypeError, "both be arrays or both be lists"),
        (np.zeros(4, np.float32), np.zeros(4), TypeError, "got float32, expected float64"),
        ([1.0, 2.0], [1.0, 2.0], TypeError, "got float, expected an array of numpy"),
    ],
)
def test_step_rejects_bad_pieces(params, grads, error, match):
    opt = SGD(4, lr=0.1, dtype=np.float64)
    with pytest.raises(error, match=match):
        opt.step(params, grads)
    assert opt.step_count == 0


@pytest.mark.parametrize(
    ("build_it", "error", "match"),
    [
        (lambda: SGD(4, lr=-0.1), ValueError, r"SGD: invalid lr; got -0.1, expected 0 <= lr"),
        (lambda: SGD(4, lr=math.nan), ValueError, "invalid lr; got nan"),
        (lambda: SGD(4, lr="0.1"), TypeError, "lr must be a real number; got '0.1'"),
        (lambda: SGD(4, lr=0.1, momentum=-0.5), ValueError, "invalid momentum; got -0.5"),
        (lambda: SGD(4, lr=0.1, dampening=None), TypeError, "dampening must be a real number"),
        (lambda: SGD(4, lr=0.1, dampening=math.nan), ValueError, "invalid dampening; got nan"),
        (lambda: SGD(4, lr=0.1, weight_decay=-1), ValueError, "invalid weight_decay; got -1"),
        (lambda: SGD(4, lr=0.1, nesterov=True), ValueError, "nesterov=True needs momentum > 0"),
        (
            lambda: SGD(4, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
            ValueError,
            "dampening == 0; got momentum=0.9, dampening=0.1",
        ),
        (lambda: SGD(-1, lr=0.1), ValueError, "SGD: invalid numel; got -1, expected an integer"),
        (lambda: SGD(2.5, lr=0.1), ValueError, "invalid numel; got 2.5"),
        (lambda: SGD(4, lr=0.1, dtype=np.int32), TypeError, "invalid dtype"),
        (lambda: Adam(4, lr=-1e-3), ValueError, "Adam: invalid lr; got -0.001"),
        (
            lambda: Adam(4, betas=(1.0, 0.999)),
            ValueError,
            r"invalid betas\[0\]; got 1.0, expected 0 <= betas\[0\] < 1",
        ),
        (lambda: Adam(4, betas=(0.9, -0.1)), ValueError, r"invalid betas\[1\]; got -0.1"),
        (lambda: Adam(4, betas=(0.9,)), ValueError, r"invalid betas; got \(0.9,\), expected a"),
        (lambda: Adam(4, eps=-1e-8), ValueError, "invalid eps; got -1e-08"),
        (lambda: AdamW(4, weight_decay=-0.01), ValueError, "AdamW: invalid weight_decay; got -0.0"),
    ],
)
def test_bad_hyperparameters(build_it, error, match):
    with pytest.raises(error, match=match):
        build_it()


# ---- factory ----


def test_make_optimizer_builds_each_rule():
    assert type(make_optimizer("sgd", 3, lr=0.1)) is SGD
    assert type(make_optimizer("adam", 3)) is Adam
    opt = make_optimizer("adamw", 3, xp=np, dtype=np.float64, lr=0.01, betas=[0.8, 0.9])
    assert type(opt) is AdamW
    assert opt.hyperparameters["betas"] == (0.8, 0.9)
    assert opt.state["exp_avg"].dtype == np.float64


def test_make_optimizer_rejects_unknown_name():
    expected = "unknown optimizer; got 'adamm', expected one of adam, adamw, sgd; did you mean"
    with pytest.raises(ValueError, match=expected):
        make_optimizer("adamm", 3)


def test_make_optimizer_rejects_unknown_hyperparameter():
    expected = "got 'momentum', expected one of lr, betas, eps, weight_decay$"
    with pytest.raises(ValueError, match=expected):
        make_optimizer("adamw", 3, momentum=0.9)
    with pytest.raises(ValueError, match="got 'momentun'.*did you mean 'momentum'"):
        make_optimizer("sgd", 3, momentun=0.9)


def test_make_optimizer_requires_lr_for_sgd():
    with pytest.raises(ValueError, match="'sgd' needs hyperparameter 'lr'"):
        make_optimizer("sgd", 3, momentum=0.9)


@pytest.mark.parametrize("name, config", [
    ("sgd", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    ("adam", {"lr": 0.01, "weight_decay": 0.1}),
    ("adamw", {"lr": 0.01, "weight_decay": 0.1}),
])
def test_decay_spans_decay_inside_and_nowhere_else(name, config):
    """set_decay_spans (nanoGPT's groups: matrices decay, biases and norms do not): inside the
    spans each element follows the rule with weight decay, outside it the rule without, bit for
    bit, across several steps and with the range cut into pieces and blocks."""
    rng = np.random.default_rng(3)
    n = 40000  # more than one host block
    start = rng.standard_normal(n)
    grads = [rng.standard_normal(n) for _ in range(3)]
    spans = [(0, 7), (100, 20000), (39990, 40000)]
    inside = np.zeros(n, bool)
    for a, b in spans:
        inside[a:b] = True
    results = {}
    for label, wd, use_spans in (("all", config["weight_decay"], False), ("none", 0.0, False),
                                 ("spans", config["weight_decay"], True)):
        opt = make_optimizer(name, n, dtype=np.float64, **{**config, "weight_decay": wd})
        if use_spans:
            opt.set_decay_spans(spans)
        p = start.copy()
        for g in grads:
            opt.step([p[:12345], p[12345:]], [g[:12345], g[12345:]])
        results[label] = p
    np.testing.assert_array_equal(results["spans"][inside], results["all"][inside])
    np.testing.assert_array_equal(results["spans"][~inside], results["none"][~inside])
    assert not np.array_equal(results["all"], results["none"])
