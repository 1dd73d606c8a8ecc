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
- a clean exit (0) finalizes as usual.
Ending the job is MPI_Abort(n), after starting MPI if it had not started yet. ``sys.exit`` is
wrapped to learn n: an exit handler cannot see it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
import traceback
import weakref
from typing import Any

# how each launcher tells a process its place in the job (Open MPI, MPICH Hydra, Slurm/PMIx)
_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS")
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")

_exit_status: list[Any] = [None]  # what sys.exit was last given
_connectors: weakref.WeakSet[Any] = weakref.WeakSet()  # open ones keep an early exit fatal
_installed, _tracked = [False], [False]
_together: list[int | None] = [None]  # the exit code every rank leaves with (leave_together)


def launched_size() -> int:
    """Return the job's size as the MPI launcher announced it (1 without a launcher)."""
    for name in _SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def install() -> None:
    """Make an uncaught exception or ``sys.exit(n != 0)`` end the whole job (idempotent)."""
    if _installed[0]:
        return
    _installed[0] = True
    sys.excepthook = _abort_on_exception
    real_exit = sys.exit

    def recording_exit(status: Any = None) -> None:
        _exit_status[0] = status
        real_exit(status)

    recording_exit.__doc__ = real_exit.__doc__
    sys.exit = recording_exit
    atexit.register(_end_job_if_leaving_early)


def track(connector: Any) -> None:
    """Keep an early exit fatal while ``connector`` is open; run before MPI's own finalize.

    mpi4py finalizes MPI in an exit handler registered when MPI starts; exit handlers run last
    registered first, so this one is registered again now.
    """
    _connectors.add(connector)
    _tracked[0] = True
    atexit.unregister(_end_job_if_leaving_early)
    atexit.register(_end_job_if_leaving_early)


def leave_together(code: int) -> None:
    """Say that every rank is leaving now with ``code``: an exit with it then ends no job."""
    _together[0] = code


def _rank() -> str:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return str(mpi.COMM_WORLD.Get_rank())
    return next((os.environ[n] for n in _RANK_VARS if n in os.environ), "?")


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
    status = _exit_status[0]
    code = 0 if status is None else status if isinstance(status, int) else 1
    if code in (0, _together[0]) or (_tracked[0] and not any(not c.closed for c in _connectors)):
        return
    sys.stderr.write(f"[rank {_rank()}] exits with code {code} while the job is running; "
                     "ending the job\n")
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
    try:
        from mpi4py import MPI  # starts MPI if nothing did yet
    except Exception:  # no MPI to end the job with: leave like any process
        os._exit(code)
    if MPI.Is_finalized():
        os._exit(code)
    MPI.COMM_WORLD.Abort(code)
