"""Harness of the stand-in's multi-rank tests; they run only under mpirun (test_standin_suite).

As tests/mpi/conftest.py: a failed test on any rank prints ``[rank r] FAILED <test>``, and the
ranks go on where they can (tests/mpi_harness.py); skips depend on the world size only
(``@pytest.mark.mpi(min_size=n)``), so every rank runs the same tests.
"""

import pytest
from mpi_harness import (  # noqa: F401 - registers the shared hooks here
    WORLD,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_unconfigure,
)


@pytest.fixture
def world():
    """A private duplicate of MPI.COMM_WORLD for one test."""
    comm = WORLD.Dup()
    yield comm
    comm.Barrier()
    comm.Free()


@pytest.fixture
def nccl(cupy):
    from cupy.cuda import nccl

    return nccl


@pytest.fixture
def my_gpu(cupy, world):
    """Make GPU ``rank`` current (the launcher models 4 GPUs per host), then restore 0."""
    cupy.cuda.Device(world.rank).use()
    yield world.rank
    cupy.cuda.Device(world.rank).synchronize()
    cupy.cuda.Device(0).use()


@pytest.fixture
def unique_id(nccl, world):
    """Return a function giving a fresh unique id made on rank 0, the same on every rank."""
    def make():
        return world.bcast(nccl.get_unique_id() if world.rank == 0 else None)

    return make
