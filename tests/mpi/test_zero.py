"""ZeRO levels 0/1/2 on N ranks train the same parameters as one process on the global batch.

The reference runs in every rank's own process on MPI.COMM_SELF (a real size-1 context), on
the whole global batch; the distributed run gives each rank its part. In float64 the two differ
only by the order in which the batch's gradient contributions are summed (one matmul over B rows
vs N matmuls over B/N rows plus a cross-rank sum): about 1e-16 relative per step, and Adam's
division by sqrt(v) can magnify that on near-zero gradients, so we allow rtol 1e-9, atol 1e-12.
In float32 the same argument gives about 1e-7 per step; we allow 2e-5 after 4 steps.
After every step every rank must hold bit-identical parameters.
"""

import numpy as np
import pytest
from conftest import same_on_every_rank
from mpi4py import MPI

from meta_dist import MPIConnector
from meta_dist.config import load_config
from meta_dist.distributed import DistContext
from meta_dist.nn.layers import Linear, ReLU, Tanh
from meta_dist.nn.losses import mse_loss, softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.train import Trainer

STEPS = 4
GLOBAL_BATCH = 12  # divides 1, 2, 3 and 4 ranks


def classifier(rng, dtype):  # 25 + 18 = 43 parameters: a prime, so never divisible by N
    return Sequential(Linear(4, 5, rng=rng, dtype=dtype), ReLU(), Linear(5, 3, rng=rng,
                                                                         dtype=dtype))


def tiny_bias(rng, dtype):  # the last bias has 1 element, fewer than N
    return Sequential(Linear(4, 3, rng=rng, dtype=dtype), Tanh(), Linear(3, 1, rng=rng,
                                                                         dtype=dtype))


def one_parameter(rng, dtype):  # a single scalar weight
    return Sequential(Linear(1, 1, bias=False, rng=rng, dtype=dtype))


MODELS = {"classifier": (classifier, 4, 3), "tiny_bias": (tiny_bias, 4, None),
          "one_parameter": (one_parameter, 1, None)}
OPTIMIZERS = {"sgd": {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
              "adam": {"optimizer": "adam", "lr": 0.01}}


def make_config(level, optimizer, dtype, bucket_mb=25.0, overlap=True, batch=GLOBAL_BATCH):
    return load_config(
        {**OPTIMIZERS[optimizer], "dtype": dtype, "batch_size": batch},
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


def run_parity(contexts, level, optimizer, model_name, dtype, rtol, atol, **config_kw):
    world, alone = contexts
    x, y, loss_fn = data(model_name, dtype)
    dist = trainer_on(world, model_name, make_config(level, optimizer, dtype, **config_kw),
                      dtype, loss_fn)
    ref = trainer_on(alone, model_name, make_config(0, optimizer, dtype), dtype, loss_fn)
    b, r = GLOBAL_BATCH // world.size, world.rank
    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        ref.train_step(x[batch], y[batch])
        mine = slice(step * GLOBAL_BATCH + r * b, step * GLOBAL_BATCH + (r + 1) * b)
        dist.train_step(x[mine], y[mine])
        assert same_on_every_rank(world.connector, dist.stage.flat.flat_params), f"step {step}"
        for (name, got), want in zip(dist.model.state().items(), ref.model.state().values(),
                                     strict=True):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                       err_msg=f"{name} after step {step + 1}")
    return dist


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("model_name", ["classifier", "tiny_bias", "one_parameter"])
def test_level_matches_single_process_float64(contexts, level, optimizer, model_name):
    run_parity(contexts, level, optimizer, model_name, "float64", 1e-9, 1e-12)


@pytest.mark.parametrize("level", [0, 1, 2])
@pytest.mark.parametrize("overlap", [True, False])
def test_many_buckets_with_and_without_overlap(contexts, level, overlap):
    # 1e-4 MiB = 13 float64 elements: every layer is a bucket of its own
    run_parity(contexts, level, "adam", "classifier", "float64", 1e-9, 1e-12,
               bucket_mb=1e-4, overlap=overlap)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_level_matches_single_process_float32(contexts, level):
    run_parity(contexts, level, "adam", "classifier", "float32", 2e-5, 2e-6)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_padding_stays_zero(contexts, level):
    dist = run_parity(contexts, level, "adam", "classifier", "float64", 1e-9, 1e-12,
                      bucket_mb=1e-4)
    flat = dist.stage.flat
    for bucket in flat.buckets:
        padding = flat.flat_params[bucket.start + bucket.numel:bucket.stop]
        assert np.all(padding == 0), f"bucket {bucket.index} padding changed"


def test_memory_report_matches_zero_table(contexts):
    """Level 1 optimizer state = level 0's / N; level 2 grads = level 0's / N (+ staging)."""
    world, _ = contexts
    n = world.size
    x, y, loss_fn = data("classifier", "float64")
    reports = {}
    for level in (0, 1, 2):
        t = trainer_on(world, "classifier", make_config(level, "adam", "float64"), "float64",
                       loss_fn)
        t.train_step(x[:GLOBAL_BATCH // n], y[:GLOBAL_BATCH // n])
        reports[level] = t.memory_report()
    padded = -(-43 // n) * n  # one bucket: 43 params padded to a multiple of N
    full = padded * 8
    assert reports[0] == {"params": full, "grads": full, "optimizer": 2 * full, "buffers": 0,
                          "peak": reports[0]["peak"]}
    assert reports[1]["params"] == full and reports[1]["grads"] == full
    assert reports[1]["optimizer"] == reports[0]["optimizer"] // n
    assert reports[2]["grads"] == reports[0]["grads"] // n
    assert reports[2]["optimizer"] == reports[0]["optimizer"] // n
    # one bucket holds the whole model, so one staging buffer: grads <= level 0's / N + a bucket
    assert reports[2]["buffers"] == full
    assert reports[2]["grads"] + reports[2]["buffers"] <= reports[0]["grads"] // n + full


def test_data_parallel_batch_must_split(contexts):
    world, _ = contexts
    if world.size == 1:
        pytest.skip("every batch splits over 1 rank")
    with pytest.raises(ValueError, match="batch_size"):
        trainer_on(world, "classifier", make_config(0, "sgd", "float64", batch=world.size + 1),
                   "float64", softmax_cross_entropy)


def test_zero2_staging_is_sized_by_buckets(contexts):
    """Many buckets with overlap: two staging buffers, each sized for the buckets it takes."""
    world, _ = contexts
    x, y, loss_fn = data("classifier", "float64")
    t = trainer_on(world, "classifier", make_config(2, "adam", "float64", bucket_mb=1e-4),
                   "float64", loss_fn)
    buckets = t.stage.flat.buckets
    assert len(buckets) == 2  # Linear(4, 5) and Linear(5, 3), one bucket each
    expected = sum(max(b.padded_size for b in buckets[k::2]) for k in range(2)) * 8
    assert t.memory_report()["buffers"] == expected
