"""Ctrl-C while a call waits on the communication thread must end the job cleanly.

    mpirun -np N python tests/scripts/interrupted_mid_call.py

Run by tests/test_user_mistakes.py. Every rank is interrupted, as MPICH's mpiexec forwards
SIGINT to each: rank 0 once its allreduce_async waits in MPI on the communication thread for
ranks that never join it (they are interrupted before they start theirs). Rank 0 says so if
MPI is finalized while that call still waits (which crashes the thread, though not always
before the process exits).
"""

import time

import numpy as np
from mpi4py import MPI

from meta_dist import MPIConnector, make_communicator

connector = MPIConnector()
comm = make_communicator("mpi", connector)
if connector.rank == 0:
    x = np.ones(4, np.float32)
    handle = comm.allreduce_async(x, out=x)

    def finalize(finalize=MPI.Finalize):
        if not handle.done():
            print("rank 0: MPI_Finalize while the allreduce waits in MPI", flush=True)
        finalize()

    MPI.Finalize = finalize
    time.sleep(0.5)  # its thread now waits in MPI for the other ranks
raise KeyboardInterrupt  # what SIGINT raises in the main thread
