"""Rank 1 raises while every other rank waits in an allreduce: the job must end, not hang."""
import numpy as np

import meta_dist
from meta_dist import distributed as dist

dctx = dist.get_context()
if dctx.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
meta_dist.allreduce(np.ones(4))
print("unreachable: allreduce returned without rank 1", flush=True)
