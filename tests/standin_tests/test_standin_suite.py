"""Run the stand-in's multi-rank tests (tests/standin_tests/mpi) under real mpirun at 1-4 ranks.

The ranks import the stand-in as ``cupy`` through PYTHONPATH (install.standin_env), model four
GPUs per host, and meet in a rendezvous directory private to the run. A hang becomes a
failure after the timeout; any failure lists the failed inner tests and shows every rank's output.
"""

import pytest
from mpirun import mpi_env, run_suite, suite_failures
from standin_install import standin_env

pytestmark = pytest.mark.gpu_standin

SUITE_TIMEOUT_S = 240


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_standin_mpi_suite(ranks, tmp_path):
    env = standin_env(mpi_env(META_DIST_STANDIN_MPI_SUITE="1", META_DIST_STANDIN_DEVICES="4",
                              META_DIST_STANDIN_RENDEZVOUS=str(tmp_path)))
    result, tests = run_suite(ranks, "tests/standin_tests/mpi", timeout=SUITE_TIMEOUT_S,
                              env=env)
    failed = suite_failures(tests)
    assert not failed, "inner tests failed:\n  " + "\n  ".join(failed) + f"\n{result}"
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert any(t["outcome"] == "passed" for t in tests.values()), str(result)
