"""What the MPI launcher told this process before MPI starts: the job's size and this rank.

Leaf module (the standard library only): ``meta_dist.failfast`` and ``meta_dist.config`` read
it before any MPI call, e.g. to print ``--help`` once for the job rather than once per rank.
"""

from __future__ import annotations

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
