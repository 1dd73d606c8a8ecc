"""Whole jobs under real mpirun: the examples, hostfiles, and what happens when a rank fails."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mpirun import ROOT, command_line, finish, flavour, job_processes, mpi_env, run, running, start


def test_ping_pong_exact():
    result = run(2, ["scripts/distributed/ping_pong.py"], timeout=120)
    assert result.returncode == 0, str(result)
    assert "max error 0.0, mean error 0.0" in result.output, str(result)


def test_ping_pong_on_cuda_without_a_gpu_is_one_message():
    """--device cuda imported cupy first: without it, a ModuleNotFoundError traceback on
    every rank."""
    from meta_dist.xp import gpu_count

    if gpu_count():
        pytest.skip("a GPU is visible here: --device cuda runs")
    result = run(2, ["scripts/distributed/ping_pong.py", "--device", "cuda"], timeout=120)
    assert result.returncode == 2, str(result)
    assert "no CUDA device is visible" in result.output, str(result)
    assert "Traceback" not in result.output, str(result)


def test_exception_on_one_rank_aborts_job_with_traceback():
    start = time.monotonic()
    result = run(4, ["tests/scripts/raise_on_rank1.py"], timeout=120)
    assert not result.timed_out and result.returncode != 0, str(result)
    assert time.monotonic() - start < 30
    assert "[rank 1] uncaught exception" in result.output, str(result)
    assert "RuntimeError: deliberate failure on rank 1" in result.output, str(result)
    assert "unreachable" not in result.output


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("how, code", [("raise", 1), ("exit", 3), ("builtin", 3), ("wrapped", 1)])
def test_a_rank_that_leaves_ends_the_job_with_its_code(when, how, code):
    """Rank 1 raises or calls sys.exit(3) (or the builtin exit(3)) before meta_dist starts MPI
    or after; the other four wait in an allreduce. The job must end within seconds with that
    rank's exit code (it used to hang under both MPIs until the stall report, and lose the
    code; the builtin exit hung silently under MPICH before MPI started)."""
    start = time.monotonic()
    result = run(5, ["tests/scripts/exit_early.py", when, how], timeout=60)
    assert not result.timed_out and result.returncode == code, str(result)
    assert time.monotonic() - start < 30
    assert "unreachable" not in result.output
    expected = ("RuntimeError: deliberate failure on rank 1" if code == 1
                else "[rank 1] exits with code 3 while the job is running; ending the job")
    assert expected in result.output, str(result)


def test_a_bare_raise_system_exit_is_not_called_no_error():
    """Rank 1 runs `raise SystemExit(3)` (as `raise SystemExit(main())` does) while the others
    wait in an allreduce. No exit handler can see its code (sys.exit's can), so the report must
    not say its program ended "(no error)", as it did, but name that cause and sys.exit."""
    result = run(3, ["tests/scripts/exit_early.py", "after", "bare"], timeout=60)
    assert not result.timed_out and result.returncode != 0, str(result)
    said = (r"    rank 1: its program ended before any collective with no error meta_dist could "
            r"see \(a clean end, or `raise SystemExit\(n\)`, whose n it cannot see: sys\.exit\(n\) "
            r"ends the job with n\)")
    assert re.search(said, result.output), str(result)
    assert "(no error)" not in result.output and "unreachable" not in result.output


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
                             f"configs/{config}.yaml", "n_epoch=3", "dtype=float64",
                             "optimizer=sgd", "lr=0.002"],
                     timeout=300)
        assert result.returncode == 0, str(result)
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", result.output), "control characters"
        assert "train_config:" in result.output and "meta_dist_config:" in result.output
        level = config[-1] if config != "dp" else "0"
        assert re.search(rf"^  zero_opt_level += {level} ", result.output, re.M), str(result)
        losses[config] = epoch_losses(result.output)
        assert len(losses[config]) == 3 and losses[config][-1] < losses[config][0], str(result)
        assert result.output.count("  rank ") >= ranks  # every rank's memory line
    # the levels train the same model: in float64 they differ by reduction order alone
    # (~1e-15 relative, the multi-rank suite's bound), so the printed 4 decimals are equal.
    # SGD, not the script's Adam: Adam's step hardly changes when every gradient is scaled, so
    # a level that summed where it should average would pass unseen.
    for config in ("zero1", "zero2", "zero3"):
        assert losses[config] == losses["dp"], losses


def test_dist_example_with_hostfile():
    hostfile = ROOT / "hostfiles" / f"localhost-{flavour()}.txt"
    result = run(4, ["scripts/distributed/dist_example.py", "zero_opt_level=2", "n_epoch=2"],
                 hostfile=str(hostfile), timeout=300)
    assert result.returncode == 0, str(result)
    assert len(epoch_losses(result.output)) == 2


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


def train_on_npz(tmp_path, samples):
    """Run dist_example on a file of ``samples`` 3x8x8 images in two classes (batch 16)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((samples, 3, 8, 8)).astype(np.float32)
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=(x.mean(axis=(1, 2, 3)) > 0).astype(np.int64))
    result = run(2, ["scripts/distributed/dist_example.py", f"data_path={path}",
                     "input_shape=[3, 8, 8]", "num_classes=2", "batch_size=16", "n_epoch=2"],
                 timeout=180)
    assert result.returncode == 0, str(result)
    assert re.search(rf"^  data_path += {re.escape(str(path))} ", result.output, re.M), str(result)
    assert len(epoch_losses(result.output)) == 2
    return result


