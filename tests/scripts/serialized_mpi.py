"""Under MPI initialised without MPI_THREAD_MULTIPLE, the blocking collectives work and the
async ones are refused on every rank with the reason and the fix (not a crash or a hang), even
when one rank's arguments are bad too. With ``mixed``, rank 0 alone asks for 'serialized':
every rank refuses the communicator, since async calls would then be refused on one rank only."""
import os
import sys

import mpi4py

RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
MIXED = sys.argv[1:] == ["mixed"]
if not MIXED or RANK == 0:
    mpi4py.rc.thread_level = "serialized"  # before mpi4py.MPI is first imported

import numpy as np  # noqa: E402

import meta_dist  # noqa: E402

try:
    comm = meta_dist.init(backend="mpi").communicator("mpi")
except ValueError as error:
    print(f"refused: {error}")
    sys.exit(0)
total = meta_dist.allreduce(np.ones(3))
print(f"blocking allreduce: {total.tolist()}")
frozen = np.zeros(3)
frozen.flags.writeable = False
calls = [("allreduce_async", lambda: meta_dist.allreduce_async(np.ones(3))),
         ("send_async", lambda: comm.send_async(np.ones(3), peer=0)),
         ("allreduce_async", lambda: comm.allreduce_async(  # a bad out on rank 1 only
             np.ones(3), out=frozen if comm.rank == 1 else None))]
for name, call in calls:
    try:
        call()
        print(f"{name} was accepted")
    except RuntimeError as error:
        print(f"refused: {error}")
meta_dist.shutdown()
