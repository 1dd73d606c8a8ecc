"""scripts/distributed/gpu_check.py on the CuPy/NCCL stand-in, so that it cannot rot before a GPU
is lent: every step runs, the summary table is written, and it says the figures are not GPU ones.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import mpi_env

pytestmark = pytest.mark.gpu_standin

ROOT = Path(__file__).resolve().parents[2]


def gpu_check(out, *extra):
    """Run gpu_check.py --standin --quick into ``out``; return (exit status, what it said)."""
    done = subprocess.run(
        [sys.executable, "scripts/distributed/gpu_check.py", "--standin", "--quick",
         "--out", str(out), *extra],
        cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=600, errors="replace")
    return done.returncode, done.stdout + done.stderr


def test_gpu_check_runs_every_step_on_standin(tmp_path):
    out = tmp_path / "check"
    status, said = gpu_check(out, "--ranks", "2")
    assert status == 0, said[-6000:]
    summary = (out / "summary.md").read_text()
    assert "NOT GPU figures" in summary and "STAND-IN" in said
    for step in ("versions", "tests", "collectives", "train"):
        assert f"| {step} | ok |" in summary, summary
        assert (out / f"{step}.txt").is_file()
    assert "standin: True" in (out / "versions.txt").read_text()
    tests = (out / "tests.txt").read_text()
    assert " passed" in tests and " failed" not in tests, tests[-3000:]
    assert "all results right" in (out / "collectives.txt").read_text()
    assert "meta_dist ZeRO-3" in (out / "train.txt").read_text()


def test_one_gpu_runs_the_tests_on_two_ranks_too_and_a_slow_step_is_ended(tmp_path):
    """With one GPU (--ranks 1) the GPU tests run again on two ranks sharing it (MPI staged via
    the host; NCCL's skip, saying why); a step past --step-timeout is ended and reported as
    failed (exit 124) with what it printed, and the script goes on to the next step."""
    out = tmp_path / "one"
    status, said = gpu_check(out, "--ranks", "1")
    assert status == 0, said[-6000:]
    assert "| tests-shared (2 ranks) | ok |" in (out / "summary.md").read_text(), said[-3000:]
    shared = (out / "tests-shared.txt").read_text()
    assert " passed" in shared and " failed" not in shared, shared[-3000:]
    assert "needs a GPU per rank" in shared, shared[-3000:]  # NCCL's tests skip, saying why
    assert "SKIPPED" not in "".join(line for line in shared.splitlines(keepends=True)
                                    if "test_staging.py" in line), shared[-3000:]
    slow = tmp_path / "slow"
    status, said = gpu_check(slow, "--ranks", "1", "--step-timeout", "0.5")
    summary = (slow / "summary.md").read_text()
    assert status == 1, said[-3000:]
    for step in ("tests", "collectives", "train", "tests-shared (2 ranks)"):
        assert f"| {step} | FAILED (exit 124) |" in summary, summary
    assert "[gpu_check: timed out after 0.5 s]" in (slow / "train.txt").read_text()
