"""Under MPI initialised without MPI_THREAD_MULTIPLE, the blocking collectives work and the
async ones are refused on every rank with the reason and the fix (not a crash or a hang)."""
import mpi4py

mpi4py.rc.thread_level = "serialized"  # before mpi4py.MPI is first imported

import numpy as np  # noqa: E402

import meta_dist  # noqa: E402

comm = meta_dist.init(backend="mpi").communicator("mpi")
total = meta_dist.allreduce(np.ones(3))
print(f"blocking allreduce: {total.tolist()}")
for name, call in [("allreduce_async", lambda: meta_dist.allreduce_async(np.ones(3))),
                   ("send_async", lambda: comm.send_async(np.ones(3), peer=0))]:
    try:
        call()
        print(f"{name} was accepted")
    except RuntimeError as error:
        print(f"refused: {error}")
meta_dist.shutdown()
