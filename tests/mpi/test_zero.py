"""ZeRO levels 0/1/2 on N ranks train the same parameters as one process on the global batch.

The reference runs in every rank's own process on MPI.COMM_SELF (a real size-1 context), on
the whole global batch; the distributed run gives each rank its part. In float64 the two differ
only by the order in which the batch's gradient contributions are summed (one matmul over B rows
vs N matmuls over B/N rows plus a cross-rank sum): about 1e-16 relative per step, and Adam's
division by sqrt(v) can magnify that on near-zero gradients, so we allow rtol 1e-9, atol 1e-12.
In float32 the same argument gives about 1e-7 per step; we allow 2e-5 after 4 steps.
After every step every rank must hold bit-identical parameters.
"""

import contextlib
import math
import threading
import time
import types

import numpy as np
import pytest
from conftest import same_on_every_rank
from mpi4py import MPI

from meta_dist import MPIConnector
from meta_dist.comm.mpi_backend import MpiCommunicator
from meta_dist.config import load_config
from meta_dist.distributed import DistContext
from meta_dist.errors import UsageError
from meta_dist.models.gpt import gpt
from meta_dist.nn.init import deferred
from meta_dist.nn.layers import Linear, ReLU, Tanh
from meta_dist.nn.losses import cross_entropy_tokens, mse_loss, softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.nn.norm import BatchNorm
from meta_dist.train import Trainer
from meta_dist.train.build import resolve_overlap
from meta_dist.train.guard import NonFiniteError

STEPS = 4
GLOBAL_BATCH = 360  # splits over 1-5 ranks x 1-3 micro-batches


def classifier(rng, dtype):  # 25 + 18 = 43 parameters: a prime, so never divisible by N
    return Sequential(Linear(4, 5, rng=rng, dtype=dtype), ReLU(), Linear(5, 3, rng=rng,
                                                                         dtype=dtype))


def tiny_bias(rng, dtype):  # the last bias has 1 element, fewer than N
    return Sequential(Linear(4, 3, rng=rng, dtype=dtype), Tanh(), Linear(3, 1, rng=rng,
                                                                         dtype=dtype))


def one_parameter(rng, dtype):  # a single scalar weight
    return Sequential(Linear(1, 1, bias=False, rng=rng, dtype=dtype))


def deep(rng, dtype):  # five layers, 25 + 24 + 35 + 32 + 15 = 131 parameters
    widths = [4, 5, 4, 7, 4, 3]
    pairs = zip(widths[:-1], widths[1:], strict=True)
    layers = [Linear(a, b, rng=rng, dtype=dtype) for a, b in pairs]
    return Sequential(*[x for layer in layers for x in (layer, Tanh())][:-1])


def tied(rng, dtype):  # 4x5 weight shared by layers 2 and 4 (as a GPT ties its head)
    first = Linear(5, 5, bias=False, rng=rng, dtype=dtype)
    second = Linear(5, 5, bias=False, rng=rng, dtype=dtype)
    second.params["weight"] = first.params["weight"]
    return Sequential(Linear(4, 5, rng=rng, dtype=dtype), Tanh(), first, Tanh(), second, Tanh(),
                      Linear(5, 3, rng=rng, dtype=dtype))


MODELS = {"classifier": (classifier, 4, 3), "tiny_bias": (tiny_bias, 4, None),
          "one_parameter": (one_parameter, 1, None), "deep": (deep, 4, 3), "tied": (tied, 4, 3)}
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
              "adam": {"optimizer": "adam", "lr": 0.01},
              "adamw": {"optimizer": "adamw", "lr": 0.01}}


def make_config(level, optimizer, dtype, bucket_mb=25.0, overlap=True, batch=GLOBAL_BATCH,
                **train):
    return load_config(
        {**OPTIMIZERS[optimizer], "dtype": dtype, "batch_size": batch, **train},
        {"zero_opt_level": level, "bucket_size_mb": bucket_mb, "overlap_comm": overlap,
         "backend": "mpi", "device": "cpu"})


def data(model_name, dtype):
    _, inputs, classes = MODELS[model_name]
    rng = np.random.default_rng(123)
    x = rng.standard_normal((STEPS * GLOBAL_BATCH, inputs)).astype(dtype)
    if classes:
        return x, rng.integers(0, classes, len(x)), softmax_cross_entropy
    return x, rng.standard_normal((len(x), 1)).astype(dtype), mse_loss


def trainer_on(context, model_name, config, dtype, loss_fn):
    model = MODELS[model_name][0](np.random.default_rng(7), dtype)
    return Trainer(model, config, context=context, loss_fn=loss_fn, log=None)


@pytest.fixture(scope="module")
def contexts():
    world = DistContext(MPIConnector(abort_on_exception=False), backend="mpi")
    alone = DistContext(MPIConnector(MPI.COMM_SELF, abort_on_exception=False), backend="mpi")
    yield world, alone
    world.close()
    alone.close()


