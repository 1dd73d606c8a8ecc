"""meta_dist: collective communication and ZeRO data-parallel training for numpy and CuPy.

Public names only; no logic. ``from meta_dist import distributed as dist`` gives the context
(``dist.get_context()``); ``meta_dist.allreduce(x)`` and friends run on it.
"""

from meta_dist import distributed
from meta_dist.comm import Communicator, Handle, make_communicator
from meta_dist.connector import MPIConnector
from meta_dist.distributed import (
    allgather,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    get_context,
    init,
    recv,
    reduce,
    reduce_scatter,
    send,
    shutdown,
)
from meta_dist.xp import contiguous_arrays

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "Handle",
    "MPIConnector",
    "allgather",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "contiguous_arrays",
    "distributed",
    "get_context",
    "init",
    "make_communicator",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "shutdown",
]
