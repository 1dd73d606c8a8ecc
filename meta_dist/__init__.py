"""meta_dist: collective communication and ZeRO data-parallel training for numpy and CuPy.

Public names only; no logic. ``from meta_dist import distributed as dist`` gives the context
(``dist.get_context()``); ``meta_dist.allreduce(x)`` and friends run on it. Importing meta_dist
(or any part of it but ``comm`` and ``connector``) starts no MPI: MPI starts with the context
(``dist.init()``, ``get_context()``) or an ``MPIConnector``, so a script that fails before that
ends like any program, and mpirun ends the job.
"""

from typing import Any

from meta_dist import distributed, failfast
from meta_dist.distributed import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_async,
    get_context,
    init,
    recv,
    recv_async,
    reduce,
    reduce_async,
    reduce_scatter,
    reduce_scatter_async,
    send,
    send_async,
    shutdown,
)
from meta_dist.launcher import launched_size
from meta_dist.xp import contiguous_arrays

__version__ = "0.1.0"

if launched_size() > 1:  # a rank of several: failing before MPI starts ends the job
    failfast.install()
else:  # a process alone: a user's mistake is one line, not a traceback
    failfast.install_for_one_process()

_STARTS_MPI = {"Communicator": "meta_dist.comm", "Handle": "meta_dist.comm",
               "make_communicator": "meta_dist.comm", "MPIConnector": "meta_dist.connector"}


def __getattr__(name: str) -> Any:
    """Import the names that need MPI on first use (PEP 562), not with the package."""
    if name in _STARTS_MPI:
        import importlib

        return getattr(importlib.import_module(_STARTS_MPI[name]), name)
    raise AttributeError(f"module 'meta_dist' has no attribute {name!r}")


__all__ = [
    "Communicator",
    "Handle",
    "MPIConnector",
    "allgather",
    "allgather_async",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "contiguous_arrays",
    "distributed",
    "get_context",
    "init",
    "make_communicator",
    "recv",
    "recv_async",
    "reduce",
    "reduce_async",
    "reduce_scatter",
    "reduce_scatter_async",
    "send",
    "send_async",
    "shutdown",
]
