"""failfast's one line for the job where MPI cannot start (no rank can tell the others)."""

import pytest

from meta_dist import failfast
from meta_dist.launcher import RANK_VARS


@pytest.mark.parametrize("rank, expected", [
    ("0", [("say", "")]),
    ("1", [("sleep", failfast.MISTAKE_GRACE_S), ("say", " on rank 1")]),
    (None, [("say", "")]),  # no launcher: a process alone
])
def test_where_mpi_cannot_start_rank_0_says_it_first(monkeypatch, rank, expected):
    """Open MPI's mpirun -np 2 starting a Python whose MPI is the mpich wheel: each rank fails
    alike, alone, and each printed the line at once (two lines, one run in six). Rank 0 says
    it at once; the others wait MISTAKE_GRACE_S, in which mpirun ends the job for rank 0's exit
    code, and speak only if still running (a launcher that leaves them be)."""
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    if rank is not None:
        monkeypatch.setenv("PMIX_RANK", rank)
    events = []

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(failfast, "_started_mpi", lambda: None)
    monkeypatch.setattr(failfast.time, "sleep", lambda seconds: events.append(("sleep", seconds)))
    monkeypatch.setattr(failfast, "_say", lambda message, where="": events.append(("say", where)))
    monkeypatch.setattr(failfast, "_leave", leave)
    with pytest.raises(SystemExit, match="2"):
        failfast._report_once("a PMIx launcher ...", 2)
    assert events == expected
