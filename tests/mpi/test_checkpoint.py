"""Checkpoints inside one job: a resumed run equals the uninterrupted one bit for bit (same world
size and level), bad checkpoints fail on every rank before anything changes, and consolidate
writes the live model's parameters."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import same_on_every_rank
from test_zero import deep, make_config

from meta_dist import MPIConnector, checkpoint
from meta_dist.checkpoint import CheckpointError
from meta_dist.config import load_config
from meta_dist.distributed import DistContext
from meta_dist.errors import UsageError
from meta_dist.nn.dropout import Dropout
from meta_dist.nn.layers import Linear, Tanh
from meta_dist.nn.losses import softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.nn.norm import BatchNorm
from meta_dist.train import Trainer
from meta_dist.train.build import model_buffers

STEPS, BATCH = 5, 60


@pytest.fixture(scope="module")
def world():
    context = DistContext(MPIConnector(abort_on_exception=False), backend="mpi")
    yield context
    context.close()


@pytest.fixture
def shared_dir(world, tmp_path):
    """One directory every rank uses (rank 0's temporary directory)."""
    return world.connector.broadcast(str(tmp_path))


def data():
    rng = np.random.default_rng(5)
    return (rng.standard_normal((STEPS * BATCH, 4)).astype(np.float32),
            rng.integers(0, 3, STEPS * BATCH))


def trainer(world, level, optimizer="adam", **train):
    config = make_config(level, optimizer, "float32", bucket_mb=2e-4, batch=BATCH,
                         n_epoch=2, n_mini_batch=3, **train)
    return Trainer(deep(np.random.default_rng(7), "float32"), config, context=world,
                   loss_fn=softmax_cross_entropy, log=None)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("optimizer, precision", [("adam", "fp32"), ("sgd", "fp32"),
                                                  ("adam", "fp16")])
def test_a_resumed_run_equals_the_uninterrupted_one(world, shared_dir, level, optimizer,
                                                    precision):
    """Stopped after 4 of 6 steps (mid-epoch 2) and resumed: the very next batch, the same
    optimizer state, loss scale and schedule: bit for bit the uninterrupted parameters."""
    x, y = data()
    train = {"precision": precision, "lr_schedule": "cosine", "warmup_steps": 2}
    whole = trainer(world, level, optimizer, **train)
    whole.fit(x, y)
    first = trainer(world, level, optimizer, checkpoint_dir=shared_dir, checkpoint_every=4,
                    **train)
    first.fit(x, y)  # saves after step 4, mid-epoch 2 (and after the last, step 6)
    resumed = trainer(world, level, optimizer, checkpoint_dir=shared_dir,
                      resume_from=f"{shared_dir}/step-00000004", **train)
    assert resumed.stage.full_params().tobytes() != whole.stage.full_params().tobytes()
    resumed.fit(x, y)
    np.testing.assert_array_equal(resumed.stage.full_params(), whole.stage.full_params())
    for key in whole.stage.optimizer.state:
        np.testing.assert_array_equal(resumed.stage.optimizer.state[key],
                                      whole.stage.optimizer.state[key])
    if precision == "fp16":
        assert resumed.scaler.state_dict() == whole.scaler.state_dict()
    assert same_on_every_rank(world.connector, resumed.stage.full_params())


def test_dropout_masks_follow_the_step_and_the_rank(world, shared_dir):
    """Masks come from (seed, rank, step, micro-batch): a run resumed mid-epoch equals the
    uninterrupted one bit for bit (the masks were numbered by a per-layer counter that
    checkpoints did not keep, so a resumed run drew the first steps' masks again), and
    data-parallel ranks drop different elements (every rank drew rank 0's)."""
    def with_dropout(**train):
        rng = np.random.default_rng(7)
        model = Sequential(Linear(4, 16, rng=rng, dtype=np.float32), Tanh(),
                           Dropout(0.3, seed=11), Linear(16, 3, rng=rng, dtype=np.float32))
        # 2 micro-batches of 120 / (2 x ranks) samples at 1-5 ranks; 2 epochs of 2 steps
        config = make_config(2, "adam", "float32", bucket_mb=2e-4, batch=2 * BATCH, n_epoch=2,
                             n_mini_batch=2, grad_accum_steps=2, **train)
        return Trainer(model, config, context=world, loss_fn=softmax_cross_entropy, log=None)

    x, y = data()
    whole = with_dropout()
    whole.fit(x, y)
    with_dropout(checkpoint_dir=shared_dir, checkpoint_every=3).fit(x, y)  # steps 3 and 4
    resumed = with_dropout(checkpoint_dir=shared_dir, resume_from=f"{shared_dir}/step-00000003")
    resumed.fit(x, y)
    np.testing.assert_array_equal(resumed.stage.full_params(), whole.stage.full_params())
    masks = world.connector.allgather(whole.model.layers[2].mask)
    assert all(not np.array_equal(masks[0], m) for m in masks[1:])


def test_the_last_step_is_saved_and_a_new_run_never_replaces_another_runs(world, shared_dir,
                                                                         tmp_path):
    """checkpoint_every 4 over 6 steps also saves step 6 (the end of a run was lost unless a
    multiple of it). A second run in that directory without resume_from would have replaced
    step 4 and 6 and pruned the rest without a word: every rank refuses it before any step. A
    checkpoint_dir that is a file, or inside one, is refused before the first step, not at the
    first save."""
    x, y = data()
    trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=4).fit(x, y)
    saved = sorted(p.name for p in Path(shared_dir).glob("step-*"))
    assert saved == ["step-00000004", "step-00000006"], saved
    again = trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=3)
    before = again.stage.full_params().copy()
    with pytest.raises(UsageError, match=r"fit: train_config.checkpoint_dir \S+ \(set in "
                                         r"script\) holds another run's checkpoints "
                                         r"\(step-00000004, step-00000006\); .*resume_from: "
                                         r"latest"):
        again.fit(x, y)
    assert sorted(p.name for p in Path(shared_dir).glob("step-*")) == saved
    np.testing.assert_array_equal(again.stage.full_params(), before)  # no step taken
    a_file = world.connector.broadcast(str(tmp_path / "a_file"))
    if world.rank == 0:
        Path(a_file).write_text("not a directory")
    world.connector.barrier()
    with pytest.raises(UsageError, match="checkpoint_dir .*a_file .* is a file; expected a "
                                         "directory"):
        trainer(world, 1, checkpoint_dir=a_file, checkpoint_every=4).fit(x, y)
    if world.rank == 0:  # executable: access() let a path through it pass; NotADirectoryError
        Path(a_file).chmod(0o755)  # at the first save, after the steps before it
    world.connector.barrier()
    with pytest.raises(UsageError, match="checkpoint_dir .*a_file/sub .* is inside a file, "
                                         ".*a_file; expected a directory"):
        trainer(world, 1, checkpoint_dir=f"{a_file}/sub", checkpoint_every=4).fit(x, y)
    # /proc grants the mode bits (and root passes access() anyway), yet refuses every mkdir
    with pytest.raises(UsageError, match=r"checkpoint_dir /proc/meta_dist-x .*: nothing can be "
                                         r"made in /proc here \(mkdir: .*\); choose a "
                                         r"writable path"):
        trainer(world, 1, checkpoint_dir="/proc/meta_dist-x", checkpoint_every=4).fit(x, y)


