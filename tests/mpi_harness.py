"""The pytest hooks every multi-rank test folder shares (tests/mpi, tests/standin_tests/mpi).

A conftest imports both hooks by name, which registers them for its folder:
1. skips depend only on the world size (``@pytest.mark.mpi(min_size=n)``), so every rank
   collects and runs the same tests;
2. a failed test on any rank prints ``[rank r] FAILED <test>`` with its traceback and aborts the
   job (its peers would otherwise wait forever in their next collective).
Imports mpi4py only: the stand-in's tests use it without meta_dist.
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
