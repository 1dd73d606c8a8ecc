"""Run the multi-rank suite (tests/mpi) under real mpirun at 1, 2, 3, 4 and 5 ranks.

4 and 5 ranks oversubscribe a 2-core machine. A hang becomes a failure after the timeout, and any
failure shows the output of every rank.
"""

import pytest
from mpirun import mpi_env, run

SUITE_TIMEOUT_S = 420


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_mpi_suite(ranks):
    result = run(ranks, ["-m", "mpi4py", "-m", "pytest", "-q", "-x",
                        "-o", "faulthandler_timeout=60", "tests/mpi"],
                 timeout=SUITE_TIMEOUT_S, env=mpi_env(META_DIST_MPI_SUITE="1"))
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert " passed" in result.output, str(result)