def run_parity(contexts, level, optimizer, model_name, dtype, rtol, atol, reference=None,
               **config_kw):
    """Train on N ranks and in one process (``reference``: its train_config keys) in step."""
    world, alone = contexts
    x, y, loss_fn = data(model_name, dtype)
    dist = trainer_on(world, model_name, make_config(level, optimizer, dtype, **config_kw),
                      dtype, loss_fn)
    ref = trainer_on(alone, model_name, make_config(0, optimizer, dtype, **(reference or {})),
                     dtype, loss_fn)
    b, r = GLOBAL_BATCH // world.size, world.rank
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        ref.train_step(x[batch], y[batch])
        mine = slice(step * GLOBAL_BATCH + r * b, step * GLOBAL_BATCH + (r + 1) * b)
        dist.train_step(x[mine], y[mine])
        assert same_on_every_rank(world.connector, dist.stage.full_params()), f"step {step}"
        for (name, got), want in zip(dist.parameters().items(), ref.parameters().values(),
                                     strict=True):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                       err_msg=f"{name} after step {step + 1}")
    return dist


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("model_name", ["classifier", "tiny_bias", "one_parameter"])
def test_level_matches_single_process_float64(contexts, level, optimizer, model_name):
    run_parity(contexts, level, optimizer, model_name, "float64", 1e-9, 1e-12)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_mb", [1e-4, 3e-4])
def test_many_buckets_with_and_without_overlap(contexts, level, overlap, bucket_mb):
    # 1e-4 MiB = 13 float64 elements, 3e-4 = 39: several buckets (the 43-parameter classifier
    # has two layers, so buckets of whole layers), padding between them at 2-4 ranks
    dist = run_parity(contexts, level, "adam", "classifier", "float64", 1e-9, 1e-12,
                      bucket_mb=bucket_mb, overlap=overlap)
    assert len(dist.stage.flat.buckets) >= 2


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_mb, micro", [(25.0, 1), (1e-4, 1), (1e-4, 2)])
def test_tied_parameters_train_as_one(contexts, level, overlap, bucket_mb, micro):
    """A weight two layers share is one parameter in one shard at every level, its gradient
    the sum of both uses (tests/unit/test_partition.py checks that sum against finite
    differences in one process): one bucket, many (the tied weight cut into blocks), with
    micro-batches, with and without overlap, all train what one process trains."""
    dist = run_parity(contexts, level, "adam", "tied", "float64", 1e-9, 1e-12,
                      bucket_mb=bucket_mb, overlap=overlap, grad_accum_steps=micro)
    assert sum(1 for name in dist.parameters() if name.endswith("Linear.weight")) == 3


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd"])
def test_weight_decay_on_matrices_only(contexts, level, optimizer):
    """decay_biases_and_norms false (nanoGPT's groups): every level, in several buckets that
    cut layers apart, decays exactly the weight matrices, as one process does; the one
    process's spans are its matrices (tests/unit/test_optim.py checks what spans do)."""
    train = {"weight_decay": 0.1, "decay_biases_and_norms": False}
    dist = run_parity(contexts, level, optimizer, "classifier", "float64", 1e-9, 1e-12,
                      reference=train, bucket_mb=1e-4, **train)
    one = Trainer(MODELS["classifier"][0](np.random.default_rng(7), "float64"),
                  make_config(0, optimizer, "float64", **train), context=contexts[1], log=None)
    matrices = [(s.offset, s.offset + s.numel) for s in one.stage.flat.slots if len(s.shape) == 2]
    assert one.stage.optimizer._decay_spans == matrices and len(matrices) == 2
    assert len(dist.stage.flat.buckets) >= 2


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_a_gpt_with_its_head_tied_to_the_embedding_trains_at_every_level(contexts, level):
    """nanoGPT's shape (the output head shares the token table) through the Trainer: one
    parameter for the tied table, and every level at N ranks, in many buckets, trains what one
    process trains (which tests/unit/test_torch_oracle.py checks against PyTorch)."""
    world, alone = contexts
    vocab, block = 11, 6
    x = np.random.default_rng(0).integers(0, vocab, (STEPS * GLOBAL_BATCH, block))
    y = np.roll(x, -1, axis=1)

    def build(context, at_level):
        return Trainer(gpt(vocab, block, 2, 2, 8, dtype=np.float64, seed=1),
                       make_config(at_level, "adam", "float64", bucket_mb=2e-3),
                       context=context, loss_fn=cross_entropy_tokens, log=None)

    dist = build(world, level)
    assert [n for n in dist.parameters() if "wte" in n or "TiedHead" in n] == [
        "0.TokenAndPosition.wte.weight"]
    assert len(dist.stage.flat.buckets) >= 4
    steps_match_one_process(world, dist, build(alone, 0), x, y, steps=STEPS)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_deep_model_many_buckets(contexts, level, overlap):
    """Six layers in at least four buckets (the default size is capped at a quarter of the
    model): every level, with and without overlap, trains what one process trains."""
    dist = run_parity(contexts, level, "sgd", "deep", "float64", 1e-9, 1e-12, overlap=overlap)
    assert len(dist.stage.flat.buckets) >= 4


@pytest.mark.parametrize("level", [0, 3])
def test_a_bucket_size_past_any_model_builds(contexts, level):
    """bucket_size_mb takes any finite value > 0; 1e308 MiB is inf bytes, which failed with
    OverflowError (cannot convert float infinity to integer) building the stage."""
    run_parity(contexts, level, "adam", "deep", "float64", 1e-9, 1e-12, bucket_mb=1e308)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_level_matches_single_process_float32(contexts, level):
    run_parity(contexts, level, "adam", "classifier", "float32", 2e-5, 2e-6)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_padding_stays_zero(contexts, level):
    dist = run_parity(contexts, level, "adam", "deep", "float64", 1e-9, 1e-12, bucket_mb=1e-4)
    flat, params = dist.stage.flat, dist.stage.full_params()
    padding = np.ones(params.size, bool)
    for slot in flat.slots:
        padding[slot.offset:slot.offset + slot.numel] = False
    if world_size(contexts) > 1:
        assert padding.any()  # 13-element buckets over 2-4 ranks need padding
    assert np.all(params[padding] == 0), "padding changed"