def test_a_checkpoint_dir_another_job_trains_in_is_refused(world, shared_dir):
    """Two jobs in one checkpoint_dir: each save's commit removed every .tmp-step-N, the other
    job's save under way too, and each overwrote the other's latest. While another job holds
    the directory (its rank 0's lock, here taken on rank 0 as that job would), a new run and a
    resume from it are refused on every rank before any step, its files untouched; once that
    job has ended, a resume goes ahead."""
    x, y = data()
    trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=4).fit(x, y)
    under_way = Path(shared_dir) / f"{checkpoint.TMP_PREFIX}00000002"  # the other job's save
    other = checkpoint.hold(shared_dir) if world.rank == 0 else None
    if world.rank == 0:
        (under_way / "rank00000.params.npy").parent.mkdir()
        (under_way / "rank00000.params.npy").write_bytes(b"being written")
    world.connector.barrier()
    for train in ({"checkpoint_every": 3}, {"resume_from": "latest"}):
        again = trainer(world, 1, checkpoint_dir=shared_dir, **train)
        before = again.stage.full_params().copy()
        with pytest.raises(UsageError, match=r"fit: train_config.checkpoint_dir \S+ \(set in "
                                             r"script\) is in use by another job \(pid \d+ on "
                                             r"host .*\.lock\); expected one job per "
                                             r"checkpoint_dir: choose another checkpoint_dir, "
                                             r"or wait for that job to end"):
            again.fit(x, y)
        np.testing.assert_array_equal(again.stage.full_params(), before)  # no step taken
    assert under_way.is_dir()
    if other is not None:
        other.close()  # that job ended
    world.connector.barrier()
    resumed = trainer(world, 1, checkpoint_dir=shared_dir, resume_from="latest",
                      checkpoint_every=4, max_steps=8)
    resumed.fit(x, y)  # from step 6; its save of step 8 removes what is now a cut-off save
    assert resumed.steps_done == 8 and not under_way.exists()


