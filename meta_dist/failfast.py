"""How a rank that fails ends the whole job, before MPI starts and after.

Leaf module: imports the standard library only, and mpi4py only when a failure must end the job.
``meta_dist/__init__`` installs it when the process is one of several ranks an MPI launcher
started; the connector installs it when MPI starts. A rank that leaves a running job would
otherwise hang it: its peers wait forever in their next collective (or, under MPICH, in
MPI_Init: Hydra ends a job for a rank killed by a signal, not for one that exits early). So:
- an uncaught exception prints its traceback and ends the job with exit code 1;
- ``sys.exit(n)`` with n != 0 ends the job with exit code n, unless every meta_dist connector
  of this rank was closed first, or every rank said it leaves with n (``leave_together``:
  stopped by a signal after the same step); then the ranks finalize normally;
- a clean exit (0) finalizes as usual;
- a user's mistake (``errors.UsageError``) and Ctrl-C (KeyboardInterrupt) print one line for
  the whole job, not a traceback per rank: the failing ranks tell each other, the lowest of them
  prints, and they exit with ``USAGE_EXIT`` (130 for Ctrl-C): together if every rank failed
  (and no communication thread is inside MPI), else by MPI_Abort. ``META_DIST_DEBUG=1`` shows
  the traceback as for any other error.
Ending the job is MPI_Abort(n), after starting MPI if it had not started yet. ``sys.exit`` is
wrapped to learn n: an exit handler cannot see it. Outside an MPI launcher only the one-line
report of a mistake is installed (``install_for_one_process``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

from meta_dist.env import env_flag
from meta_dist.errors import USAGE_EXIT, UsageError
from meta_dist.launcher import launcher_mismatch, launcher_rank

_exit_status: list[Any] = [None]  # what sys.exit was last given
_connectors: weakref.WeakSet[Any] = weakref.WeakSet()  # open ones keep an early exit fatal
_threads: weakref.WeakSet[Any] = weakref.WeakSet()  # communication threads (track_threads)
_installed, _tracked = [False], [False]
_together: list[int | None] = [None]  # the exit code every rank leaves with (leave_together)


def install() -> None:
    """Make an uncaught exception or ``sys.exit(n != 0)`` end the whole job (idempotent)."""
    if _installed[0]:
        return
    _installed[0] = True
    sys.excepthook = _end_job_on_exception
    real_exit = sys.exit

    def recording_exit(status: Any = None) -> None:
        _record(status)
        real_exit(status)

    recording_exit.__doc__ = real_exit.__doc__
    sys.exit = recording_exit
    for name in ("exit", "quit"):  # the site module's exit(n) and quit(n) raise SystemExit too
        builtin = getattr(builtins, name, None)
        if builtin is not None:
            setattr(builtins, name, _recording(builtin))
    atexit.register(_end_job_if_leaving_early)


def _recording(builtin: Any) -> Any:
    """Wrap the builtin ``exit`` or ``quit`` so that the code it exits with is recorded."""

    def recording(code: Any = None) -> None:
        _record(code)
        builtin(code)

    recording.__doc__ = getattr(builtin, "__doc__", None)
    return recording


def _record(status: Any) -> None:
    """Record the code the process exits with, if ``status`` is the main thread's.

    In any other thread a SystemExit ends that thread alone, quietly: the process goes on.
    """
    if threading.current_thread() is threading.main_thread():
        _exit_status[0] = status


def track(connector: Any) -> None:
    """Keep an early exit fatal while ``connector`` is open; run before MPI's own finalize.

    mpi4py finalizes MPI in an exit handler registered when MPI starts; exit handlers run last
    registered first, so this one is registered again now.
    """
    _connectors.add(connector)
    _tracked[0] = True
    atexit.unregister(_end_job_if_leaving_early)
    atexit.register(_end_job_if_leaving_early)


def track_threads(threads: Any) -> None:
    """Keep MPI from being finalized under ``threads`` (``comm.worker.CommThreads``).

    While ``threads.busy()`` one of them may be inside MPI (an asynchronous call its peers
    never joined), and MPI_Finalize under it crashes the process: leaving, this rank then ends
    the job by MPI_Abort instead.
    """
    _threads.add(threads)


def leave_together(code: int) -> None:
    """Say that every rank is leaving now with ``code``: an exit with it then ends no job."""
    _together[0] = code


def note_progress() -> None:
    """Forget the code of an earlier sys.exit, exit or quit: the program went on.

    It caught the SystemExit (as a try around argparse does), so that code is not how it ends.
    """
    _exit_status[0] = None


def leaving_cleanly() -> bool:
    """Return whether this process is ending without an error (asked at exit).

    No sys.exit, exit or quit with a code, no uncaught exception shown by a hook of the
    program's own, and not every rank leaving together with a code; a bare
    ``raise SystemExit(n)`` is not seen.
    """
    return _exit_status[0] in (None, 0) and not _together[0] and _uncaught() is None


def _uncaught() -> BaseException | None:
    """Return the uncaught exception a hook of the program's own showed in ours' place, or None.

    Ours ends the job itself; pytest also sets sys.last_value, for a failed test.
    """
    if sys.excepthook is _end_job_on_exception or not _installed[0]:
        return None
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # 3.12+, 3.11


def _rank() -> str:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return str(mpi.COMM_WORLD.Get_rank())
    return launcher_rank()


def install_for_one_process() -> None:
    """Print an uncaught UsageError as one line and exit with USAGE_EXIT.

    For a process that no MPI launcher started; every other exception keeps the hook it had.
    """
    if _installed[0]:
        return
    previous = sys.excepthook

    def hook(exc_type: type, exc: BaseException, tb: Any) -> None:
        if isinstance(exc, UsageError) and not _debug():
            _say(str(exc))
            _leave(USAGE_EXIT)
        previous(exc_type, exc, tb)

    sys.excepthook = hook


# the failing ranks' word to each other (point to point on the world, a tag of meta_dist's own)
MISTAKE_TAG, PRINTED_TAG = 0x6D64, 0x6D65
MISTAKE_GRACE_S = 5.0  # how long a failing rank waits to hear which others failed too


def _debug() -> bool:
    return env_flag("META_DIST_DEBUG")


def _program() -> str:
    """The script's name, or ``python -m PACKAGE`` for a package run with -m."""
    if not sys.argv or not sys.argv[0]:
        return "python"
    path = Path(sys.argv[0])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if path.name == "__main__.py" and spec is not None:  # python -m a.b runs a/b/__main__.py
        return f"python -m {spec.name.removesuffix('.__main__')}"
    return path.name


