"""Run the multi-rank suite (tests/mpi) under real mpirun at 1, 2, 3, 4 and 5 ranks.

4 and 5 ranks oversubscribe a 2-core machine. A failed inner test does not stop the run (the
ranks agree and go on: tests/mpi_harness.py), a hang becomes a failure after the timeout, and
any failure lists every failed inner test and shows the output of every rank. The inner
passes, failures and skips (with reasons) appear in pytest's summary (tests/conftest.py).
"""

import pytest
from mpirun import ROOT, SUITE_RUNS, mpi_env, run_suite, suite_failures

SUITE_TIMEOUT_S = 420


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_mpi_suite(ranks):
    result, tests = run_suite(ranks, "tests/mpi", timeout=SUITE_TIMEOUT_S,
                              env=mpi_env(META_DIST_MPI_SUITE="1"))
    failed = suite_failures(tests)
    assert not failed, "inner tests failed:\n  " + "\n  ".join(failed) + f"\n{result}"
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert any(t["outcome"] == "passed" for t in tests.values()), str(result)


PLANTED = '''
import pytest
from mpi4py import MPI

from mpi_harness import (  # noqa: F401
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_logreport,
    pytest_runtest_protocol, pytest_sessionfinish, pytest_unconfigure)
'''

PLANTED_TESTS = '''
import pytest
from mpi4py import MPI

def test_a_fails_on_rank_1_only():
    assert MPI.COMM_WORLD.rank != 1, "planted failure"

def test_b_runs_after_it():
    MPI.COMM_WORLD.Barrier()

@pytest.mark.mpi(min_size=3)
def test_c_needs_three():
    pass

def test_d_fails_everywhere():
    assert False, "planted failure"
'''


def test_a_failure_hides_no_other_test(tmp_path):
    """A failure on one rank, then a test that needs every rank, a skip and a second failure:
    every one of them runs and is reported, with the ranks each failed on."""
    (tmp_path / "conftest.py").write_text(PLANTED)
    (tmp_path / "test_planted.py").write_text(PLANTED_TESTS)
    env = mpi_env()
    env["PYTHONPATH"] = f"{ROOT / 'tests'}:{env['PYTHONPATH']}"
    result, tests = run_suite(2, str(tmp_path), timeout=120, env=env)
    SUITE_RUNS.pop()  # planted: not part of the summary of the real suites
    outcome = {nodeid.split("::")[-1]: entry for nodeid, entry in tests.items()}
    assert result.returncode != 0, str(result)
    assert outcome["test_a_fails_on_rank_1_only"]["failed_on"] == [1], outcome
    assert outcome["test_b_runs_after_it"]["outcome"] == "passed", outcome
    assert outcome["test_c_needs_three"]["outcome"] == "skipped", outcome
    assert "needs at least 3 ranks" in outcome["test_c_needs_three"]["reason"], outcome
    assert outcome["test_d_fails_everywhere"]["failed_on"] == [0, 1], outcome
    assert len(suite_failures(tests)) == 2
    # each failing rank's own report reached the launcher before the job was aborted
    assert "[rank 1] FAILED" in result.output and "planted failure" in result.output, str(result)


PLANTED_ENDING = '''
import sys
import threading
import time

from mpi4py import MPI

import meta_dist.failfast as failfast

def test_a_rank_ends_the_job_from_a_thread():
    if MPI.COMM_WORLD.rank == 1:  # as the stall watchdog does: report, then end the job
        def end():
            sys.stderr.write("planted watchdog report\\n")
            failfast.end_job(1)
        threading.Thread(target=end).start()
    time.sleep(30)
'''


def test_a_rank_ending_the_job_inside_a_test_is_heard(tmp_path):
    """meta_dist's stall watchdog ends a job from its own thread, writing its report to
    sys.stderr first; inside a test pytest captures it, and the abort dropped it: a stand-in
    GPU job once ended "MPI_ABORT was invoked on rank 2" with nothing else said. The harness
    copies the capture out first (tests/mpi_harness.py, point 5)."""
    (tmp_path / "conftest.py").write_text(PLANTED + "import meta_dist  # noqa: F401\n")
    (tmp_path / "test_planted.py").write_text(PLANTED_ENDING)
    env = mpi_env()
    env["PYTHONPATH"] = f"{ROOT / 'tests'}:{env['PYTHONPATH']}"
    result, _ = run_suite(2, str(tmp_path), timeout=120, env=env)
    SUITE_RUNS.pop()
    assert result.returncode != 0 and not result.timed_out, str(result)
    assert "[rank 1] ending the job inside a test" in result.output, str(result)
    assert "planted watchdog report" in result.output, str(result)
