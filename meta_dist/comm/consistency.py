"""The cross-rank consistency check run before every collective, and the stall timeout.

Imports numpy, mpi4py and meta_dist.xp. The ranks compare a fingerprint of (operation, op,
root, dtype, shapes, array kind) with one small allreduce (max of x and of -x gives max and min
at once); on a difference every rank raises the same ValueError listing each rank's arrays. The
wait is bounded so that a rank which never arrives is reported instead of hanging the job.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from meta_dist.xp import is_cupy_array

KINDS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "send", "recv")


def shape_code(shapes: Sequence[tuple[int, ...]]) -> int:
    """Return a deterministic 62-bit code of a list of shapes (same on every rank and run)."""
    code = 1469598103934665603
    for shape in shapes:
        for dim in (len(shape), *shape):
            code = ((code ^ (dim + 0x9E37)) * 1099511628211) % (1 << 62)
        code = (code * 31 + 7) % (1 << 62)
    return code


class ConsistencyCheck:
    """Compare every rank's call before a collective runs.

    Args:
        comm: a communicator of its own (a Dup), used only for the check.
        stall_timeout: seconds to wait for the other ranks (None: forever).
    """

    def __init__(self, comm: MPI.Comm, stall_timeout: float | None) -> None:
        self.comm, self.stall_timeout = comm, stall_timeout
        self.rank = comm.Get_rank()

    def verify(self, api: str, arrays: list[Any], dtypes: Sequence[np.dtype],
               op_code: int, root: int) -> None:
        """Raise ValueError on every rank if the ranks called different collectives or shapes.

        Collective: every rank calls it with its own arguments.
        """
        on_gpu = is_cupy_array(arrays[0])
        mine = np.array([KINDS.index(api), op_code, root, dtypes.index(arrays[0].dtype),
                         len(arrays), shape_code([a.shape for a in arrays]), on_gpu], np.int64)
        both = np.concatenate([mine, -mine])
        self.wait(api, self.comm.Iallreduce(MPI.IN_PLACE, both, op=MPI.MAX))
        if np.array_equal(both[: mine.size], -both[mine.size :]):
            return
        kind = "cupy " if on_gpu else ""
        described = f"{api} of {', '.join(f'{kind}{a.dtype} {tuple(a.shape)}' for a in arrays)}"
        listing = "; ".join(f"rank {r}: {d}" for r, d in enumerate(self.comm.allgather(described)))
        raise ValueError(
            f"{api}: the ranks passed different arrays or called different collectives: "
            f"{listing}; every rank must call the same collective with the same shapes, dtype, "
            "op and root"
        )

    def wait(self, api: str, request: MPI.Request) -> None:
        """Wait for a request, raising RuntimeError if peers are missing past stall_timeout."""
        if self.stall_timeout is None:
            request.Wait()
            return
        spins = 0
        deadline = time.monotonic() + self.stall_timeout
        while not request.Test():
            spins += 1
            if spins > 200:  # spin briefly for latency, then yield the core to peers
                time.sleep(0.0002 if spins < 20000 else 0.005)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{api}: rank {self.rank} waited {self.stall_timeout:.0f} s for the other "
                        "ranks to reach this collective; some rank took another path (different "
                        "control flow, an uneven last batch) or is stuck; the job is aborted"
                    )