def test_an_interrupt_in_the_directory_checks_leaves_no_lock(world, shared_dir, monkeypatch):
    """Ctrl-C while the ranks agree on the directory checks (their allgather, after rank 0 took
    the lock): the lock stayed open in the traceback's frame, and a second fit in this process
    (an interactive rerun) was refused as "in use by another job" with its own pid."""
    real = world.connector.allgather

    def interrupted(value):
        if value is None:  # check_directories' agreement (no problem here)
            raise KeyboardInterrupt
        return real(value)

    x, y = data()
    monkeypatch.setattr(world.connector, "allgather", interrupted)
    with pytest.raises(KeyboardInterrupt) as caught:  # keeps the traceback, as a REPL does
        trainer(world, 1, checkpoint_dir=shared_dir).fit(x, y)
    monkeypatch.setattr(world.connector, "allgather", real)
    lock = checkpoint.hold(shared_dir) if world.rank == 0 else None  # free again
    assert caught.value is not None
    if lock is not None:
        lock.close()
    world.connector.barrier()


def test_a_resumed_run_replaces_the_checkpoint_of_its_last_step(world, shared_dir):
    """Resumed from step 4 of a run that saved steps 4 and 6, with another lr: its own step 6
    replaces the old one and ``latest`` names it (the old step 6 was kept, its state and lr
    resumed by the next job, because a step-6 manifest existed; only this run's own save of a
    step is not written twice)."""
    x, y = data()
    trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=4).fit(x, y)  # steps 4, 6
    resumed = trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=4, lr=0.003,
                      resume_from=f"{shared_dir}/step-00000004")
    resumed.fit(x, y)  # steps 5 and 6; step 6 saved as the run's last
    latest = checkpoint.Reader(shared_dir)
    assert latest.path.name == "step-00000006"
    assert latest.manifest["optimizer"]["hyperparameters"]["lr"] == 0.003
    for name, value in resumed.parameters().items():
        np.testing.assert_array_equal(latest.whole("params", name), value)


def test_resuming_a_finished_run_trains_no_further(world, shared_dir):
    """max_steps 4 ends mid-epoch 2 (3 steps an epoch), its last checkpoint at step 4: a job
    requeued with resume_from latest takes no step (it used to take a fifth and save it)."""
    x, y = data()
    first = trainer(world, 2, checkpoint_dir=shared_dir, checkpoint_every=2, max_steps=4)
    first.fit(x, y)
    lines = []
    resumed = trainer(world, 2, checkpoint_dir=shared_dir, checkpoint_every=2, max_steps=4,
                      resume_from="latest")
    resumed.log = _Lines(lines) if world.rank == 0 else None
    assert resumed.fit(x, y) == [] and resumed.steps_done == 4
    np.testing.assert_array_equal(resumed.stage.full_params(), first.stage.full_params())
    saved = sorted(p.name for p in Path(shared_dir).glob("step-*"))
    assert saved == ["step-00000002", "step-00000004"], saved
    if world.rank == 0:
        assert lines[-1] == "the run is complete: 4 of 4 steps taken; nothing to train"


def test_resume_continues_with_the_next_batch_and_says_so(world, shared_dir):
    x, y = data()
    first = trainer(world, 1, checkpoint_dir=shared_dir, checkpoint_every=4)
    first.fit(x, y)  # 2 epochs of 3 steps: saved after step 4, epoch 2 step 1
    lines = []
    resumed = trainer(world, 1, checkpoint_dir=shared_dir,
                      resume_from=f"{shared_dir}/step-00000004")
    resumed.log = _Lines(lines) if world.rank == 0 else None
    losses = resumed.fit(x, y)
    assert len(losses) == 1 and resumed.steps_done == 6  # epoch 2's last two steps
    if world.rank == 0:
        assert lines[0] == (f"resumed from {shared_dir}/step-00000004 at epoch 2 step 1 "
                            "(changed: train_config.checkpoint_every: 4 -> 0)")
        assert lines[-1].startswith("epoch 2/2  loss ")


