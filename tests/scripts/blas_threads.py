"""Print each rank's OpenBLAS thread count after MPI starts: ``rank R blas_threads T cores C``."""

import os

import numpy as np  # noqa: F401 - loads OpenBLAS before MPI starts, as scripts do

from meta_dist import distributed as dist
from meta_dist.blas_threads import openblas_threads

context = dist.init()
lines = context.connector.allgather(
    f"rank {context.rank} blas_threads {openblas_threads()} cores {len(os.sched_getaffinity(0))}")
if context.rank == 0:
    print("\n".join(lines), flush=True)
dist.shutdown()
