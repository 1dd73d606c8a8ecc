"""Top-level test configuration: the multi-rank suite only runs under mpirun.

Plain ``pytest`` runs tests/unit and tests/test_*.py; the latter launch tests/mpi under real
mpirun at 1-4 ranks (see tests/test_mpi_suite.py). Under mpirun the launcher sets
META_DIST_MPI_SUITE=1 and only tests/mpi is collected.
"""

import os

# Open MPI 5's libfabric transport (btl/ofi) closes with a one-second sleep in every process where
# it finds no fabric to drive: MPI_Init takes 1.1 s instead of 0.15 s, and the suite starts
# hundreds of ranks (each one-host and TCP job here runs as before). A value set outside wins.
os.environ.setdefault("OMPI_MCA_btl", "^ofi")

if os.environ.get("META_DIST_MPI_SUITE") != "1":
    collect_ignore = ["mpi", "scripts"]
else:
    collect_ignore = ["unit", "scripts"]


def pytest_terminal_summary(terminalreporter):
    """Say what the multi-rank suites ran: inner passes, failures and skips (with reasons)."""
    import sys
    from collections import Counter

    mpirun = sys.modules.get("mpirun")
    runs = getattr(mpirun, "SUITE_RUNS", [])
    if not runs:
        return
    terminalreporter.section("multi-rank suites: the tests inside each mpirun job")
    for folder, ranks, tests in runs:
        counts = Counter(entry["outcome"] for entry in tests.values())
        terminalreporter.line(f"{folder} at {ranks} rank(s): " + (", ".join(
            f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no report"))
        reasons = Counter(entry["reason"] for entry in tests.values()
                          if entry["outcome"] == "skipped")
        for reason, n in sorted(reasons.items()):
            terminalreporter.line(f"    {n} skipped: {reason}")
        for nodeid, entry in tests.items():
            if entry["outcome"] == "failed":
                terminalreporter.line(f"    FAILED {nodeid} on rank(s) {entry['failed_on']}")
