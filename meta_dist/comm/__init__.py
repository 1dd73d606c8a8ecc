"""Communicators: one interface (``base.Communicator``), one module per backend.

Imports meta_dist.connector and the backend modules (NCCL lazily, so CPU-only machines never
import cupy). ``make_communicator`` is the only place a backend name is turned into a class.

One allreduce, from the call to the library, in reading order: ``meta_dist.allreduce``
(distributed.py: the default context's communicator for the array) -> ``Communicator.allreduce``
-> ``_run`` and ``_plan`` (base.py) -> ``plans.allreduce``, which checks the arguments on this
rank (checks.py) and returns ``run`` -> ``CommThreads.run`` (worker.py: now, or behind queued
async work, watched) calls it: ``_fingerprint`` (consistency.py: the ranks compare their calls)
-> ``Fusion.fuse`` (fusion.py: one flat buffer; a single array is its own) ->
``MpiCommunicator._allreduce`` (mpi_backend.py: MPI_Allreduce in place, or the pairwise exchange
for large messages) -> ``_average`` (op "avg") -> ``Fusion.unpack`` (a packed list).
"""

from __future__ import annotations

from typing import Any

from meta_dist.comm.base import Communicator, Handle
from meta_dist.connector import MPIConnector

BACKENDS = ("mpi", "nccl")


def make_communicator(backend: str, connector: MPIConnector, **kwargs: Any) -> Communicator:
    """Return a communicator of the named backend over ``connector``'s ranks.

    Collective: every rank must call this with the same backend.

    Args:
        backend: "mpi" (numpy arrays, and CuPy arrays through host or CUDA-aware MPI) or
            "nccl" (CuPy arrays through NCCL).
        connector: the MPI world.
        **kwargs: passed to the backend's constructor.

    Raises:
        ValueError: an unknown backend name.
        UsageError: the backend cannot run here (the message says what is missing).
    """
    if backend == "mpi":
        from meta_dist.comm.mpi_backend import MpiCommunicator

        return MpiCommunicator(connector, **kwargs)
    if backend == "nccl":
        from meta_dist.comm.nccl_backend import NcclCommunicator

        return NcclCommunicator(connector, **kwargs)
    raise ValueError(
        f"make_communicator: unknown backend; got {backend!r}, expected one of "
        f"{', '.join(BACKENDS)}"
    )


__all__ = ["BACKENDS", "Communicator", "Handle", "make_communicator"]
