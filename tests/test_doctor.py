"""``python -m meta_dist doctor`` under real mpirun: what each rank sees, and its checks."""

import re
import subprocess
import sys

from mpirun import ROOT, another_mpis_env, run


def test_the_doctor_reports_every_rank_and_passes_here():
    result = run(3, ["-m", "meta_dist", "doctor"], timeout=120)
    assert result.returncode == 0, str(result)
    for rank in range(3):
        assert re.search(rf"^  rank {rank} \(local {rank} of 3\) on \S+: .*thread level "
                         r"multiple; CUDA-aware MPI .*; GPU .*; NCCL .*; BLAS threads .*; "
                         "network ", result.output, re.M), str(result)
    for check in ("world size: 3 rank(s), as launched", "ranks per host:", "GPU per rank:",
                  "versions: the same on every rank", "allreduce: 8 KiB summed right"):
        assert f"PASS  {check}" in result.output, str(result)
    assert re.search(r"INFO  bandwidth: rank 0 <-> rank 1 \(the same host, \S+\): [\d.]+ GB/s",
                     result.output), str(result)
    assert "doctor: every check passed" in result.output


def test_the_doctor_fails_a_launch_by_another_mpi():
    """What another MPI's mpirun gives each process (PMI_SIZE=2; MPI alone): FAIL, exit 1."""
    env = another_mpis_env()
    done = subprocess.run([sys.executable, "-m", "meta_dist", "doctor"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL  world size: the launcher started 2 ranks" in done.stdout, done.stdout


def test_an_unknown_command_says_what_there_is():
    done = subprocess.run([sys.executable, "-m", "meta_dist", "docter"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown command 'docter'" in done.stderr, done.stderr
    assert "python -m meta_dist doctor" in done.stderr
