"""A stalled or failing NCCL job must end, saying what waited (tests/test_gpu_standin.py).

    mpirun -np N python tests/scripts/nccl_stall.py MODE

Run on the CuPy/NCCL stand-in. MODE ``stall``: after one allreduce on every rank, rank 0 starts
another that no other rank joins (NCCL has no timeout of its own). ``error``: NCCL reports an
asynchronous error on rank 0's second call (META_DIST_STANDIN_NCCL_ASYNC_ERROR, set by the
test). ``init``: the last rank is stuck inside its NCCL initialisation, so the others wait in
theirs (ncclCommInitRank waits for every rank). The stall timeout is 3 s.
"""

import sys
import time

import cupy

from meta_dist import MPIConnector, make_communicator
from meta_dist.xp import select_device

MODE = sys.argv[1]
connector = MPIConnector()
select_device(connector.local_rank)
if MODE == "init" and connector.rank == connector.size - 1:
    from cupy.cuda import nccl

    def stuck(*args):
        time.sleep(60)  # as a rank whose bootstrap cannot reach rank 0 would

    nccl.NcclCommunicator = stuck
comm = make_communicator("nccl", connector, stall_timeout=3.0, check=MODE == "init")
x = cupy.ones(16, cupy.float32)
comm.allreduce(x, out=x)
print(f"rank {comm.rank}: first allreduce {float(x[0])}", flush=True)
if MODE in ("stall", "error") and comm.rank == 0:
    comm.allreduce(x, out=x)  # returns once enqueued: the host does not wait for NCCL
    print("rank 0: second allreduce enqueued", flush=True)
    float(x[0])  # the host waits here, for NCCL work that never finishes
    print("unreachable: the stalled allreduce finished", flush=True)
time.sleep(30)  # the other ranks idle; the job must end well before this
print(f"unreachable: rank {comm.rank} outlived the stall", flush=True)
