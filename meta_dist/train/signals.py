"""Stopping on SIGTERM and SIGINT at a step boundary, on every rank alike.

Imports the standard library only. mpirun forwards these signals to the ranks, and Slurm sends
SIGTERM before its kill; a rank that died inside a collective would leave its peers waiting.
While ``fit`` runs, the first signal only asks for a stop: the ranks agree on it through the
step's verdict exchange (``train.guard``), so every rank stops after the same step, writes a
checkpoint first when ``checkpoint_dir`` is set, and leaves with 128 + the signal's number. A
second signal acts as it would without meta_dist (an impatient Ctrl-C still interrupts).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

CAUGHT = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(SystemExit):
    """Raised by ``fit`` on every rank after the step at which a stop signal was agreed on.

    A SystemExit: left uncaught it ends the process quietly with ``code`` (128 + the signal's
    number, as a shell reports a process killed by it), and ``failfast`` lets every rank
    finalize MPI normally since all stop together.
    """


class StopSignals:
    """Catch SIGTERM and SIGINT while in a ``with`` block (main thread only; elsewhere a no-op).

    ``received`` is the first caught signal's number (0 for none); the previous handlers are
    put back at once, so a second signal acts as usual, and on leaving the block.
    """

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def pending(self) -> bool:
        """Return True once a stop signal has arrived (what this rank votes each step)."""
        return self.received != 0

    @property
    def name(self) -> str | None:
        """The caught signal's name ("SIGTERM"), or None."""
        return signal.Signals(self.received).name if self.received else None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            previous = {number: signal.getsignal(number) for number in CAUGHT}
            self._previous = dict(previous)  # known before a handler of ours can run
            for number in CAUGHT:
                signal.signal(number, self._caught)
            if self.received:  # caught between the installs: that restore missed the later ones
                self._previous = previous
                self._restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _caught(self, number: int, frame: FrameType | None) -> None:
        self.received = self.received or number
        self._restore()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}  # a signal may arrive meanwhile
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)
