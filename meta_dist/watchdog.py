"""The stall watchdog: end a job whose collective waits too long, naming who did not come.

Imports the standard library, mpi4py (through lazy_mpi) and meta_dist.failfast / errors /
stall_report (the report's text). Each communicator has one watchdog; every operation is
bracketed by ``enter`` and ``leave`` (a counter, a dict write and a dict pop: all the common
path pays), and so are the connector's collectives. A daemon thread looks every POLL_S
seconds. When a collective has waited past the stall timeout, the watchdog asks every other
rank's watchdog what that rank is doing, over a communicator used by the watchdog threads
alone (a heartbeat side channel: a watchdog thread answers while its rank's main thread computes,
waits in MPI, or loops in Python), and the lowest rank waiting in that collective prints one
report and ends the job (MPI_Abort)::

    [rank 0] allreduce #7 (numpy float32 (1024,)): waited 5 s for the other ranks ...
      waiting in it: rank 0 for 5.2 s, rank 1 for 5.0 s
      not arrived: rank 2
        rank 2 (host node1, pid 4242): last completed allreduce #6 (entered 5.3 s
          ago); now in no collective, at:
            File "train.py", line 40, in <module>

A rank whose watchdog does not answer within ANSWER_S is "not responding": its process is
gone or stopped, or it is stuck in native code that holds Python's GIL. A rank whose program
ends cleanly with the communicator still open tells the others how many collectives it entered
(EXITED): a peer waiting in a later one ends the job at once, naming it, instead of after the
timeout (the classic cause: one rank's loop ran out of batches first).

The timeout: ``stall_timeout`` seconds (``meta_dist_config.stall_timeout``, default 300), and
the environment variable META_DIST_STALL_TIMEOUT overrides it for any program (0: no watchdog).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import platform
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import meta_dist.failfast as failfast
from meta_dist.errors import UsageError
from meta_dist.lazy_mpi import MPI
from meta_dist.stall_report import describe, report

DEFAULT_STALL_TIMEOUT_S = 300.0
STALL_TIMEOUT_ENV = "META_DIST_STALL_TIMEOUT"
POLL_S = 0.25  # how often the thread looks (and answers its peers)
ANSWER_S = 2.0  # how long the reporting rank waits for the others' answers
HANDOVER_S = 5.0  # a waiting rank that asked a lower one to report reports itself after this
QUERY, STATE, REPORT, REPORTING, EXITED = 11, 12, 13, 14, 15  # tags on the side channel
EXIT_GRACE_S = 2.0  # an unnumbered wait on a rank that ended is hopeless this much later
ALL = "all"  # what an unnumbered collective (the connector's) needs: every rank
STACK_FRAMES = 4  # innermost frames of a not-arrived rank's main thread shown in the report
# how long the before_abort hooks may take before the job is ended without them: ncclCommAbort
# was seen never to return (NVIDIA/nccl#992, #549), and NCCL promises a safe abort only for
# non-blocking communicators with no other thread inside NCCL (usage/communicators.html,
# "Fault Tolerance"); CuPy drives blocking ones, and the main thread may be inside a call
ABORT_HOOKS_S = 5.0

_thread_id, _now = threading.get_ident, time.monotonic  # on the common path: no lookups
_running: weakref.WeakSet[StallWatchdog] = weakref.WeakSet()
_exit_handler = [False]


def resolve_stall_timeout(configured: float | None = DEFAULT_STALL_TIMEOUT_S) -> float | None:
    """Return the stall timeout in seconds (None: no watchdog); the environment wins.

    Raises:
        ValueError: META_DIST_STALL_TIMEOUT or ``configured`` is not a number >= 0.
    """
    text = os.environ.get(STALL_TIMEOUT_ENV, "").strip()
    if text:
        try:
            value = float(text)
        except ValueError:
            value = -1.0
        if not value >= 0:  # also NaN
            raise UsageError(f"{STALL_TIMEOUT_ENV}={text!r}: expected seconds >= 0 (0 turns the "
                             "stall watchdog off); set it to a number such as 300, or unset it")
        return value or None
    if configured is not None and not configured >= 0:
        raise ValueError(f"stall_timeout: expected seconds >= 0 or None (no watchdog); got "
                         f"{configured!r}")
    return configured or None


class StallWatchdog:
    """End the job when a collective has waited longer than ``timeout`` seconds.

    Work that returns to Python before it has finished (NCCL kernels on a stream) is watched
    through ``probes``: each returns the (name, sequence number or None, start time, arrays)
    of its oldest unfinished work, or raises to end the job with its message (an error NCCL
    reports asynchronously). ``before_abort`` hooks run first when the job is ended (the NCCL
    communicator aborts itself, freeing its kernels).

    Args:
        rank: this rank, for the report.
        size: the number of ranks.
        timeout: seconds a collective may wait for the other ranks (None: never ends the job;
            ``set_timeout`` may set one later).
        side_channel: a communicator of the watchdog's own (a Dup: every rank's watchdog
            must have one), over which the watchdogs tell each other what their ranks are
            doing; None reports this rank's view only. Freed by ``stop``. Needs MPI's
            thread level "multiple".
    """

    def __init__(self, rank: int, size: int, timeout: float | None,
                 side_channel: Any = None) -> None:
        self.rank, self.size, self.timeout, self._side = rank, size, timeout, side_channel
        self.seq = 0  # collectives entered on this communicator
        self.last: tuple | None = None  # (api, seq, start) of the last collective returned
        # thread -> (api, seq (None: not a numbered collective), start, arrays, needs: the
        # ranks it waits for when not numbered, ALL or a peer; None: unknown)
        self._waiting: dict[int, tuple] = {}
        self.probes: list[Callable[[], tuple | None]] = []
        self.before_abort: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._sends: list[Any] = []  # side-channel sends not known to be complete
        self._answers: dict[int, dict] = {}
        self._asked: tuple | None = None  # (api, seq) a peer asked this rank to report
        self._handover: tuple | None = None  # ((api, seq), when) handed to a lower rank
        self._reporter_seen: float | None = None  # when a peer said it ends the job
        self._side_failed: str | None = None  # why the side channel is no longer used
        # rank whose program ended -> (collectives it entered, when this rank heard it)
        self.exited: dict[int, tuple[int, float]] = {}
        self._thread = threading.Thread(target=self._watch, name="meta_dist-watchdog",
                                        daemon=True)
        self._thread.start()
        if side_channel is not None:  # its thread must stop before MPI finalizes (exit
            _running.add(self)        # handlers run last registered first: MPI's came earlier)
            if not _exit_handler[0]:
                _exit_handler[0] = True
                atexit.register(_stop_running)

    def set_timeout(self, timeout: float | None) -> None:
        """Change the stall timeout (None or 0: watch without ending the job)."""
        self.timeout = timeout or None

    def enter(self, api: str, arrays: Any = None, collective: bool = True,
              needs: Any = None) -> None:
        """Mark that this thread is now inside ``api``.

        A numbered collective, or (``collective`` off) an operation that ``needs`` rank
        ``needs`` (a peer) or ``ALL`` ranks.
        """
        seq = None
        if collective:
            seq = self.seq = self.seq + 1
        self._waiting[_thread_id()] = (api, seq, _now(), arrays, needs)

    def leave(self) -> None:
        """Mark that this thread's operation has returned."""
        entry = self._waiting.pop(_thread_id(), None)
        if entry is not None and entry[1] is not None:
            self.last = entry[:3]  # not the arrays: they may be large, and are the caller's

    def stop(self, free: bool = True) -> None:
        """Stop watching; ``free`` the side channel too (the communicator is closing)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        _running.discard(self)
        if free and self._side is not None:
            side, self._side = self._side, None
            for request in self._sends:
                with contextlib.suppress(Exception):
                    request.Cancel()
                    request.Free()
            side.Free()

    # ---------------------------------------------------------------- the thread

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self._pump()
            try:
                stalled = self._stalled()
            except Exception as error:  # a probe's report: end the job with its message
                self._abort(f"[rank {self.rank}] {error}; aborting the job. Stacks:\n")
            if self._stop.is_set():
                return
            key = stalled[:2] if stalled is not None else None
            if self._asked != key:  # asked about a call that has finished since
                self._asked = None
            if self._handover is not None and self._handover[0] != key:
                self._handover = None
            if stalled is None:
                continue
            waited = time.monotonic() - stalled[2]
            overdue = (self.timeout is not None and waited > self.timeout) or bool(
                self._gone(stalled))
            if self._asked is not None or (overdue and self._handover is None):
                self._report(stalled)
            elif overdue and time.monotonic() - self._handover[1] > HANDOVER_S:
                self._report(stalled, alone=True)  # the rank it was handed to did not end it
            del stalled  # it holds the call's arrays: keeping them to the next poll would
            # hold a freed temporary for 0.25 s (tests/test_memory.py saw the peaks it added)

    def _gone(self, stalled: tuple) -> list[int]:
        """Return the ranks whose program ended without reaching the ``stalled`` operation.

        A numbered collective: those that entered fewer. Otherwise those it needs, once this
        rank has kept waiting EXIT_GRACE_S after hearing of their exit (they may have done
        their part just before it).
        """
        seq, needs = stalled[1], stalled[4] if len(stalled) > 4 else None
        if seq is not None:
            return [r for r, (entered, _) in self.exited.items() if entered < seq]
        late = _now() - EXIT_GRACE_S
        return [r for r, (_, heard) in self.exited.items()
                if heard < late and stalled[2] < late and needs in (ALL, r)]

    def announce_exit(self) -> None:
        """Tell every peer that this rank's program is ending, and how many collectives it entered.

        At exit, with the thread stopped, before MPI finalizes.
        """
        if self._side is None or self._side_failed or self.size == 1:
            return
        self._tell_peers(self.seq, EXITED)
        deadline = time.monotonic() + ANSWER_S  # small messages: sent at once in practice
        with contextlib.suppress(Exception):
            while self._sends and time.monotonic() < deadline:
                self._sends = [r for r in self._sends if not r.Test()]
                time.sleep(0.005)

    def _stalled(self) -> tuple | None:
        """Return the oldest unfinished operation of this rank (a probe's too), or None."""
        waiting = list(self._waiting.values())
        waiting += [found for probe in self.probes if (found := probe()) is not None]
        return min(waiting, key=lambda e: e[2], default=None)

    def _pump(self) -> None:
        """Answer the peers' questions and collect their messages (the side channel).

        A failure of the side channel itself stops its use; the report then says so.
        """
        side = self._side
        if side is None or self._side_failed or MPI.Is_finalized():  # the program finalized it
            return
        try:
            self._sends = [r for r in self._sends if not r.Test()]
            status = MPI.Status()
            while side.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                source, tag = status.Get_source(), status.Get_tag()
                message = side.recv(source=source, tag=tag)
                if tag == QUERY:
                    self._sends.append(side.isend(self.state(), dest=source, tag=STATE))
                elif tag == STATE:
                    self._answers[source] = message
                elif tag == REPORT:  # (api, seq) that a higher waiting rank hands over
                    self._asked = tuple(message)
                elif tag == REPORTING:
                    self._reporter_seen = time.monotonic()
                elif tag == EXITED:
                    self.exited[source] = (message, time.monotonic())
        except Exception as error:
            self._side_failed = f"{type(error).__name__}: {error}"

    def state(self) -> dict[str, Any]:
        """What this rank is doing: what a peer's report says of it."""
        now = time.monotonic()
        current = [(api, seq, now - start, describe(arrays))
                   for api, seq, start, arrays, _ in list(self._waiting.values())]
        with contextlib.suppress(Exception):  # a probe that raises is the thread's to report
            current += [(api, seq, now - start, describe(arrays))
                        for probe in self.probes if (found := probe()) is not None
                        for api, seq, start, arrays in [found[:4]]]
        last = self.last
        frame = sys._current_frames().get(threading.main_thread().ident)
        at = traceback.format_stack(frame)[-STACK_FRAMES:] if frame is not None else []
        return {"host": platform.node(), "pid": os.getpid(), "seq": self.seq,
                "current": current, "at": [line.rstrip() for line in at],
                "last": None if last is None else (last[0], last[1], now - last[2])}

    def _ask_everyone(self) -> dict[int, dict]:
        """Ask every other rank what it is doing; return the answers that came in ANSWER_S."""
        if self._side is None or self._side_failed:
            return {}
        self._answers.clear()
        self._tell_peers(None, QUERY)
        deadline = time.monotonic() + ANSWER_S
        expected = self.size - 1 - len(self.exited)  # a rank whose program ended answers none
        while (len(self._answers) < expected and time.monotonic() < deadline
               and not self._side_failed):
            time.sleep(0.02)
            self._pump()
        return dict(self._answers)

    def _tell_peers(self, message: Any, tag: int, ranks: list[int] | None = None) -> None:
        with contextlib.suppress(Exception):  # a failing side channel: the report says so
            self._sends += [self._side.isend(message, dest=r, tag=tag)
                            for r in (ranks if ranks is not None else range(self.size))
                            if r != self.rank]

    def _report(self, stalled: tuple, alone: bool = False) -> None:
        """Print what waited and who did not arrive (or let a lower waiting rank), then end.

        Asked by a peer, or ``alone`` (the rank it handed over to did not end the job), it
        reports whatever it sees; otherwise the lowest waiting rank does, and a rank that
        heard another say it reports holds off.
        """
        api, seq, start = stalled[:3]
        together = seq is not None or stalled[4:5] == (ALL,)  # every rank is in the same call
        answers = self._ask_everyone()
        now = time.monotonic()
        waiting = {self.rank: now - start}
        for rank, state in answers.items():
            for other, other_seq, waited, _ in state["current"]:
                if together and other_seq == seq and other == api:
                    waiting[rank] = max(waited, waiting.get(rank, 0.0))
        lowest = min(waiting)
        someone = self._reporter_seen is not None and now - self._reporter_seen < HANDOVER_S
        if not alone and self._asked is None and (lowest != self.rank or someone):
            if lowest != self.rank:
                self._tell_peers((api, seq), REPORT, [lowest])
            self._handover = (stalled[:2], now)
            return
        self._tell_peers(None, REPORTING)  # peers hold off while this rank ends the job
        unknown = None
        if self._side is None or self._side_failed:
            unknown = (f"the side channel failed: {self._side_failed}" if self._side_failed
                       else "no side channel: before the communicator exists, or MPI's thread "
                       "level is below 'multiple'")
        text = report(self.rank, self.size, stalled, waiting, answers, unknown=unknown,
                      limit=f"{self.timeout:.0f} s" if self.timeout else "no limit",
                      gone=self._gone(stalled), answer_s=ANSWER_S,
                      exited={r: entered for r, (entered, _) in self.exited.items()})
        self._abort(text + "Stacks of this rank:\n")

    def _abort(self, message: str) -> None:
        sys.stderr.write(message)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        failfast.flush_output()  # before the hooks: an aborted NCCL lets blocked threads run on
        if not _bounded(self.before_abort, ABORT_HOOKS_S):
            sys.stderr.write(f"[rank {self.rank}] aborting the NCCL communicator did not return "
                             f"within {ABORT_HOOKS_S:g} s; ending the job without it\n")
            sys.stderr.flush()
        failfast.end_job(1, grace=False)


def _bounded(hooks: list[Callable[[], None]], seconds: float) -> bool:
    """Run ``hooks`` in order on a thread of their own; return False if they outlast ``seconds``.

    Failures are ignored: ending the job matters more.
    """
    if not hooks:
        return True
    finished = threading.Event()

    def run() -> None:
        for hook in hooks:
            with contextlib.suppress(Exception):
                hook()
        finished.set()

    threading.Thread(target=run, name="meta_dist-abort", daemon=True).start()
    return finished.wait(seconds)


def _stop_running() -> None:
    """Stop every watchdog thread that uses MPI (at exit, before MPI finalizes).

    On a clean exit, tell the peers (``announce_exit``).
    """
    clean = failfast.leaving_cleanly() and not MPI.Is_finalized()  # else MPI is not usable
    for watchdog in list(_running):
        with contextlib.suppress(Exception):
            watchdog.stop(free=False)
            if clean:
                watchdog.announce_exit()
