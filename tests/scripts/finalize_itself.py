"""A program that finalizes MPI itself, as many mpi4py scripts end (tests/test_launch.py).

    mpirun -np 2 python tests/scripts/finalize_itself.py

meta_dist's communicator is still open when MPI_Finalize runs; whatever runs at exit must not
call MPI after it. The ranks stay alive a moment after finalizing, as a watchdog polls.
"""

import time

import numpy as np
from mpi4py import MPI

import meta_dist

meta_dist.init()
meta_dist.allreduce(np.ones(4))
MPI.Finalize()
time.sleep(1.0)  # a few watchdog polls after MPI is gone
print("finalized, rank done", flush=True)