def world_size(contexts):
    return contexts[0].size


def test_memory_report_matches_zero_table(contexts):
    """Each level holds DESIGN.md's bytes for Adam in float64 (padding included): level 1 the
    optimizer state / N, level 2 the gradients / N too, and level 2 never more gradient bytes
    (grads + staging) than level 1."""
    world, _ = contexts
    n = world.size
    x, y, loss_fn = data("deep", "float64")
    reports, padded = {}, {}
    for level in (0, 1, 2, 3):
        t = trainer_on(world, "deep", make_config(level, "adam", "float64"), "float64", loss_fn)
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        reports[level] = t.memory_report()
        buckets = t.stage.flat.buckets
        padded[level] = sum(b.padded_size for b in buckets)
        assert 131 <= padded[level] <= 131 + len(buckets) * (n - 1)  # padding: < N per bucket
    full = padded[0] * 8
    assert (reports[0]["params"], reports[0]["grads"]) == (full, full)
    assert (reports[0]["optimizer"], reports[0]["buffers"]) == (2 * full, 0)
    assert (reports[1]["params"], reports[1]["grads"]) == (full, full)
    assert reports[1]["optimizer"] == 2 * padded[1] * 8 // n
    assert reports[2]["grads"] == padded[2] * 8 // n
    assert reports[2]["optimizer"] == 2 * padded[2] * 8 // n
    assert reports[2]["grads"] + reports[2]["buffers"] <= reports[1]["grads"]
    if n == 1:
        assert reports[2]["buffers"] == 0  # one rank: backward writes into the shard itself
    shard = padded[3] * 8 // n  # level 3: every part of the model state sharded
    assert (reports[3]["params"], reports[3]["grads"]) == (shard, shard)
    assert reports[3]["optimizer"] == 2 * shard


@pytest.mark.parametrize("optimizer,precision,micro,overlap,reshard", [
    ("adam", "fp32", 1, True, True), ("sgd", "fp32", 3, True, True),
    ("adamw", "fp16", 1, False, True), ("adam", "fp32", 3, False, False),
    ("adam", "fp16", 3, True, False)])
def test_the_plan_predicts_what_every_level_holds(contexts, optimizer, precision, micro,
                                                  overlap, reshard):
    """zero.memory.predict (sizes and settings only) equals what the arrays hold, part by
    part, at every level: a buffer the plan does not call for would show as a difference.
    Many small buckets (bucket_mb 2e-4: 13 elements), so staging and gathers are double."""
    world, _ = contexts
    n = world.size
    x, y, loss_fn = data("deep", "float32")
    for level in (0, 1, 2, 3):
        config = load_config(
            {**OPTIMIZERS[optimizer], "dtype": "float32", "batch_size": GLOBAL_BATCH,
             "precision": precision, "grad_accum_steps": micro},
            {"zero_opt_level": level, "bucket_size_mb": 2e-4, "overlap_comm": overlap,
             "reshard_after_forward": reshard, "backend": "mpi", "device": "cpu"})
        t = trainer_on(world, "deep", config, "float32", loss_fn)
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        held = {k: v for k, v in t.memory_report().items() if k != "peak"}
        assert t.predicted_memory() == held, (level, n)
        if level == 2 and micro == 1 and n > 1:  # staging: 1 bucket, or 2 half-size ones
            assert 0 < held["buffers"] <= 2 * max(b.padded_size for b in t.stage.flat.buckets) \
                * t.stage.flat.dtype.itemsize
        assert t.memory_report()["peak"] > 0