def test_consolidate_writes_the_live_parameters(world, shared_dir, tmp_path):
    x, y = data()
    t = trainer(world, 2)
    t.fit(x, y)
    saved = t.save_checkpoint(shared_dir)
    out = tmp_path / "model.npz"  # each rank its own file, read from the shared checkpoint
    checkpoint.consolidate(shared_dir, out, optimizer=True)
    with np.load(out) as merged:
        live = t.parameters()
        assert set(merged.files) >= set(live)
        for name, value in live.items():
            np.testing.assert_array_equal(merged[name], value)
        assert any(f.startswith("optimizer/exp_avg/") for f in merged.files)
    assert "step 6" in checkpoint.info(saved)


@pytest.mark.parametrize("left", ["directory", "file"])
def test_what_a_cut_off_save_left_is_replaced(world, shared_dir, left):
    """A save of step 6 killed midway by a job of 8 ranks left rank 7's file in .tmp-step-6
    (it was committed into the new checkpoint, which then held a file no manifest names); a
    file of that name stopped the save with a FileExistsError traceback."""
    x, y = data()
    t = trainer(world, 1)
    t.fit(x, y)
    tmp = Path(shared_dir) / f"{checkpoint.TMP_PREFIX}00000006"
    if world.rank == 0:
        if left == "directory":
            tmp.mkdir()
            (tmp / "rank00007.params.npy").write_bytes(b"cut off")
        else:
            tmp.write_bytes(b"in the way")
    world.connector.barrier()
    saved = t.save_checkpoint(shared_dir)
    manifest = json.loads((saved / checkpoint.MANIFEST).read_text())
    assert sorted(p.name for p in saved.iterdir()) == sorted(
        [checkpoint.MANIFEST, *manifest["checksums"]])
    assert not tmp.exists()
    for name, value in t.parameters().items():
        np.testing.assert_array_equal(checkpoint.Reader(shared_dir).whole("params", name), value)


def test_batchnorm_statistics_resume_as_rank_0_saved_them(world, shared_dir):
    """Running statistics are per rank (each sees its own batches); the checkpoint keeps rank
    0's, as DDP's broadcast_buffers does, and a resumed run starts every rank from them."""
    def bn_trainer(**train):
        rng = np.random.default_rng(7)
        model = Sequential(Linear(4, 6, rng=rng), BatchNorm(6), Tanh(), Linear(6, 3, rng=rng))
        config = make_config(2, "adam", "float32", bucket_mb=2e-4, batch=BATCH, n_epoch=1,
                             n_mini_batch=3, **train)
        return Trainer(model, config, context=world, loss_fn=softmax_cross_entropy, log=None)

    x, y = data()
    first = bn_trainer(checkpoint_dir=shared_dir)
    first.fit(x, y)  # saved at the epoch's end
    rank0 = world.connector.broadcast({n: np.array(b)
                                       for n, b in model_buffers(first.model).items()})
    assert not np.allclose(rank0["1.BatchNorm.running_mean"], 0)  # it moved while training
    resumed = bn_trainer(resume_from=shared_dir)
    resumed.load_checkpoint(shared_dir)
    for name, array in model_buffers(resumed.model).items():
        np.testing.assert_array_equal(array, rank0[name])
    manifest = json.loads((checkpoint.resolve(shared_dir) / "manifest.json").read_text())
    assert [b["name"] for b in manifest["buffers"]] == ["1.BatchNorm.running_mean",
                                                        "1.BatchNorm.running_var"]
    plain = trainer(world, 2)  # the same checkpoint for a model without BatchNorm: refused
    with pytest.raises(CheckpointError, match="holds another model"):
        plain.load_checkpoint(shared_dir)
    # buffers.npz cut to one of the two: it was blamed on the model ("build the model the
    # checkpoint was saved from"), which is the right one; the file is what changed
    world.connector.barrier()
    if world.rank == 0:
        saved = checkpoint.resolve(shared_dir) / checkpoint.BUFFERS
        np.savez(saved, **{"1.BatchNorm.running_mean": rank0["1.BatchNorm.running_mean"]})
    world.connector.barrier()
    with pytest.raises(CheckpointError, match=r"buffers.npz lacks 1.BatchNorm.running_var, "
                                              r"which manifest.json lists; it was cut"):
        bn_trainer(resume_from=shared_dir).load_checkpoint(shared_dir)


