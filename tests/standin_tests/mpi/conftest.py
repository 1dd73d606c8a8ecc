"""Harness of the stand-in's multi-rank tests; they run only under mpirun (test_standin_suite).

As tests/mpi/conftest.py: a failed test on any rank prints ``[rank r] FAILED <test>`` and
aborts the job (its peers would wait forever in their next collective); skips depend on the
world size only (``@pytest.mark.mpi(min_size=n)``), so every rank runs the same tests.
"""

import sys

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("mpi")
        min_size = marker.kwargs.get("min_size", 1) if marker else 1
        if WORLD.size < min_size:
            item.add_marker(pytest.mark.skip(
                reason=f"needs at least {min_size} ranks; this run has {WORLD.size}"))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed and WORLD.size > 1:
        sys.stderr.write(f"[rank {WORLD.rank}] FAILED {report.nodeid} ({report.when})\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        WORLD.Abort(1)


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