@pytest.mark.parametrize("level", [0, 3])
def test_the_trainer_follows_the_lr_schedule(contexts, level):
    """fit() sets each optimizer step's learning rate from the schedule: cosine with two warmup
    steps over the whole run (two epochs), as schedule.learning_rate's closed form says."""
    from meta_dist.train.schedule import learning_rate

    world, _ = contexts
    x, y, loss_fn = data("deep", "float64")
    config = load_config({**OPTIMIZERS["sgd"], "dtype": "float64", "batch_size": GLOBAL_BATCH,
                          "n_epoch": 2, "n_mini_batch": STEPS, "lr_schedule": "cosine",
                          "warmup_steps": 2},
                         {"zero_opt_level": level, "backend": "mpi", "device": "cpu"})
    seen, trainer = [], None

    def recording(out, target):  # called after the step's rate is set, before the update
        seen.append(trainer.stage.optimizer.lr)
        return loss_fn(out, target)

    trainer = trainer_on(world, "deep", config, "float64", recording)
    trainer.fit(x, y)
    total = 2 * STEPS
    want = [learning_rate("cosine", config.train.lr, s, total, 2) for s in range(total)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert want[0] < want[2] and want[-1] < want[2]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_accumulation_reduces_once_per_optimizer_step(contexts, level):
    """grad_accum_steps 3 reduces exactly the bytes of one micro-batch per optimizer step
    (DDP's no_sync): each bucket is reduced once per step, not once per micro-batch. Level 3
    gathers the parameters again for every micro-batch's forward and backward (as FSDP does):
    only its reductions are compared."""
    world, _ = contexts
    n = world.size
    x, y, loss_fn = data("deep", "float64")
    moved = []
    for micro in (1, 3):
        config = load_config({**OPTIMIZERS["adam"], "dtype": "float64",
                              "batch_size": GLOBAL_BATCH, "grad_accum_steps": micro},
                             {"zero_opt_level": level, "bucket_size_mb": 1e-4,
                              "backend": "mpi", "device": "cpu"})
        t = trainer_on(world, "deep", config, "float64", loss_fn)
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        t.comm.traffic.reset()
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        moved.append({op: b for op, b in t.comm.traffic.bytes.items()
                      if level < 3 or op != "allgather"})
    assert moved[1] == moved[0]
    assert n == 1 or sum(moved[0].values()) > 0


@pytest.mark.parametrize("bucket_mb", [25.0, 1e-4])
def test_bytes_moved_per_step_by_level(contexts, bucket_mb):
    """Levels 0-2 move 2(N-1)/N of the gradient bytes per step. Level 3 gathers the parameters
    again for backward, all but the groups forward gathered last that its gather buffers still
    hold (one per buffer): up to 1.5x; 1x when it keeps forward's gathers."""
    world, _ = contexts
    n = world.size
    x, y, loss_fn = data("deep", "float64")
    moved = {}
    for level, reshard in ((0, True), (1, True), (2, True), (3, True), (3, False)):
        config = load_config({**OPTIMIZERS["adam"], "dtype": "float64", "batch_size": GLOBAL_BATCH},
                             {"zero_opt_level": level, "bucket_size_mb": bucket_mb,
                              "reshard_after_forward": reshard, "backend": "mpi", "device": "cpu"})
        t = trainer_on(world, "deep", config, "float64", loss_fn)
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        t.comm.traffic.reset()
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        traffic = t.comm.traffic.bytes
        guard = 2 * (n - 1) / n * 4 * 8  # the step guard's four numbers
        padded = sum(b.padded_size for b in t.stage.flat.buckets)
        moved[level, reshard] = (t.comm.traffic.total() - guard) / padded  # level 3 pads more
        gathered = {0: 0, 1: padded, 2: padded}.get(level, padded)
        if level == 3 and reshard:  # backward gathers again all but what a buffer still holds
            assert len(t.stage.groups) >= 4 and t.stage.streamed  # cut layers read by rows
            share = (n - 1) / n * 8
            assert padded * share < traffic["allgather"] <= 2 * padded * share or n == 1
        else:
            assert traffic.get("allgather", 0) == pytest.approx((n - 1) / n * gathered * 8)
        assert traffic.get("reduce_scatter", 0) == pytest.approx(
            (n - 1) / n * padded * 8 if level else 0)
    assert moved[1, True] == pytest.approx(moved[2, True])
    assert moved[3, False] == pytest.approx(moved[2, True])
    assert moved[2, True] < moved[3, True] <= 1.5 * moved[2, True] or n == 1
    if n > 1:
        assert moved[0, True] == pytest.approx(moved[2, True], rel=0.1)  # level 0 pads less


def test_data_parallel_batch_must_split(contexts):
    world, _ = contexts
    if world.size == 1:
        pytest.skip("every batch splits over 1 rank")
    with pytest.raises(ValueError, match="batch_size"):
        trainer_on(world, "classifier", make_config(0, "sgd", "float64", batch=world.size + 1),
                   "float64", softmax_cross_entropy)


def test_overlap_left_to_decide_is_off_on_one_rank(contexts):
    """overlap_comm null: one rank has nothing to overlap (its collectives move nothing), so no
    communication thread, whatever the cores; a setting given is kept."""
    _, alone = contexts
    assert resolve_overlap(None, types.ModuleType("cupy"), alone) is False  # a GPU's rule too
    for setting, want in ((None, False), (True, True), (False, False)):
        trainer = trainer_on(alone, "classifier", make_config(2, "sgd", "float64",
                                                              overlap=setting),
                             "float64", softmax_cross_entropy)
        assert trainer.overlap is want and trainer.stage.overlap is want, setting


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_mb", [25.0, 1e-3, 2e-4])
def test_zero2_staging_is_bounded_by_the_bucket_size(contexts, overlap, bucket_mb):
    """Staging never exceeds the configured bucket size (with overlap: two half-size buffers),
    whatever the model, and ZeRO-2's gradient bytes never exceed ZeRO-1's."""
    world, _ = contexts
    t = trainer_on(world, "deep", make_config(2, "adam", "float64", bucket_mb=bucket_mb,
                                              overlap=overlap), "float64", mse_loss)
    report = t.memory_report()
    level1 = trainer_on(world, "deep", make_config(1, "adam", "float64", bucket_mb=bucket_mb,
                                                   overlap=overlap), "float64", mse_loss)
    assert report["grads"] + report["buffers"] <= level1.memory_report()["grads"]
    # the promise, from the config and the model alone: each staging buffer holds at most its
    # share of one bucket (half with overlap: two buffers), or, where that is less, the fewest
    # whole rows of a layer that split evenly over the ranks (a cut never pads inside a
    # parameter), plus the bucket's padding (fewer than N elements)
    buffers = 2 if overlap and world.size > 1 else 1
    share = bucket_mb * 2**20 / 8 / buffers
    fewest_rows = max(math.lcm(layer.out_features, world.size) for layer in t.model.layers
                      if isinstance(layer, Linear))
    bound = buffers * 8 * (max(share, fewest_rows) + world.size - 1)
    assert report["buffers"] <= bound, (report, bound)


def steps_match_one_process(world, dist, ref, x, y, steps):
    """Take ``steps`` steps on ``dist`` (this rank's part of each global batch) and on ``ref``
    (one process, the whole batch); after each, every parameter must agree to float64."""
    b, r = GLOBAL_BATCH // world.size, world.rank
    for step in range(steps):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        mine = slice(step * GLOBAL_BATCH + r * b, step * GLOBAL_BATCH + (r + 1) * b)
        ref.train_step(x[batch], y[batch])
        dist.train_step(x[mine], y[mine])
        for (name, got), want in zip(dist.parameters().items(), ref.parameters().values(),
                                     strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)


class SlowReduceScatter(MpiCommunicator):
    """The real MPI communicator, its reduce_scatter started late on the communication thread,
    so a staging buffer that backward reuses too early is caught every time, not by chance."""

    def _reduce_scatter(self, send, recv, op):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        super()._reduce_scatter(send, recv, op)


def test_zero2_waits_before_reusing_a_staging_buffer(contexts):
    """Six buckets through two staging buffers, each reduction delayed: a stage that reused a
    buffer before its reduction finished would reduce the wrong gradients."""
    world, alone = contexts
    slow = SlowReduceScatter(world.connector)
    try:
        config = make_config(2, "sgd", "float64", bucket_mb=1e-4)
        x, y, loss_fn = data("deep", "float64")
        dist = Trainer(MODELS["deep"][0](np.random.default_rng(7), "float64"), config,
                       context=world, loss_fn=loss_fn, log=None)
        dist.stage.comm = slow
        ref = trainer_on(alone, "deep", make_config(0, "sgd", "float64"), "float64", loss_fn)
        assert len(dist.stage.flat.buckets) >= 4 and len(dist.stage._staging.buffers) in (0, 2)
        steps_match_one_process(world, dist, ref, x, y, steps=2)
    finally:
        slow.close()


class SlowAllgather(MpiCommunicator):
    """The real MPI communicator, its allgathers started late on the communication thread, so
    a level-3 layer that reads its gather buffer before the prefetched gather has landed is
    caught every time, not by chance."""

    def _allgather(self, send, recv):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)
        super()._allgather(send, recv)


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_waits_for_each_prefetched_gather(contexts, reshard):
    """Level 3 with prefetching (overlap on), many buckets, each gather delayed: a stage that
    computed with a bucket before its allgather finished would train on stale parameters."""
    world, alone = contexts
    slow = SlowAllgather(world.connector)
    try:
        config = load_config({**OPTIMIZERS["sgd"], "dtype": "float64", "batch_size": GLOBAL_BATCH},
                             {"zero_opt_level": 3, "bucket_size_mb": 1e-4, "overlap_comm": True,
                              "reshard_after_forward": reshard, "backend": "mpi",
                              "device": "cpu"})
        x, y, loss_fn = data("deep", "float64")
        dist = trainer_on(world, "deep", config, "float64", loss_fn)
        dist.stage.comm = slow
        ref = trainer_on(alone, "deep", make_config(0, "sgd", "float64"), "float64", loss_fn)
        assert len(dist.stage.flat.buckets) >= 4
        steps_match_one_process(world, dist, ref, x, y, steps=2)
    finally:
        slow.close()


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_per_rank_seeds_train_rank_0s_model(contexts, level):
    """Each rank draws its own initial weights (a per-rank seed): the trainer gives every rank
    rank 0's, so training equals one process that started from rank 0's seed."""
    world, alone = contexts
    x, y, loss_fn = data("deep", "float64")
    mine = Trainer(MODELS["deep"][0](np.random.default_rng(7 + world.rank), "float64"),
                   make_config(level, "adam", "float64"), context=world, loss_fn=loss_fn,
                   log=None)
    ref = trainer_on(alone, "deep", make_config(0, "adam", "float64"), "float64", loss_fn)
    b, r = GLOBAL_BATCH // world.size, world.rank
    for step in range(STEPS):
        ref.train_step(x[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH],
                       y[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        mine.train_step(x[step * GLOBAL_BATCH + r * b:step * GLOBAL_BATCH + (r + 1) * b],
                        y[step * GLOBAL_BATCH + r * b:step * GLOBAL_BATCH + (r + 1) * b])
        assert same_on_every_rank(world.connector, mine.stage.full_params())
        for (name, got), want in zip(mine.parameters().items(), ref.parameters().values(),
                                     strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)


def test_buffers_start_as_rank_0s(contexts):
    world, _ = contexts
    model = Sequential(Linear(4, 3, rng=np.random.default_rng(world.rank), dtype="float64"),
                       BatchNorm(3, dtype="float64"))
    model.layers[1].running_mean[...] = world.rank + 1.0
    Trainer(model, make_config(1, "sgd", "float64"), context=world, loss_fn=mse_loss, log=None)
    np.testing.assert_array_equal(model.layers[1].running_mean, np.ones(3))
    assert same_on_every_rank(world.connector, model.layers[0].params["weight"])


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_configs_refuse_to_train(contexts):
    world, _ = contexts
    config = load_config({"optimizer": "sgd", "lr": 0.1 if world.rank == 0 else 0.5,
                          "batch_size": GLOBAL_BATCH}, {"backend": "mpi", "device": "cpu"})
    with pytest.raises(ValueError) as err:
        trainer_on(world, "classifier", config, "float32", softmax_cross_entropy)
    text = str(err.value)
    assert "train_config.lr: rank 0 0.1 (script dict), rank 1 0.5 (script dict)" in text, text
    assert "meta_dist_config" not in text.split(";")[0]  # only the key that differs


@pytest.mark.parametrize("level", [0, 2])
@pytest.mark.parametrize("mode", ["stop", "skip", "ignore", "ignore with clipping"])
def test_a_nan_in_one_ranks_input(contexts, level, mode):
    """A NaN in one input row of the last rank: 'stop' raises on every rank naming the step and
    the rank; 'skip' leaves that step's update out on every rank and counts it; 'ignore'
    updates with it, as without a check (with clipping too: it skipped that step silently)."""
    world, _ = contexts
    clip = {"clip_grad_norm": 1.0} if mode == "ignore with clipping" else {}
    mode = mode.split()[0]
    config = load_config({"optimizer": "sgd", "lr": 0.1, "batch_size": GLOBAL_BATCH,
                          "n_epoch": 1, "n_mini_batch": STEPS, "dtype": "float32", **clip},
                         {"zero_opt_level": level, "nonfinite": mode, "backend": "mpi",
                          "device": "cpu"})
    x, y, _ = data("classifier", "float32")
    bad = world.size - 1
    order = np.random.default_rng([0, 0]).permutation(len(x))  # the sampler's epoch 0
    row = order[GLOBAL_BATCH + bad * (GLOBAL_BATCH // world.size)]  # step 2, last rank's first
    x = x.copy()
    x[row, 1] = np.nan
    trainer = trainer_on(world, "classifier", config, "float32", softmax_cross_entropy)
    if mode == "stop":
        with pytest.raises(NonFiniteError, match=rf"non-finite loss at epoch 1 step 2: on rank "
                                                 rf"{bad} \(rank {bad}: nan\)"):
            trainer.fit(x, y)
        return
    losses = trainer.fit(x, y)
    assert np.isnan(losses[0])
    if mode == "ignore":  # no check: the NaN reaches the weights, on every rank alike
        assert trainer.guard.skipped == 0
        assert not all(np.isfinite(p).all() for p in trainer.parameters().values())
        return
    assert trainer.guard.skipped == 1
    assert all(np.isfinite(p).all() for p in trainer.parameters().values())
    assert same_on_every_rank(world.connector, trainer.stage.full_params())



@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("micro", [2, 3])
@pytest.mark.parametrize("overlap", [True, False])
def test_accumulated_micro_batches_equal_one_batch(contexts, level, micro, overlap):
    """k micro-batches of b equal one batch of k*b (no batch statistics), every level, with
    buckets small enough that later micro-batches go through staging bucket by bucket."""
    run_parity(contexts, level, "adam", "deep", "float64", 1e-9, 1e-12, overlap=overlap,
               bucket_mb=2e-4, grad_accum_steps=micro)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_clipping_by_the_global_norm(contexts, level):
    """Clipped training equals the clipped single process at every level (each gradient
    counted once in the norm, whichever rank holds it), and the clip is active."""
    clip = {"clip_grad_norm": 0.05}
    dist = run_parity(contexts, level, "sgd", "deep", "float64", 1e-9, 1e-12, reference=clip,
                      bucket_mb=2e-4, **clip)
    assert dist.guard.norm > 0.05  # the last step's norm, before clipping: the clip bit
    free = run_parity(contexts, level, "sgd", "deep", "float64", 1e-9, 1e-12, bucket_mb=2e-4)
    assert not np.allclose(dist.stage.full_params(), free.stage.full_params())


def half_config(level, precision, **extra):
    return load_config({"optimizer": "adam", "lr": 0.01, "batch_size": GLOBAL_BATCH,
                        "precision": precision, "n_epoch": 3, "n_mini_batch": STEPS, **extra},
                       {"zero_opt_level": level, "bucket_size_mb": 2e-4, "backend": "mpi",
                        "device": "cpu"})


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_levels_agree_and_learn(contexts, precision):
    if precision == "bf16":
        pytest.importorskip("ml_dtypes", reason="bf16 on the CPU needs ml_dtypes")
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    history = {}
    for level in (0, 1, 2, 3):
        trainer = trainer_on(world, "deep", half_config(level, precision), "float32", loss_fn)
        assert trainer.stage.full_params().dtype.itemsize == 2
        assert all(m.dtype == np.float32 for m in trainer.stage.master)
        history[level] = trainer.fit(x, y)
        assert same_on_every_rank(world.connector, trainer.stage.full_params())
    assert history[0][-1] < history[0][0]  # it learns
    for level in (1, 2, 3):
        np.testing.assert_allclose(history[level], history[0], rtol=2e-2)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_gpt_in_mixed_precision_learns_alike_at_every_level(contexts, precision):
    """The tied GPT with 16-bit parameters and float32 master weights: every level learns,
    the replicas stay identical, and the levels' losses agree to 16-bit rounding."""
    if precision == "bf16":
        pytest.importorskip("ml_dtypes", reason="bf16 on the CPU needs ml_dtypes")
    world, _ = contexts
    vocab, block = 11, 6
    x = np.random.default_rng(0).integers(0, vocab, (STEPS * GLOBAL_BATCH, block))
    y = (x + 1) % vocab  # learnable from the current token (a causal model sees no later one)
    history = {}
    for level in (0, 1, 2, 3):
        trainer = Trainer(gpt(vocab, block, 2, 2, 8, dtype=np.float32, seed=1),
                          half_config(level, precision), context=world,
                          loss_fn=cross_entropy_tokens, log=None)
        assert trainer.stage.full_params().dtype.itemsize == 2
        history[level] = trainer.fit(x, y)
        assert same_on_every_rank(world.connector, trainer.stage.full_params())
    assert history[0][-1] < history[0][0] - 0.1  # it learns
    for level in (1, 2, 3):
        np.testing.assert_allclose(history[level], history[0], rtol=2e-2)


@pytest.mark.parametrize("level", [0, 2, 3])
def test_a_model_built_deferred_trains_as_one_built_at_once(contexts, level):
    """nn.init.deferred(): a recipe per parameter until the Trainer takes the model (level 3
    draws only its shards' elements). A per-rank seed still trains rank 0's model (its
    recipes are sent). Step for step one process's training of the eagerly built model."""
    world, alone = contexts
    x, y, loss_fn = data("deep", "float64")
    with deferred():
        model = MODELS["deep"][0](np.random.default_rng(7 + world.rank), "float64")
    dist = Trainer(model, make_config(level, "adam", "float64", bucket_mb=2e-4),
                   context=world, loss_fn=loss_fn, log=None)
    ref = trainer_on(alone, "deep", make_config(0, "adam", "float64"), "float64", loss_fn)
    steps_match_one_process(world, dist, ref, x, y, steps=2)


@pytest.mark.parametrize("level", [0, 3])
def test_a_gpt_built_deferred_is_the_gpt_built_at_once(contexts, level):
    """The GPT's nanoGPT values (drawn after construction, zero biases, the head tied to the
    token table) survive deferral: the same parameters, bit for bit, after two steps."""
    world, _ = contexts
    vocab, block = 11, 6
    x = np.random.default_rng(0).integers(0, vocab, (2 * GLOBAL_BATCH, block))
    y = (x + 1) % vocab
    params = []
    for lazy in (False, True):
        with deferred() if lazy else contextlib.nullcontext():
            model = gpt(vocab, block, 2, 2, 8, dtype=np.float64, seed=3)
        config = load_config({**OPTIMIZERS["adam"], "dtype": "float64", "batch_size": 60},
                             {"zero_opt_level": level, "bucket_size_mb": 1e-3,
                              "backend": "mpi", "device": "cpu"})
        trainer = Trainer(model, config, context=world, loss_fn=cross_entropy_tokens, log=None)
        mine = slice(world.rank * (60 // world.size), (world.rank + 1) * (60 // world.size))
        for step in range(2):
            batch = slice(step * 60, (step + 1) * 60)
            trainer.train_step(x[batch][mine], y[batch][mine])
        params.append(trainer.stage.full_params())
    np.testing.assert_array_equal(params[1], params[0])


@pytest.mark.mpi(min_size=2)
def test_data_that_differs_between_ranks_is_refused_on_every_rank(contexts):
    """Each rank takes its part of every batch from the whole dataset by index: a file that
    differs on one node trained on batches nobody meant, without a word (or failed deep in a
    collective when the sizes differed). Now every rank refuses it before the first step,
    naming each rank's data."""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    y = y.copy()
    if world.rank == world.size - 1:
        y[-1] = (y[-1] + 1) % MODELS["deep"][2]  # one label of one sample
    trainer = trainer_on(world, "deep", half_config(0, "fp32", n_epoch=1), "float32", loss_fn)
    before = trainer.stage.full_params().copy()
    with pytest.raises(UsageError, match=rf"fit: the ranks hold different data \(rank 0: "
                                         rf"{len(x)} samples of shape .*rank {world.size - 1}: "
                                         r".*give every node the same data file"):
        trainer.fit(x, y)
    np.testing.assert_array_equal(trainer.stage.full_params(), before)


def test_labels_that_do_not_match_the_samples_are_refused_before_the_first_step(contexts):
    """One label short: an IndexError on the rank whose batch reached past y's end, steps
    into the epoch. Now every rank refuses it before the first step."""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    trainer = trainer_on(world, "deep", half_config(0, "fp32", n_epoch=1), "float32", loss_fn)
    before = trainer.stage.full_params().copy()
    with pytest.raises(UsageError, match=rf"fit: x and y differ in length; got {len(x)} "
                                         rf"samples and {len(x) - 1} labels"):
        trainer.fit(x, y[:-1])
    np.testing.assert_array_equal(trainer.stage.full_params(), before)


@pytest.mark.mpi(min_size=2)
def test_fp16_overflow_skips_the_same_step_on_every_rank(contexts):
    """An infinite input feature on the last rank at step 2 leaves the loss finite (the first
    tanh saturates) and the gradients not (inf * 0): every rank skips that step, the loss scale
    halves everywhere, and training goes on with finite weights. (A finite huge row, 6e4, only
    saturated the tanh: its gradient was zero, and the test passed only because the first step
    overflowed at the initial scale, 2**16, which is inf in float16.)"""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    x = x.copy()
    order = np.random.default_rng([0, 0]).permutation(len(x))
    x[order[GLOBAL_BATCH + (world.size - 1) * (GLOBAL_BATCH // world.size)], 0] = np.inf
    trainer = trainer_on(world, "deep", half_config(1, "fp16", n_epoch=1), "float32", loss_fn)
    scale = trainer.scaler.scale
    trainer.fit(x, y)
    assert trainer.guard.skipped == 1 and trainer.scaler.scale == scale / 2
    assert same_on_every_rank(world.connector, np.array([trainer.scaler.scale]))
    assert np.isfinite(trainer.stage.full_params().astype(np.float32)).all()


@pytest.mark.parametrize("loss_scale", ["dynamic", 65536.0])
def test_fp16_trains_at_the_initial_scale(contexts, loss_scale):
    """The dynamic scale starts at 2**16 (PyTorch's GradScaler's too), which float16 cannot
    hold: the scaled gradient is made in float32 and rounded once, so ordinary data skips no
    step. Before, every run's first step was skipped, and a fixed scale of 65536 never
    trained (NonFiniteError)."""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    config = half_config(2, "fp16", n_epoch=1, loss_scale=loss_scale)
    trainer = trainer_on(world, "deep", config, "float32", loss_fn)
    before = trainer.stage.full_params().astype(np.float32)
    trainer.fit(x, y)
    assert trainer.guard.skipped == 0 and trainer.scaler.scale == 2.0**16
    assert (trainer.stage.full_params().astype(np.float32) != before).any()


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_fp16_ranks_overflow_no_sooner_than_one_process(contexts, level):
    """A fixed loss scale at which one process's float16 gradients fit (the largest, scaled,
    is about 44,000 of 65,504 here) trains without a skip on N ranks too: the average of the
    ranks' gradients no longer sums N scaled gradients in float16 first, which overflowed
    from 2 ranks up (every step skipped, then NonFiniteError)."""
    world, alone = contexts
    x, y, loss_fn = data("deep", "float32")
    for context in (alone, world):
        config = half_config(level, "fp16", n_epoch=1, loss_scale=200000.0)
        trainer = trainer_on(context, "deep", config, "float32", loss_fn)
        trainer.fit(x, y)
        assert trainer.guard.skipped == 0, f"{context.size} rank(s)"
        assert trainer.stage.optimizer.step_count == STEPS


def test_fp16_micro_batches_overflow_no_sooner_than_one_batch(contexts):
    """The same fixed loss scale with the batch cut into 3 micro-batches: float16 holds their
    scaled mean, as one batch's gradient (PyTorch's and DeepSpeed's loss / accumulation
    steps), not their sum, which was 3 times larger and overflowed (every step skipped, then
    NonFiniteError). The skip-free run trains as the one without accumulation does."""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    params = []
    for micro in (1, 3):
        config = half_config(2, "fp16", n_epoch=1, loss_scale=200000.0,
                             grad_accum_steps=micro)
        trainer = trainer_on(world, "deep", config, "float32", loss_fn)
        trainer.fit(x, y)
        assert trainer.guard.skipped == 0, f"{micro} micro-batches"
        params.append(trainer.stage.full_params().astype(np.float32))
    np.testing.assert_allclose(params[1], params[0], atol=2e-3)


@pytest.mark.mpi(min_size=2)
def test_fp16_loss_that_stays_non_finite_stops_like_fp32(contexts):
    """With the loss scale fixed (or at its floor), NaNs in the last rank's input at steps 2
    and 3 are two overflowing steps in a row: with max_skipped_steps 2 the job stops on every
    rank the way fp32 does, naming non-finite, the step and the rank."""
    world, _ = contexts
    x, y, loss_fn = data("deep", "float32")
    x = x.copy()
    order = np.random.default_rng([0, 0]).permutation(len(x))
    last = (world.size - 1) * (GLOBAL_BATCH // world.size)
    for step in (1, 2):  # 0-based: steps 2 and 3
        x[order[step * GLOBAL_BATCH + last], 1] = np.nan
    config = load_config({"optimizer": "adam", "lr": 0.01, "batch_size": GLOBAL_BATCH,
                          "precision": "fp16", "loss_scale": 128, "n_epoch": 1,
                          "n_mini_batch": STEPS},
                         {"zero_opt_level": 2, "bucket_size_mb": 2e-4, "backend": "mpi",
                          "device": "cpu", "max_skipped_steps": 2})
    trainer = trainer_on(world, "deep", config, "float32", loss_fn)
    with pytest.raises(NonFiniteError, match=rf"non-finite loss at epoch 1 step 3: on rank "
                                             rf"{world.size - 1} .*2 steps in a row overflowed"):
        trainer.fit(x, y)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_gathers_just_in_time(contexts, overlap, reshard):
    """Level 3 with and without prefetching on the communication thread, resharding after
    forward or keeping the gathered parameters for backward: one process's training."""
    world, _ = contexts
    config = load_config({**OPTIMIZERS["adam"], "dtype": "float64", "batch_size": GLOBAL_BATCH},
                         {"zero_opt_level": 3, "bucket_size_mb": 1e-4, "overlap_comm": overlap,
                          "reshard_after_forward": reshard, "backend": "mpi", "device": "cpu"})
    x, y, loss_fn = data("deep", "float64")
    dist = trainer_on(world, "deep", config, "float64", loss_fn)
    ref = trainer_on(contexts[1], "deep", make_config(0, "adam", "float64"), "float64", loss_fn)
    stage = dist.stage
    assert stage.flat.flat_params is None and len(stage.groups) >= 4
    assert len(stage._gather) == (2 if reshard and overlap else 1)  # a prefetch buffer
    b, r = GLOBAL_BATCH // world.size, world.rank
    for step in range(STEPS):
        ref.train_step(x[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH],
                       y[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
        dist.train_step(x[step * GLOBAL_BATCH + r * b:step * GLOBAL_BATCH + (r + 1) * b],
                        y[step * GLOBAL_BATCH + r * b:step * GLOBAL_BATCH + (r + 1) * b])
        for (name, got), want in zip(dist.parameters().items(), ref.parameters().values(),
                                     strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=name)
    report = dist.memory_report()
    padded = sum(bk.padded_size for bk in stage.flat.buckets)
    assert report["params"] == padded * 8 // world.size  # only this rank's shard
    assert report["grads"] == padded * 8 // world.size
    assert report["optimizer"] == 2 * padded * 8 // world.size
    whole = [g for i, g in enumerate(stage.groups) if i not in stage.streamed]
    gather = padded if not reshard else max((g["stop"] - g["start"] for g in whole), default=0)
    assert sum(g.nbytes for g in stage._gather) == 8 * gather * len(stage._gather)
    assert bool(stage.streamed) == reshard  # cut Linear layers are read a bucket at a time
    if reshard:  # their piece buffers: one bucket each, two with overlap
        piece = max(b.padded_size for i in stage.streamed for b in stage.groups[i]["buckets"])
        assert [p.nbytes for p in stage._pieces] == [8 * piece] * (2 if overlap else 1)
