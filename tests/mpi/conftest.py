"""Harness for the multi-rank tests, which run inside ``mpirun ... python -m mpi4py -m pytest``.

1. A failed test on any rank prints ``[rank r] FAILED <test>`` with its traceback; the ranks
   then agree on it and go on to the next test, or, when the failed rank's peers are still
   waiting inside the test, the job ends (tests/mpi_harness.py).
2. pytest's faulthandler_timeout (pyproject.toml) dumps every thread and exits on a deadlock.
3. ``python -m mpi4py`` turns any other uncaught error into MPI_Abort.
Skips depend only on the world size, so every rank collects and runs the same tests.
"""

import numpy as np
import pytest
from mpi_harness import (  # noqa: F401 - registers the shared hooks here
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_unconfigure,
)

from meta_dist import MPIConnector, make_communicator


@pytest.fixture(scope="session")
def connector():
    conn = MPIConnector(abort_on_exception=False)
    yield conn
    conn.close()


@pytest.fixture
def comm(connector):
    """A fresh MPI communicator per test (its own duplicate of the world: no stray messages)."""
    communicator = make_communicator("mpi", connector)
    yield communicator
    communicator.close()


def same_on_every_rank(connector, array) -> bool:
    """Return True if every rank holds bit-identical bytes (collective)."""
    mine = np.ascontiguousarray(array).tobytes()
    return all(other == mine for other in connector.allgather(mine))
