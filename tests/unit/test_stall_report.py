"""The stall watchdog's report, from the facts the watchdog gathers (no MPI): who is named as not
arrived, who ended, and how."""

import numpy as np

from meta_dist.stall_report import report

STALLED = ("allreduce", 2, 0.0, np.ones(4))


def state(seq, current=()):
    """What a rank's watchdog answers (``StallWatchdog.state``)."""
    return {"host": "node1", "pid": 42, "seq": seq, "current": list(current), "at": [],
            "last": ("allreduce", seq - 1, 3.0) if seq > 1 else None}


def text(stalled=STALLED, answers=None, exited=None, gone=()):
    return report(0, 3, stalled, {0: 3.0}, answers or {}, limit="300 s", unknown=None,
                  gone=list(gone), exited=exited or {}, answer_s=2.0)


def test_a_rank_whose_program_ended_before_the_collective_is_named_as_such():
    shown = text(answers={1: state(2, [("allreduce", 2, 3.0, "")])}, exited={2: 1}, gone=[2])
    assert shown.startswith("[rank 0] allreduce #2 (numpy float64 (4,)): rank 2 ended its "
                            "program without reaching it (3.0 s waited)\n"), shown
    assert "  not arrived: rank 2\n    rank 2: its program ended after collective #1 with no " \
           "error meta_dist could see (a clean end, or `raise SystemExit(n)`" in shown, shown
    assert "with this communicator open" in shown and "(no error)" not in shown, shown
    assert "not responding" not in shown


def test_a_rank_that_did_its_part_and_then_ended_is_not_called_absent():
    """Without the per-call check a reduce's non-root rank leaves it at once; it ended after
    it, while rank 1 never came: only rank 1 is not arrived."""
    shown = text(answers={1: state(1)}, exited={2: 2})
    assert "  not arrived: rank 1\n" in shown and "  did its part, then ended: rank 2" in shown
    assert "rank 2: its program ended" not in shown, shown


def test_a_rank_that_ended_before_any_collective_says_so():
    shown = text(answers={1: state(2, [("allreduce", 2, 3.0, "")])}, exited={2: 0}, gone=[2])
    assert "rank 2: its program ended before any collective with no error" in shown, shown


def test_an_unanswered_rank_that_did_not_end_is_not_responding():
    shown = text(answers={1: state(2, [("allreduce", 2, 3.0, "")])})
    assert "  not arrived: rank 2\n    rank 2: not responding (no answer in 2 s" in shown, shown
    assert shown.splitlines()[0].startswith("[rank 0] allreduce #2 (numpy float64 (4,)): "
                                            "waited 300 s for the other ranks")


def test_a_receive_from_a_rank_that_ended_lists_every_rank():
    stalled = ("recv from rank 2", None, 0.0, np.ones(4), 2)
    shown = text(stalled, answers={1: state(1)}, exited={2: 1}, gone=[2])
    assert shown.startswith("[rank 0] recv from rank 2 (numpy float64 (4,)): rank 2 ended its "
                            "program without reaching it"), shown
    assert "  the other ranks:\n    rank 1 (host node1, pid 42): completed no collective yet; " \
           "now in no collective\n    rank 2: its program ended after collective #1 with no " \
           "error" in shown, shown