def test_dist_example_trains_on_a_users_npz(tmp_path):
    result = train_on_npz(tmp_path, 64)
    # the docstring's promise: 20% of the file held out, as of the digits (13 of 64 samples;
    # 51 train, 3 steps an epoch), its accuracy printed before and after training
    found = re.findall(r"^held-out accuracy [\d.]+ \(13 samples\) after step (\d+)$",
                       result.output, re.M)
    assert found == ["0", "6"], str(result)


def test_dist_example_trains_on_all_of_a_small_npz(tmp_path):
    """A file with one global batch but not one after 20% held out: all of it trains, no
    accuracy (holding out would make fit refuse the file's 16 samples as 13)."""
    assert "held-out" not in train_on_npz(tmp_path, 16).output


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
    code = (block + "from meta_dist.checkpoint.cli import main; "
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


# ---------------------------------------------------------------- stalls and signals

STALL_S = 5  # tests/scripts/hang.py's stall timeout


@pytest.mark.parametrize("mode, collective, doing", [
    ("loop", r"allreduce #2 \(2 numpy float32 arrays, 0\.0 MiB\)",
     r"rank 2 \(host \S+, pid \d+\): last completed allreduce #1 \(entered [\d.]+ s ago\); "
     r"now in no collective, at:\n.*hang\.py\", line \d+, in <module>"),
    ("gone", r"allreduce #2 \(2 numpy float32 arrays, 0\.0 MiB\)",
     r"rank 2: not responding \(no answer in 2 s"),
    ("zero2", r"reduce_scatter #\d+ \(numpy float32 \(\d+,\)\)",
     r"rank 2 \(host \S+, pid \d+\): last completed \w+ #\d+ \(entered [\d.]+ s ago\); now in no "
     r"collective, at:\n(.*\n)*.*hang\.py\", line \d+, in loss_fn"),
])
def test_a_rank_that_does_not_arrive_is_named(mode, collective, doing):
    """3 ranks, rank 2 never comes: looping in Python (its watchdog still answers), stopped by
    SIGSTOP (it cannot), or stuck in training while the others wait in ZeRO-2's overlapped
    reduce-scatter on the communication thread (timeout from meta_dist_config there, from
    META_DIST_STALL_TIMEOUT otherwise). One report, by rank 0, the lowest waiting rank; the job
    ends non-zero within the timeout + 10 s of the hang."""
    env = mpi_env(**({} if mode == "zero2" else {"META_DIST_STALL_TIMEOUT": str(STALL_S)}))
    result = run(3, ["tests/scripts/hang.py", mode], timeout=120, env=env)
    ended = time.time()
    assert not result.timed_out and result.returncode != 0, str(result)
    begun = float(re.search(r"hang begins at ([\d.]+)", result.output).group(1))
    assert ended - begun < STALL_S + 10, str(result)
    assert re.search(rf"\[rank 0\] {collective}: waited {STALL_S} s for the other ranks",
                     result.output), str(result)
    assert re.search(r"waiting in it: rank 0 for [\d.]+ s, rank 1 for [\d.]+ s\n  not arrived: "
                     r"rank 2\n", result.output), str(result)
    assert re.search(doing, result.output), str(result)
    assert result.output.count("not arrived:") == 1, str(result)  # printed once
    assert "unreachable" not in result.output


def test_ranks_in_different_collectives_are_named():
    """Without the per-call check, rank 2 calls barrier where ranks 0 and 1 allreduce, each
    collective #2 on its rank: the report names the other side as in another collective, not
    as stuck in the network with every rank arrived. Each side's lowest rank may report first
    (rank 0 under Open MPI in our runs, rank 2 once under MPICH): either report says it."""
    env = mpi_env(META_DIST_STALL_TIMEOUT=str(STALL_S), META_DIST_CHECK="0")
    result = run(3, ["tests/scripts/hang.py", "elsewhere"], timeout=120, env=env)
    assert not result.timed_out and result.returncode != 0, str(result)
    done = r"last completed allreduce #1 \(entered [\d.]+ s ago\); now in"
    by_0 = (r"\[rank 0\] allreduce #2 \(numpy float64 \(4,\)\): waited (.*\n)*  waiting in it: "
            r"rank 0 for [\d.]+ s, rank 1 for [\d.]+ s\n  in another collective: rank 2 \(the "
            rf"ranks' calls differ(.*\n)*.*rank 2 \(host \S+, pid \d+\): {done} barrier #2")
    by_2 = (r"\[rank 2\] barrier #2: waited (.*\n)*  waiting in it: rank 2 for [\d.]+ s\n  in "
            r"another collective: ranks 0, 1 \(the ranks' calls differ(.*\n)*.*rank 0 \(host "
            rf"\S+, pid \d+\): {done} allreduce #2")
    assert re.search(by_0, result.output) or re.search(by_2, result.output), str(result)
    assert "not arrived" not in result.output and "unreachable" not in result.output


@pytest.mark.parametrize("where, waits", [
    ("allreduce", r"allreduce #2 \(numpy float64 \(4,\)\)"),
    ("connector", r"MPIConnector\.barrier"),  # as in a checkpoint's save: it hung for ever
    ("recv", r"recv from rank 2 \(numpy float64 \(4,\)\)")])
def test_a_rank_whose_program_ends_is_named_at_once(where, waits):
    """Rank 2's program ends (no error) after collective #1 while ranks 0 and 1 wait for it in
    allreduce #2, in the connector's barrier, or rank 0 in a recv from it: the job ends within
    seconds naming rank 2, not after the stall timeout (300 s here), and no rank says 'not
    responding' of it."""
    env = mpi_env(META_DIST_STALL_TIMEOUT="300")
    result = run(3, ["tests/scripts/hang.py", "exits", where], timeout=120, env=env)
    assert not result.timed_out and result.returncode != 0, str(result)
    said = (rf"\[rank 0\] {waits}: rank 2 ended its program without reaching it (.*\n)*"
            r"    rank 2: its program ended after collective #1 with no error meta_dist could see")
    assert re.search(said, result.output), str(result)
    assert "not responding" not in result.output and "unreachable" not in result.output
    assert result.output.count("ended its program without reaching it") == 1, str(result)


def test_a_stall_in_the_connector_s_collectives_is_reported():
    """Ranks 0 and 1 wait in the connector's barrier (the kind a checkpoint's save and fit's
    checks make) while rank 2 loops in Python: the stall timeout ends the job with one report
    (these waits were watched by nothing: the job hung for ever)."""
    env = mpi_env(META_DIST_STALL_TIMEOUT=str(STALL_S))
    result = run(3, ["tests/scripts/hang.py", "connector"], timeout=120, env=env)
    assert not result.timed_out and result.returncode != 0, str(result)
    said = (r"\[rank 0\] MPIConnector\.barrier: waited 5 s for the other ranks (.*\n)*"
            r"    rank 2 \(host \S+, pid \d+\): last completed allreduce #1 .*now in no collective")
    assert re.search(said, result.output), str(result)
    assert result.output.count("waited 5 s for the other ranks") == 1, str(result)


def test_a_caught_exit_does_not_end_the_job():
    """sys.exit(2) and exit(2) caught by the program, which then goes on: the job ends with 0
    (the recorded code ended the job with 2 at exit, after every rank had finished)."""
    result = run(3, ["tests/scripts/own_exit_paths.py", "caught"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count(" went on") == 3 and "ending the job" not in result.output


def test_an_exit_in_a_thread_does_not_end_the_job():
    """sys.exit(2) in a helper thread ends that thread alone, as in any Python program: the job
    ends with 0 (the code was recorded as the process's and ended the job with 2 at exit)."""
    result = run(3, ["tests/scripts/own_exit_paths.py", "thread"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count(" went on") == 3 and "ending the job" not in result.output


def test_an_exception_shown_by_the_program_s_own_hook_ends_the_job():
    """Rank 2's own sys.excepthook shows its exception in place of meta_dist's: the job still
    ends at once with code 1 (its peers were told its program ended 'with no error', or waited
    for the stall timeout)."""
    env = mpi_env(META_DIST_STALL_TIMEOUT="300")
    result = run(3, ["tests/scripts/own_exit_paths.py", "hook"], timeout=120, env=env)
    assert not result.timed_out and result.returncode == 1, str(result)
    assert "own hook: deliberate failure on rank 2" in result.output, str(result)
    assert ("[rank 2] ends with an uncaught RuntimeError (shown by the program's own "
            "sys.excepthook) while the job is running; ending the job") in result.output
    assert "no error" not in result.output and "unreachable" not in result.output


def test_a_program_that_finalizes_mpi_itself_ends_cleanly():
    """mpi4py scripts often end with MPI.Finalize(); the exit handlers after it must make no MPI
    call (telling the peers of the exit sent an Isend after MPI_Finalize: exit 14)."""
    result = run(2, ["tests/scripts/finalize_itself.py"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count("finalized, rank done") == 2, str(result)
    assert "MPI_Finalize" not in result.output and "after finalizing" not in result.output


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Only rank 2 gets SIGTERM, during step 3: every rank stops after step 3 (they agree in
    the step's verdict exchange), the checkpoint of step 3 is written, one line says so, and
    the job exits 143 (128 + SIGTERM). Then a run resumes from it."""
    result = run(3, ["tests/scripts/stop_signal.py", "planted", str(tmp_path)], timeout=120)
    assert result.returncode == 143, str(result)
    assert result.output.count("stopped by SIGTERM after step 3; checkpoint ") == 1, str(result)
    left = sorted(re.findall(r"rank (\d) left after step (\d+)", result.output))
    assert left == [("0", "3"), ("1", "3"), ("2", "3")], str(result)
    assert (tmp_path / "ckpt" / "step-00000003").is_dir()
    result = run(3, ["tests/scripts/stop_signal.py", "resume", str(tmp_path)], timeout=120)
    assert result.returncode == 0, str(result)
    assert "at epoch 1 step 3" in result.output and "finished training" in result.output


def test_a_signal_after_the_last_step_still_stops(tmp_path):
    """SIGTERM while the epoch's checkpoint is written, after the last step's vote: fit does not
    return as if nothing happened; the job still stops, with that checkpoint, exit 143."""
    result = run(2, ["tests/scripts/stop_signal.py", "late", str(tmp_path)], timeout=120)
    assert result.returncode == 143, str(result)
    assert result.output.count("stopped by SIGTERM after step 10; checkpoint ") == 1, str(result)
    assert "finished training" not in result.output
    assert sorted((tmp_path / "ckpt").glob("step-*")) == [tmp_path / "ckpt" / "step-00000010"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_to_every_rank_stops_training_cleanly(tmp_path, signame):
    """As Slurm does (it signals every task): each rank gets the signal at its own moment;
    they stop after one agreed step with a checkpoint, and the job exits 128 + the signal."""
    number = getattr(signal, signame)
    proc = start(3, ["tests/scripts/stop_signal.py", "outside", str(tmp_path)], timeout=120)
    pids = [tmp_path / f"pid-{r}" for r in range(3)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    for p in pids:  # the ranks this test started, by pid
        os.kill(int(p.read_text()), number)
    result = finish(proc, 120)
    assert result.returncode == 128 + number, str(result)
    found = re.findall(rf"stopped by {signame} after step (\d+); checkpoint ", result.output)
    assert len(found) == 1, str(result)
    left = re.findall(r"rank \d left after step (\d+)", result.output)
    assert left == found * 3, str(result)
    assert (tmp_path / "ckpt" / f"step-{int(found[0]):08d}").is_dir()


def test_ctrl_c_to_mpiexec_stops_training_cleanly(tmp_path):
    """MPICH's mpiexec forwards Ctrl-C (SIGINT) to every rank: one line, exit 130. (Open MPI's
    mpirun instead ends the job itself on SIGINT or SIGTERM: its ranks get SIGTERM and still
    checkpoint, but mpirun no longer forwards their output.)"""
    if flavour() != "mpich":
        pytest.skip("Open MPI's mpirun ends the job itself on SIGINT (see the docstring)")
    proc = start(3, ["tests/scripts/stop_signal.py", "outside", str(tmp_path)], timeout=120)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"pid-{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # mpiexec, which this test started
    result = finish(proc, 120)
    assert result.returncode == 130, str(result)
    assert len(re.findall(r"stopped by SIGINT after step \d+; checkpoint ", result.output)) == 1
    assert "Traceback" not in result.output, str(result)


def test_train_gpt_learns_and_reports_validation_loss():
    """The GPT example on the standard library's characters: validation loss at step 0, every
    eval_every steps and the last step (four decimals), falling; levels 0 and 3 alike."""
    losses = {}
    for level in (0, 3):
        result = run(2, ["scripts/distributed/train_gpt.py", "--config", "configs/gpt-tiny.yaml",
                         "max_steps=20", "eval_every=10", f"zero_opt_level={level}"], timeout=300)
        assert result.returncode == 0, str(result)
        found = re.findall(r"^step (\d+)  train loss [\d.]+  val loss (\d+\.\d{4})  ",
                           result.output, re.M)
        assert [int(s) for s, _ in found] == [0, 10, 20], str(result)
        losses[level] = [float(v) for _, v in found]
        assert losses[level][-1] < losses[level][0] - 0.5, losses
        assert "sample:\ndef " in result.output
    assert losses[0] == losses[3]  # one model, whatever the level (float32, same reductions)


@pytest.mark.parametrize("words", [[], ["--config", "configs/digits.yaml", "zero_opt_level=3"]])
def test_dist_example_learns_real_digits(words):
    """The README's main job as it is (dist_example's defaults), and configs/digits.yaml at
    ZeRO-3: 1797 real handwritten digits, 20% held out; the held-out accuracy goes from chance
    to above 85%, printed once before and once after training. (The default was synthetic
    images on which 32 steps left the accuracy at chance: 0.10, then 0.12.)"""
    result = run(2, ["scripts/distributed/dist_example.py", *words], timeout=300)
    assert result.returncode == 0, str(result)
    found = re.findall(r"^held-out accuracy ([\d.]+) \(359 samples\) after step (\d+)$",
                       result.output, re.M)
    assert [step for _, step in found] == ["0", "220"], str(result)
    assert float(found[0][0]) < 0.3 and float(found[1][0]) > 0.85, found


@pytest.mark.parametrize("user", [None, "2"])
def test_ranks_on_one_node_share_its_cores_between_their_blas_threads(user):
    """Unbound ranks each keep cores // ranks OpenBLAS threads (numpy's default, one per core,
    made 2 ranks of a 2-core machine 25 times slower); a count the user set is left alone."""
    env = mpi_env() if user is None else mpi_env(OPENBLAS_NUM_THREADS=user)
    result = run(2, ["tests/scripts/blas_threads.py"], timeout=120, env=env)
    assert result.returncode == 0, str(result)
    rows = re.findall(r"rank \d blas_threads (\d+) cores (\d+)", result.output)
    assert len(rows) == 2, str(result)
    for threads, cores in rows:
        expected = int(user) if user else max(1, int(cores) // 2)
        assert int(threads) == expected, str(result)


def test_a_trace_shows_every_ranks_phases_and_collectives(tmp_path):
    """meta_dist_config.trace: each rank writes its Chrome trace when fit ends; ``python -m
    meta_dist trace merge`` joins them with one track per rank."""
    folder = tmp_path / "trace"
    result = run(2, ["scripts/distributed/dist_example.py", "n_epoch=1", "n_mini_batch=3",
                     "zero_opt_level=2", f"trace={folder}"], timeout=120)
    assert result.returncode == 0, str(result)
    assert sorted(p.name for p in folder.iterdir()) == ["trace-rank00000.json",
                                                        "trace-rank00001.json"]
    merged = tmp_path / "all.json"
    done = subprocess.run([sys.executable, "-m", "meta_dist", "trace", "merge", str(folder),
                           str(merged)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    events = json.loads(merged.read_text())["traceEvents"]
    tracks = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert [re.sub(r" \(.+\)$", "", t) for t in tracks] == ["rank 0", "rank 1"], tracks
    for rank in (0, 1):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        for phase in ("forward", "backward", "step"):
            assert sum(e["name"] == phase for e in spans) == 3, (rank, phase)
        scatters = [e for e in spans if e["name"] == "reduce_scatter"]
        assert scatters and all(e["args"]["bytes"] > 0 and e["dur"] >= 0 for e in scatters)
        steps = [e for e in spans if e["name"] == "step"]
        assert all(steps[i]["ts"] < steps[i + 1]["ts"] for i in range(2))


def test_a_job_past_its_time_is_ended_with_every_rank():
    """The harness's time limit (tests/mpirun.py ``finish``, which gpu_check.py uses too) ends
    mpirun and every rank: Open MPI gives each rank a process group of its own, so killing
    mpirun's group alone left ranks running, a hung one for good."""
    marker = "time.sleep(600)  # test_a_job_past_its_time"
    proc = start(2, ["-c", f"import time; {marker}"], timeout=600)

    def ranks():
        return [pid for pid in job_processes(proc.pid)[1:]  # not mpirun: its arguments match
                if marker in command_line(pid)]

    deadline = time.monotonic() + 120
    while len(started := ranks()) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.1)
    assert finish(proc, 0.1).timed_out
    deadline = time.monotonic() + 10
    while any(map(running, started)) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILLed: gone as soon as the kernel has taken them down
    assert not any(map(running, started)), f"ranks {started} outlived the job's time limit"


def test_help_under_mpirun_is_printed_once():
    """--help under mpirun printed the usage once per rank; rank 0 prints it, every rank exits 0
    (before MPI starts: the launcher's rank variables say which rank this is)."""
    result = run(3, ["scripts/distributed/dist_example.py", "--help"], timeout=120)
    assert result.returncode == 0, str(result)
    assert result.output.count("usage: dist_example.py") == 1, str(result)
