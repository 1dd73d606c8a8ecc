"""Rank 1 takes another path and never calls the collective; the stall timeout ends the job."""
import time

import numpy as np

from meta_dist import MPIConnector, make_communicator

connector = MPIConnector()
comm = make_communicator("mpi", connector, stall_timeout=3)
if connector.rank == 1:
    time.sleep(60)  # a rank stuck elsewhere (e.g. an uneven last batch)
else:
    comm.allreduce(np.ones(4))
