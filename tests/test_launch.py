"""Whole jobs under real mpirun: the examples, hostfiles, and what happens when a rank fails."""

import re
import time

import pytest
from mpirun import ROOT, flavour, run


def test_ping_pong_exact():
    result = run(2, ["scripts/distributed/ping_pong.py"], timeout=120)
    assert result.returncode == 0, str(result)
    assert "max error 0.0, mean error 0.0" in result.output, str(result)


def test_exception_on_one_rank_aborts_job_with_traceback():
    start = time.monotonic()
    result = run(4, ["tests/scripts/raise_on_rank1.py"], timeout=120)
    assert not result.timed_out and result.returncode != 0, str(result)
    assert time.monotonic() - start < 30
    assert "[rank 1] uncaught exception" in result.output, str(result)
    assert "RuntimeError: deliberate failure on rank 1" in result.output, str(result)
    assert "unreachable" not in result.output


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("how, code", [("raise", 1), ("exit", 3), ("wrapped", 1)])
def test_a_rank_that_leaves_ends_the_job_with_its_code(when, how, code):
    """Rank 1 raises or calls sys.exit(3) before meta_dist starts MPI or after; the other four
    wait in an allreduce. The job must end within seconds with that rank's exit code (it
    used to hang under both MPIs until the stall report, and lose the code)."""
    start = time.monotonic()
    result = run(5, ["tests/scripts/exit_early.py", when, how], timeout=60)
    assert not result.timed_out and result.returncode == code, str(result)
    assert time.monotonic() - start < 30
    assert "unreachable" not in result.output
    expected = ("RuntimeError: deliberate failure on rank 1" if how != "exit"
                else "[rank 1] exits with code 3 while the job is running; ending the job")
    assert expected in result.output, str(result)


def test_rank_that_skips_a_collective_is_reported_not_hung():
    result = run(2, ["tests/scripts/skip_collective.py"], timeout=120)
    assert not result.timed_out and result.returncode != 0, str(result)
    assert "waited 3 s for the other ranks to reach this collective" in result.output, str(result)


def test_shape_mismatch_names_every_rank():
    result = run(3, ["tests/scripts/mismatch.py"], timeout=120)
    assert not result.timed_out and result.returncode != 0, str(result)
    assert re.search(r"rank 0: allreduce of float32 \(2, 2\); rank 1: allreduce of float32 "
                     r"\(2, 3\); rank 2: allreduce of float32 \(2, 4\)", result.output), str(result)


def test_local_hostfile_launch():
    hostfile = ROOT / "hostfiles" / f"localhost-{flavour()}.txt"
    result = run(4, ["scripts/distributed/ping_pong.py"], hostfile=str(hostfile), timeout=120)
    assert result.returncode == 0, str(result)
    assert "max error 0.0" in result.output


