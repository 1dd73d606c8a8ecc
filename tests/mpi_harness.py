"""The pytest hooks every multi-rank test folder shares (tests/mpi, tests/standin_tests/mpi).

A conftest imports the hooks by name, which registers them for its folder:
1. skips depend only on the world size (``@pytest.mark.mpi(min_size=n)``), so every rank
   collects and runs the same tests;
2. a failed test prints ``[rank r] FAILED <test>`` with its traceback; after each test the
   ranks agree whether any of them failed (a nonblocking allreduce on a communicator of the
   harness's own). A failure every rank got past goes on to the next test, so one failure hides
   no other; a rank that failed while its peers are still inside the test (waiting in a
   collective the failed rank left) ends the job after AGREE_TIMEOUT_S, as nothing else could;
3. at the end rank 0 writes every test's outcome, per rank, to ``$META_DIST_SUITE_REPORT``
   (JSON), which tests/mpirun.py's ``run_suite`` reads and the outer pytest summarises;
4. a rank with a failed test waits OUTPUT_GRACE_S as it exits, so that its report reaches the
   launcher before the job is aborted;
5. a rank that ends the job from inside a test (meta_dist's stall watchdog or failfast) first
   copies what pytest captured of that test to the real stderr: the abort drops the capture.
Imports mpi4py only (meta_dist's failfast where the suite imported it): the stand-in's tests
use it without meta_dist.
"""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
AGREE_TIMEOUT_S = 20.0  # how long a failed rank waits for its peers to finish the same test
OUTPUT_GRACE_S = 1.0  # as meta_dist.failfast's: for the launcher to forward a report
_agree = WORLD.Dup()  # collective: every rank imports the harness at start-up
_outcomes: dict[str, dict] = {}  # nodeid -> {"outcome", "reason", "failed_on"} on this rank


def pytest_configure(config):
    """Make meta_dist's job-ending paths show what the running test wrote (point 5).

    The stall watchdog and failfast write their report to sys.stderr and then MPI_Abort; inside
    a test that is pytest's capture, so a rank of the stand-in GPU job once ended the job
    ("MPI_ABORT was invoked on rank 2", errorcode 1) saying nothing. Both call
    ``failfast.flush_output`` just before the abort: it now copies the capture first to the
    stderr pytest found (capture is suspended while plugins configure).
    """
    failfast = sys.modules.get("meta_dist.failfast")
    capture = config.pluginmanager.getplugin("capturemanager")
    if failfast is None or capture is None:
        return
    real_stderr, flush = os.dup(2), failfast.flush_output

    def flush_output() -> None:
        with contextlib.suppress(Exception):  # nothing captured, or capture already gone
            out, err = capture.read_global_capture()
            if out or err:
                os.write(real_stderr, f"[rank {WORLD.rank}] ending the job inside a test; what "
                         f"the test wrote:\n{out}{err}\n".encode(errors="replace"))
        flush()

    failfast.flush_output = flush_output


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("mpi")
        min_size = marker.kwargs.get("min_size", 1) if marker else 1
        if WORLD.size < min_size:
            item.add_marker(pytest.mark.skip(
                reason=f"needs at least {min_size} ranks; this run has {WORLD.size}"))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "reason": ""})
    if report.failed:
        entry["outcome"] = "failed"
        if WORLD.size > 1:
            sys.stderr.write(f"[rank {WORLD.rank}] FAILED {report.nodeid} ({report.when})\n"
                             f"{report.longreprtext}\n")
            sys.stderr.flush()
    elif report.skipped and entry["outcome"] != "failed":
        entry["outcome"] = "skipped"
        longrepr = report.longrepr
        entry["reason"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    failed = _outcomes.get(item.nodeid, {}).get("outcome") == "failed"
    mine, anyone = np.array([int(failed)], np.int32), np.zeros(1, np.int32)
    request = _agree.Iallreduce(mine, anyone, op=MPI.MAX)
    deadline = time.monotonic() + AGREE_TIMEOUT_S
    while not request.Test():
        if failed and time.monotonic() > deadline:
            sys.stderr.write(f"[rank {WORLD.rank}] the other ranks did not finish "
                             f"{item.nodeid} within {AGREE_TIMEOUT_S:.0f} s of its failure "
                             "here (they wait for this rank); ending the job\n")
            sys.stderr.flush()
            time.sleep(OUTPUT_GRACE_S)  # for the launcher to forward it before the abort
            WORLD.Abort(1)
        time.sleep(0.001)
    if anyone[0] and not failed:
        _outcomes.setdefault(item.nodeid, {})["outcome"] = "failed elsewhere"


def pytest_sessionfinish(session, exitstatus):
    every = _agree.gather(_outcomes, root=0)
    try:
        _write_report(every)
    finally:  # a rank that failed aborts the job as it exits: not before the report is out
        _agree.Barrier()


def _write_report(every):
    path = os.environ.get("META_DIST_SUITE_REPORT")
    if WORLD.rank != 0 or not path:
        return
    merged = {}
    for rank, outcomes in enumerate(every):
        for nodeid, entry in outcomes.items():
            into = merged.setdefault(nodeid, {"outcome": entry["outcome"], "reason":
                                              entry.get("reason", ""), "failed_on": []})
            if entry["outcome"] == "failed":
                into["failed_on"].append(rank)
                into["outcome"] = "failed"
    partial = Path(f"{path}.partial")  # renamed when whole: a reader never sees half a report
    with partial.open("w") as out:
        json.dump({"size": WORLD.size, "tests": merged}, out)
    partial.replace(path)


def pytest_unconfigure(config):
    """Give a failed rank's report time to reach the launcher before the job is aborted.

    ``python -m mpi4py`` turns a nonzero exit into MPI_Abort, and launchers tear the job down
    without draining the ranks' pipes: a 3-rank stand-in run once ended "MPI_ABORT was invoked
    on rank 2" with that rank's ``[rank 2] FAILED`` report and pytest summary lost. This is the
    last hook pytest calls, after its summary is written.
    """
    if any(entry.get("outcome") == "failed" for entry in _outcomes.values()):
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(OUTPUT_GRACE_S)
