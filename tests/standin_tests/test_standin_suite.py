"""Run the stand-in's multi-rank tests (tests/standin_tests/mpi) under real mpirun at 1-4 ranks.

The ranks import the stand-in as ``cupy`` through PYTHONPATH (install.standin_env), model four
GPUs per host, and meet in a rendezvous directory private to the run. A hang becomes a
failure after the timeout; any failure shows every rank's output.
"""

import pytest
from mpirun import mpi_env, run
from standin_install import standin_env

pytestmark = pytest.mark.gpu_standin

SUITE_TIMEOUT_S = 240


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_standin_mpi_suite(ranks, tmp_path):
    env = standin_env(mpi_env(META_DIST_STANDIN_MPI_SUITE="1", META_DIST_STANDIN_DEVICES="4",
                              META_DIST_STANDIN_RENDEZVOUS=str(tmp_path)))
    result = run(ranks, ["-m", "mpi4py", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                         "-o", "faulthandler_timeout=60", "tests/standin_tests/mpi"],
                 timeout=SUITE_TIMEOUT_S, env=env)
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert " passed" in result.output, str(result)