def test_cluster_hostfile_syntax_is_what_this_mpi_reads(tmp_path):
    """The two-node example, its node names replaced by this machine, launches 4 ranks per
    node with the MPI in use (the file's first node only)."""
    lines = [ln for ln in (ROOT / "hostfiles" / f"{flavour()}-cluster.txt").read_text()
             .splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 2
    hostfile = tmp_path / "one-node.txt"
    hostfile.write_text(re.sub(r"^node1", "localhost", lines[0]) + "\n")
    result = run(4, ["scripts/distributed/ping_pong.py"], hostfile=str(hostfile), timeout=120)
    assert result.returncode == 0, str(result)
    assert "max error 0.0" in result.output


def epoch_losses(output):
    return [float(m) for m in re.findall(r"^epoch \d+/\d+  loss ([0-9.]+)", output, re.M)]


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_dist_example_levels_agree_and_loss_falls(ranks):
    losses = {}
    for config in ("dp", "zero1", "zero2", "zero3"):
        result = run(ranks, ["scripts/distributed/dist_example.py", "--config",
                             f"configs/{config}.yaml", "n_epoch=3"], timeout=300)
        assert result.returncode == 0, str(result)
        assert "train_config:" in result.output and "meta_dist_config:" in result.output
        level = config[-1] if config != "dp" else "0"
        assert re.search(rf"^  zero_opt_level += {level} ", result.output, re.M), str(result)
        losses[config] = epoch_losses(result.output)
        assert len(losses[config]) == 3 and losses[config][-1] < losses[config][0], str(result)
        assert result.output.count("  rank ") >= ranks  # every rank's memory line
    # the three levels train the same model: losses agree to float32 rounding
    for config in ("zero1", "zero2", "zero3"):
        assert losses[config] == pytest.approx(losses["dp"], rel=1e-5)


def test_dist_example_with_hostfile():
    hostfile = ROOT / "hostfiles" / f"localhost-{flavour()}.txt"
    result = run(4, ["scripts/distributed/dist_example.py", "zero_opt_level=2", "n_epoch=2"],
                 hostfile=str(hostfile), timeout=300)
    assert result.returncode == 0, str(result)
    assert len(epoch_losses(result.output)) == 2


@pytest.mark.parametrize("args, message", [
    (["zero_opt_level=4"], "zero_opt_level is not a valid choice; got 4, expected one of 0, 1, "),
    (["zero_opt_levle=1"], "Did you mean 'zero_opt_level'"),
    (["batch_size=65"], "does not split across 2 ranks"),
    (["enable_data_parallel=false", "zero_opt_level=1"], "enable_data_parallel"),
    (["--config", "configs/missing.yaml"], "configs/missing.yaml"),
])
def test_dist_example_bad_config_fails_fast_once(args, message):
    result = run(2, ["scripts/distributed/dist_example.py", *args], timeout=120)
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert message in result.output, str(result)
    assert result.output.count("dist_example:") == 1, str(result)  # printed once, by rank 0
    assert "epoch 1" not in result.output


def test_collective_before_init_says_how_to_start():
    result = run(1, ["tests/scripts/before_init.py"], timeout=60)
    assert result.returncode == 0, str(result)
    assert ("refused: meta_dist.allreduce called before init; call meta_dist.init() or "
            "meta_dist.distributed.get_context() first") in result.output, str(result)


def test_async_refused_without_thread_multiple():
    result = run(2, ["tests/scripts/serialized_mpi.py"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count("blocking allreduce: [2.0, 2.0, 2.0]") == 2, str(result)
    for api, times in (("allreduce_async", 4), ("send_async", 2)):
        assert result.output.count(f"refused: {api}: MPI was initialised with thread level "
                                   "'serialized'") == times, str(result)
    assert "accepted" not in result.output, str(result)


def test_thread_levels_must_agree():
    result = run(2, ["tests/scripts/serialized_mpi.py", "mixed"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count("settings differ across ranks: rank 0: thread_level=2; rank 1: "
                               "thread_level=3") == 2, str(result)
    assert "mpi4py.rc.thread_level" in result.output, str(result)


def test_dist_example_trains_on_a_users_npz(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 8, 8)).astype(np.float32)
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=(x.mean(axis=(1, 2, 3)) > 0).astype(np.int64))
    result = run(2, ["scripts/distributed/dist_example.py", f"data_path={path}",
                     "input_shape=[3, 8, 8]", "num_classes=2", "batch_size=16", "n_epoch=2"],
                 timeout=180)
    assert result.returncode == 0, str(result)
    assert re.search(rf"^  data_path += {re.escape(str(path))} ", result.output, re.M), str(result)
    assert len(epoch_losses(result.output)) == 2


@pytest.fixture(scope="module")
def saved_at_4_ranks(tmp_path_factory):
    """A checkpoint written by 4 ranks at ZeRO level 2, mid-epoch (step 3 of 8)."""
    directory = tmp_path_factory.mktemp("checkpoints")
    result = run(4, ["tests/scripts/checkpoint_job.py", "save", str(directory), "2"],
                 timeout=180)
    assert result.returncode == 0, str(result)
    return directory


@pytest.mark.parametrize("ranks, level", [(1, 0), (2, 1), (3, 2), (4, 0), (5, 1)])
def test_resume_a_4_rank_checkpoint_at_any_world_size_and_level(saved_at_4_ranks, ranks,
                                                                level):
    """Saved by 4 ranks at level 2; resumed by 1-5 ranks at levels 0-2: every parameter ends as
    one process trained without stopping ends it (float32 rounding: the per-rank batches
    differ with the world size)."""
    result = run(ranks, ["tests/scripts/checkpoint_job.py", "resume", str(saved_at_4_ranks),
                         str(level)], timeout=180)
    assert result.returncode == 0, str(result)
    assert "resumed from" in result.output and "at epoch 1 step 3" in result.output
    assert "match largest relative difference" in result.output, str(result)


@pytest.mark.parametrize("saved, resumed", [((4, 3), (2, 0)), ((2, 0), (3, 3))])
def test_level_3_checkpoints_resume_at_level_0_and_back(tmp_path, saved, resumed):
    """Sharded parameters saved at level 3 resume with whole ones at level 0, and back."""
    result = run(saved[0], ["tests/scripts/checkpoint_job.py", "save", str(tmp_path),
                            str(saved[1])], timeout=180)
    assert result.returncode == 0, str(result)
    result = run(resumed[0], ["tests/scripts/checkpoint_job.py", "resume", str(tmp_path),
                              str(resumed[1])], timeout=180)
    assert result.returncode == 0, str(result)
    assert "match largest relative difference" in result.output, str(result)


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    from meta_dist import checkpoint

    result = run(3, ["tests/scripts/checkpoint_job.py", "kill", str(tmp_path), "1"], timeout=120)
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert (tmp_path / ".tmp-step-00000004").is_dir()  # cut off: never used
    assert checkpoint.resolve(tmp_path) == tmp_path / "step-00000002"
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    reader = checkpoint.Reader(tmp_path)
    assert reader.manifest["step"] == 2 and reader.whole("params", "0.Linear.weight").shape == (
        6, 9)


def test_checkpoint_cli_needs_no_mpi(saved_at_4_ranks, tmp_path):
    """info and consolidate run as plain python (mpi4py.MPI blocked: importing it fails)."""
    import subprocess
    import sys

    block = "import sys; sys.modules['mpi4py.MPI'] = None; "
    code = (block + "from meta_dist.checkpoint import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "model.npz"
    for args in (["info", str(saved_at_4_ranks)],
                 ["consolidate", str(saved_at_4_ranks), str(out), "--optimizer"]):
        done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
    assert "saved by 4 ranks at ZeRO level 2" in subprocess.run(
        [sys.executable, "-m", "meta_dist.checkpoint", "info", str(saved_at_4_ranks)],
        capture_output=True, text=True, timeout=120, check=False).stdout
    import numpy as np

    with np.load(out) as merged:
        assert merged["0.Linear.weight"].shape == (6, 9)
        assert "optimizer/exp_avg_sq/4.Linear.bias" in merged.files