def test_bad_checkpoints_fail_on_every_rank_before_anything_changes(world, shared_dir):
    x, y = data()
    t = trainer(world, 1)
    t.fit(x, y)
    saved = t.save_checkpoint(shared_dir)
    world.connector.barrier()

    def broken(change):
        if world.rank == 0:
            change()
        world.connector.barrier()

    target = trainer(world, 1)
    before = target.stage.full_params().copy()

    def refused(words, path=saved):
        with pytest.raises(CheckpointError, match=words):
            target.load_checkpoint(path)
        np.testing.assert_array_equal(target.stage.full_params(), before)

    other = Trainer(deep(np.random.default_rng(7), "float32"), make_config(
        1, "sgd", "float32", bucket_mb=2e-4, batch=BATCH), context=world,
        loss_fn=softmax_cross_entropy, log=None)
    with pytest.raises(CheckpointError, match="saved with optimizer adam .* this run uses sgd"):
        other.load_checkpoint(saved)
    file = checkpoint.shard_file(saved, 0, "exp_avg")
    data_bytes = file.read_bytes()
    world.connector.barrier()  # every rank has the original before rank 0 breaks it
    broken(lambda: file.write_bytes(data_bytes[:-7]))
    refused("rank00000.exp_avg.npy is not a readable .npy file .*truncated or corrupt")
    flipped = bytearray(data_bytes)
    flipped[-3] ^= 0x10
    broken(lambda: file.write_bytes(bytes(flipped)))
    refused("rank00000.exp_avg.npy does not match its checksum")
    broken(lambda: file.write_bytes(data_bytes))
    broken(lambda: file.unlink())
    refused("rank00000.exp_avg.npy is missing")
    broken(lambda: file.write_bytes(data_bytes))
    original = (saved / "manifest.json").read_text()
    manifest = json.loads(original)
    manifest["params"][0]["shape"] = [9, 9]
    world.connector.barrier()  # every rank has read it before rank 0 rewrites it
    broken(lambda: (saved / "manifest.json").write_text(json.dumps(manifest)))
    refused("holds another model; shapes differ: ")
    broken(lambda: (saved / "manifest.json").write_text(original))
    empty = saved.parent / "empty"
    broken(lambda: (empty / ".tmp-step-00000001").mkdir(parents=True))
    refused("holds no complete checkpoint", empty)
    target.load_checkpoint(saved)  # repaired: it loads


class _Lines:
    def __init__(self, lines):
        self.lines = lines

    def write(self, text):
        self.lines.extend(line for line in text.splitlines() if line)

    def flush(self):
        pass


@pytest.mark.parametrize("reshard", [True, False])
def test_level3_forgets_what_it_gathered_before_a_load(world, shared_dir, reshard):
    """A forward gathers parameters into level 3's buffers (without resharding they stay for
    backward); loading a checkpoint replaces the shards, so the next forward must gather the
    loaded values, not reuse the old ones."""
    x, y = data()
    config = load_config({"optimizer": "adam", "lr": 0.01, "batch_size": BATCH, "n_epoch": 1,
                          "n_mini_batch": 2},
                         {"zero_opt_level": 3, "bucket_size_mb": 2e-4, "backend": "mpi",
                          "device": "cpu", "reshard_after_forward": reshard})
    t = Trainer(deep(np.random.default_rng(7), "float32"), config, context=world,
                loss_fn=softmax_cross_entropy, log=None)
    t.fit(x, y)
    t.save_checkpoint(shared_dir)
    saved_out = t.model.forward(x[:8]).copy()
    t.train_step(x[:BATCH // world.size], y[:BATCH // world.size])  # the shards move on
    t.model.forward(x[:8])  # and a forward gathers them
    t.load_checkpoint(shared_dir)
    np.testing.assert_array_equal(t.model.forward(x[:8]), saved_out)