def _end_job_on_exception(exc_type: type, exc: BaseException, tb: Any) -> None:
    if isinstance(exc, UsageError) and not _debug():
        _report_once(str(exc), USAGE_EXIT)
    if isinstance(exc, KeyboardInterrupt) and not _debug():
        _report_once("interrupted (SIGINT); nothing was saved after the last checkpoint", 130)
    _abort_on_exception(exc_type, exc, tb)


def _report_once(message: str, code: int) -> None:
    """Print ``message`` once for the job (the lowest failing rank) and end with ``code``.

    Every failing rank tells every other rank (a small isend on the world, MISTAKE_TAG), then
    listens up to MISTAKE_GRACE_S. The one that hears of no lower failing rank prints (rank 0
    at once) and says so (PRINTED_TAG); the others wait for that word before they leave, so the
    launcher cannot end the job before the line is out. If every rank failed (a config every
    rank read), the ranks leave together through the normal exit (no abort); else the job ends
    by MPI_Abort(code).
    """
    MPI = _started_mpi()  # starts MPI if the mistake came first: every rank does
    if MPI is None:  # no MPI here, or one that cannot start: a process alone
        rank = launcher_rank()
        if rank not in ("0", "?"):  # every rank fails alike: rank 0's line, and the end of
            time.sleep(MISTAKE_GRACE_S)  # the job for its exit code (mpirun), come first
        _say(message, "" if rank in ("0", "?") else f" on rank {rank}")
        _leave(code)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if rank == 0:
        _say(message)
    sends = [world.isend(None, dest=peer, tag=MISTAKE_TAG) for peer in range(size) if peer != rank]
    heard = _listen(world, MISTAKE_TAG, lambda got: len(got) == size - 1, MISTAKE_GRACE_S)
    everyone = len(heard) == size - 1
    if not any(peer < rank for peer in heard):  # the lowest failing rank
        if rank != 0:
            _say(message, f" on rank {rank} of {size} (host {socket.gethostname()}; "
                          f"{len(heard) + 1} failed)")
        sends += [world.isend(None, dest=peer, tag=PRINTED_TAG)
                  for peer in range(size) if peer != rank]
    else:
        _listen(world, PRINTED_TAG, bool, MISTAKE_GRACE_S)
    if everyone:
        MPI.Request.waitall(sends)
        if "MPICH" in MPI.Get_library_version():
            # Hydra kills the ranks still in MPI_Finalize once one exits non-zero (exit 9 and
            # its banner, seen 1 run in 5): one MPI_Abort by rank 0 ends them all with code
            world.Barrier()
            if rank == 0:
                end_job(code)
            time.sleep(MISTAKE_GRACE_S)  # rank 0's abort ends this rank
        _leave(code)
    end_job(code)


