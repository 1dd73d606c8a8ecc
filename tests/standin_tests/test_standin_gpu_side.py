"""meta_dist's GPU side on the CuPy/NCCL stand-in: the GPU tests of tests/mpi, at 1-4 ranks.

These prove the logic of the GPU path (NCCL backend, host staging, CUDA-aware selection, every
ZeRO level on CuPy arrays, the GPU memory report) on every CI run without a GPU; they say
nothing about its speed. The ranks import the stand-in as ``cupy`` (install.standin_env) and
model four GPUs per host; a test that skips for want of a GPU fails here, since the stand-in
exists so that they run.
"""

import re
import time

import pytest
from mpirun import mpi_env, run
from standin_install import standin_env

pytestmark = pytest.mark.gpu_standin

GPU_TESTS = ["tests/mpi/test_nccl.py", "tests/mpi/test_zero_gpu.py", "tests/mpi/test_staging.py"]
SUITE_TIMEOUT_S = 300
STALL_TIMEOUT_S = 3  # tests/scripts/nccl_stall.py's
NO_GPU_SKIP = re.compile(r"SKIPPED.*(needs NCCL and a GPU|needs a GPU|needs cupy)")


def standin_job_env(tmp_path, **extra):
    return standin_env(mpi_env(META_DIST_STANDIN_DEVICES="4",
                               META_DIST_STANDIN_RENDEZVOUS=str(tmp_path), **extra))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_gpu_tests_pass_on_standin(ranks, tmp_path):
    env = standin_job_env(tmp_path, META_DIST_MPI_SUITE="1")
    result = run(ranks, ["-m", "mpi4py", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                         "-o", "faulthandler_timeout=60", *GPU_TESTS],
                 timeout=SUITE_TIMEOUT_S, env=env)
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert " passed" in result.output, str(result)
    assert not NO_GPU_SKIP.search(result.output), f"GPU tests skipped on the stand-in:\n{result}"


def test_ranks_sharing_a_gpu_take_mpi_on_standin(tmp_path):
    """Two ranks and one modeled GPU: backend auto must choose MPI with host staging and say
    why (NCCL 2.28 refuses two ranks on one device). Needs fewer GPUs than ranks, which the
    4-device runs above never have, so it runs here on its own and must not skip."""
    env = standin_env(mpi_env(META_DIST_STANDIN_DEVICES="1", META_DIST_MPI_SUITE="1",
                              META_DIST_STANDIN_RENDEZVOUS=str(tmp_path)))
    result = run(2, ["-m", "mpi4py", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                     "tests/mpi/test_nccl.py::test_auto_uses_mpi_where_ranks_share_a_gpu"],
                 timeout=SUITE_TIMEOUT_S, env=env)
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert "1 passed" in result.output and "skipped" not in result.output, str(result)


@pytest.mark.parametrize(("mode", "extra", "said"), [
    ("stall", {}, r"\[rank 0\] nccl allreduce #2 \(cupy float32 \(16,\)\): waited 3 s(.|\n)*"
     r"not arrived: ranks 1, 2\n    rank 1 \(host \S+, pid \d+\): last completed allreduce #1 "),
    ("error", {"META_DIST_STANDIN_NCCL_ASYNC_ERROR": "0:2:3"},
     r"NCCL reported an error on rank 0: .*internal error"),
    ("init", {}, r"NCCL communicator creation \(ncclCommInitRank\): waited 3 s"),
])
def test_stalled_nccl_ends_the_job_on_standin(mode, extra, said, tmp_path):
    """A peer that never joins an NCCL call (NCCL has no timeout), an error NCCL reports
    asynchronously, and an init some rank never finishes each end the job, saying what waited,
    within the stall timeout + 10 s; the host never blocked inside NCCL to notice."""
    started = time.monotonic()
    result = run(3, ["tests/scripts/nccl_stall.py", mode], timeout=60,
                 env=standin_job_env(tmp_path, **extra))
    took = time.monotonic() - started
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert re.search(said, result.output), str(result)
    assert "unreachable" not in result.output, str(result)
    assert took < STALL_TIMEOUT_S + 10, f"took {took:.1f} s\n{result}"


def test_stalled_nccl_ends_the_job_when_ncclcommabort_hangs(tmp_path):
    """ncclCommAbort has been seen never to return (NVIDIA/nccl#992, #549), and NCCL promises a
    safe abort only on non-blocking communicators, which CuPy cannot drive: the watchdog ran
    the abort before MPI_Abort, so a stuck abort left the job hanging instead of ending it."""
    started = time.monotonic()
    result = run(2, ["tests/scripts/nccl_stall.py", "stall"], timeout=60,
                 env=standin_job_env(tmp_path, META_DIST_STANDIN_NCCL_ABORT_HANG="1"))
    took = time.monotonic() - started
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert re.search(r"\[rank 0\] nccl allreduce #2 \(cupy float32 \(16,\)\): waited 3 s",
                     result.output), str(result)
    assert "aborting the NCCL communicator did not return within 5 s" in result.output
    assert took < STALL_TIMEOUT_S + 15, f"took {took:.1f} s\n{result}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_gpt_runs_on_the_gpu_on_standin(precision, tmp_path):
    """scripts/distributed/train_gpt.py on CuPy arrays and NCCL, as a real H200 first ran it:
    its evaluation once allreduced host numbers through the NCCL communicator (a TypeError),
    and in bf16 the embedding's backward asked CuPy's add.at for bfloat16, which it refuses
    (the stand-in's cupyx.scatter_add refuses it too)."""
    result = run(2, ["scripts/distributed/train_gpt.py", "--config", "configs/gpt-tiny.yaml",
                     "max_steps=2", "eval_every=2", "warmup_steps=1", "device=cuda", "backend=nccl",
                     f"precision={precision}", "zero_opt_level=3"],
                 timeout=SUITE_TIMEOUT_S, env=standin_job_env(tmp_path))
    assert result.returncode == 0, str(result)
    assert "GPU collectives: NCCL" in result.output, str(result)
    found = re.findall(r"^step (\d+)  train loss [\d.]+  val loss \d+\.\d{4}  ", result.output,
                       re.M)
    assert [int(s) for s in found] == [0, 2], str(result)
