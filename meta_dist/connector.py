"""MPIConnector: the MPI world of this job (who am I, how many are we, on which node).

Imports mpi4py and meta_dist.failfast / launcher / blas_threads / errors only; everything else
in meta_dist that needs to know about ranks asks a connector. The connector also installs
the failure policy (``failfast``): a rank that raises or exits with an error ends the whole job,
so no peer is left waiting in a collective.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import meta_dist.blas_threads as blas_threads
import meta_dist.failfast as failfast
from meta_dist.errors import UsageError
from meta_dist.launcher import launcher_announcement
from meta_dist.lazy_mpi import MPI

ROOT_RANK = 0


class MPIConnector:
    """The MPI world: rank, size, local_rank, local_size, barrier and object broadcast.

    ``local_rank`` and ``local_size`` come from ``MPI_Comm_split_type(COMM_TYPE_SHARED)``: the
    ranks sharing this node's memory, which is right on every node of a multi-node job whatever
    the launcher (Open MPI, MPICH, Slurm).

    Args:
        comm: the communicator to wrap; defaults to ``MPI.COMM_WORLD``. It is duplicated, so
            meta_dist's traffic never matches a message of the caller's own.
        abort_on_exception: when the job has more than one rank, make an uncaught exception or
            ``sys.exit(n != 0)`` on this rank end the whole job (``meta_dist.failfast``).
    """

    def __init__(self, comm: MPI.Comm | None = None, *, abort_on_exception: bool = True) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        self._comm: MPI.Comm | None = base.Dup()
        self._node_comm: MPI.Comm | None = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self._local_rank = self._node_comm.Get_rank()
        self._local_size = self._node_comm.Get_size()
        # the stall watchdogs of this connector's open communicators (``meta_dist.watchdog``):
        # the oldest (the context's, usually) also watches the connector's own collectives
        self.watchdogs: list[Any] = []
        if comm is None:
            _check_launcher(self._size)
            blas_threads.share_cores(self._local_size)  # ranks on one node share its cores
        if abort_on_exception and self._size > 1:
            failfast.install()
            failfast.track(self)

    @property
    def comm(self) -> MPI.Comm:
        """The connector's own duplicate of the world communicator."""
        return self._live_comm("comm")

    @property
    def rank(self) -> int:
        """This process's rank, from 0 to size - 1."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks in the job."""
        return self._size

    @property
    def local_rank(self) -> int:
        """This process's rank among the ranks on its node (picks the GPU)."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        """The number of ranks on this process's node."""
        return self._local_size

    @property
    def root_rank(self) -> int:
        """The rank that makes decisions and prints (always 0)."""
        return ROOT_RANK

    @property
    def is_root(self) -> bool:
        """True on the root rank."""
        return self._rank == ROOT_RANK

    @property
    def host(self) -> str:
        """This rank's host name, as MPI reports it (MPI_Get_processor_name)."""
        return MPI.Get_processor_name()

    @property
    def library_version(self) -> str:
        """The MPI library's version line, printable (its C string ends in a NUL byte)."""
        return _library_line()

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._comm is None

    def barrier(self) -> None:
        """Wait until every rank has called barrier. Collective."""
        self._watched("barrier", lambda comm: comm.Barrier())

    def broadcast(self, obj: Any = None, root: int = ROOT_RANK) -> Any:
        """Return ``obj`` from rank ``root`` on every rank (pickled; for small control objects).

        Collective: every rank must call this, in the same order.
        """
        self._check_root("broadcast", root)
        return self._watched("broadcast", lambda comm: comm.bcast(obj, root=root))

    def allgather(self, obj: Any) -> list[Any]:
        """Return the list of every rank's ``obj``, indexed by rank (pickled). Collective."""
        return self._watched("allgather", lambda comm: comm.allgather(obj))

    def abort(self, code: int = 1) -> None:
        """Terminate every rank of the job now with exit status ``code`` (MPI_Abort)."""
        failfast.end_job(code)

    def close(self) -> None:
        """Free the connector's communicators; later calls raise RuntimeError. Collective."""
        if self._comm is not None:
            self._node_comm.Free()
            self._comm.Free()
            self._comm = self._node_comm = None

    def _watched(self, api: str, call: Callable[[MPI.Comm], Any]) -> Any:
        """Return ``call(comm)``, watched for stalls like a communicator's collectives."""
        comm = self._live_comm(api)
        failfast.note_progress()
        watchdog = self.watchdogs[0] if self.watchdogs else None
        if watchdog is None:
            return call(comm)
        watchdog.enter(f"MPIConnector.{api}", collective=False, needs="all")  # watchdog.ALL
        try:
            return call(comm)
        finally:
            watchdog.leave()

    def _live_comm(self, api: str) -> MPI.Comm:
        if self._comm is None:
            raise RuntimeError(
                f"MPIConnector.{api} used after close(); create a new MPIConnector "
                "(or call meta_dist.init()) first"
            )
        return self._comm

    def _check_root(self, api: str, root: int) -> None:
        if not 0 <= root < self._size:
            raise ValueError(
                f"MPIConnector.{api}: root out of range; got {root}, expected 0 <= root < "
                f"{self._size}"
            )


def _check_launcher(size: int) -> None:
    """Raise UsageError when the launcher announced more ranks than MPI started.

    The mark of an mpirun of another MPI than the one mpi4py loads: each process gets the
    launcher's variables but its MPI starts alone, as a job of size 1.
    """
    step_tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if size == 1 and step_tasks.isdigit() and int(step_tasks) > 1 and \
            launcher_announcement() is None:  # srun's tasks, each MPI alone
        raise UsageError(
            f"srun started {step_tasks} tasks (SLURM_STEP_NUM_TASKS={step_tasks}), but this "
            f"process's MPI started alone (size 1): srun offered no process-management "
            f"interface this MPI speaks ({_library_line()}); use srun --mpi=pmix for Open MPI "
            "(it speaks PMIx only), srun --mpi=pmi2 for MPICH, or mpirun (mpiexec) inside "
            "salloc or the batch script")
    announced = launcher_announcement()
    if announced is None or announced[1] == size:
        return
    beside = Path(sys.executable).parent / "mpirun"
    advice = (f"launch with the mpirun installed beside this Python ({beside})" if beside.exists()
              else "launch with the mpirun of the MPI that mpi4py was built for")
    raise UsageError(
        f"the launcher started {announced[1]} ranks ({announced[0]}={announced[1]}), but "
        f"this process's MPI started alone (size {size}): the mpirun that launched the job "
        f"belongs to another MPI than the one mpi4py loads ({_library_line()}); {advice}, or "
        "reinstall mpi4py for the MPI you launch with")


def _library_line() -> str:
    """The MPI library's version line, printable (its C string ends in a NUL byte)."""
    text = MPI.Get_library_version().splitlines()[0] if MPI.Get_library_version() else ""
    return "".join(c for c in text if c.isprintable()).strip()