def _listen(world: Any, tag: int, enough: Any, seconds: float) -> set[int]:
    """Receive ``tag`` notes from any rank until ``enough(senders)`` or ``seconds`` pass."""
    from mpi4py import MPI

    heard: set[int] = set()
    status = MPI.Status()
    deadline = time.monotonic() + seconds
    while not enough(heard) and time.monotonic() < deadline:
        if world.iprobe(MPI.ANY_SOURCE, tag, status):
            world.recv(source=status.Get_source(), tag=tag)
            heard.add(status.Get_source())
        else:
            time.sleep(0.005)
    return heard


def _say(message: str, where: str = "") -> None:
    """Print ``<script>: error<where>: <message>`` on the real stderr, at once."""
    stream = sys.__stderr__ or sys.stderr
    with contextlib.suppress(Exception):
        stream.write(f"{_program()}: error{where}: {message}\n")
        stream.flush()


def _leave(code: int) -> None:
    """Exit with ``code`` through the exit handlers (the watchdogs stop, MPI finalizes).

    Or by MPI_Abort(code) while a communication thread may be inside MPI (``track_threads``).
    """
    if any(threads.busy() for threads in list(_threads)):
        end_job(code)
    leave_together(code)
    _exit_status[0] = code
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()  # what the interpreter would run at exit, then exit with code
    mpi = sys.modules.get("mpi4py.MPI")  # mpi4py finalizes at interpreter exit, which
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():  # os._exit skips
        with contextlib.suppress(Exception):
            mpi.Finalize()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    os._exit(code)


def _abort_on_exception(exc_type: type, exc: BaseException, tb: Any) -> None:
    lines = traceback.format_exception(exc_type, exc, tb)
    report = f"[rank {_rank()}] uncaught exception; aborting the job:\n" + "".join(lines)
    sys.stderr.write(report)
    # a hook that wraps this one may have pointed sys.stderr at a buffer it prints after we
    # return (torch.distributed's prefixes each line with the rank): we never return
    if sys.stderr is not sys.__stderr__ and sys.__stderr__ is not None:
        sys.__stderr__.write(report)
    end_job(1)


def _end_job_if_leaving_early() -> None:
    status, uncaught = _exit_status[0], _uncaught()
    code = 0 if status is None else status if isinstance(status, int) else 1
    if status is None and uncaught is not None:  # a hook of the program's own showed it
        code = 1
    if code in (0, _together[0]) or (_tracked[0] and not any(not c.closed for c in _connectors)):
        return
    what = (f"ends with an uncaught {type(uncaught).__name__} (shown by the program's own "
            "sys.excepthook)" if status is None else f"exits with code {code}")
    sys.stderr.write(f"[rank {_rank()}] {what} while the job is running; ending the job\n")
    end_job(code)


OUTPUT_GRACE_S = 0.5  # time for the launcher to forward what this rank wrote before the abort


def flush_output() -> None:
    """Flush every output stream and wait OUTPUT_GRACE_S for the launcher to forward it.

    MPICH's Hydra tears a job down on MPI_Abort without draining the ranks' pipes; on a loaded
    machine a report written just before was seen lost whole.
    """
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(Exception):  # a closed or broken stream: abort anyway
                stream.flush()
    time.sleep(OUTPUT_GRACE_S)


def end_job(code: int, *, grace: bool = True) -> None:
    """MPI_Abort(code) on the world, starting MPI first if needed (then every rank is in).

    With ``grace`` the output is first flushed and given OUTPUT_GRACE_S to reach the launcher
    (``flush_output``); a caller that must abort at once after its own last step (the
    watchdog, once the NCCL communicator is aborted and blocked threads run on) flushes first
    and passes False.
    """
    if grace:
        flush_output()
    MPI = _started_mpi()  # starts MPI if nothing did yet
    if MPI is None or MPI.Is_finalized():  # no MPI to end the job with: leave like any process
        os._exit(code)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPICH's MPI_Abort was seen to return in a process with threads


def _started_mpi() -> Any:
    """Return mpi4py.MPI, starting MPI if nothing did yet; None where it cannot start.

    None: no MPI library, or one whose MPI_Init would abort (``launcher.launcher_mismatch``).
    """
    if "mpi4py.MPI" not in sys.modules and launcher_mismatch() is not None:
        return None
    try:
        from mpi4py import MPI
    except Exception:  # no MPI library, or one that failed to start
        return None
    return MPI
