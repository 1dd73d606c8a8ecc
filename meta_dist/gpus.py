"""Which GPUs and which NCCL each rank has, and whether the job can run NCCL on them.

Imports meta_dist.xp (and the connector's interface for type hints); cupy only inside
functions, so every question is answered, with the reason, where cupy or a GPU is missing.
``backend: auto`` (``meta_dist.distributed``), the NCCL communicator and the doctor ask here
before anything starts NCCL.
"""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

from meta_dist.xp import select_device

if TYPE_CHECKING:
    from meta_dist.connector import MPIConnector

INSTALL_HINT = ("pip install 'meta_dist[gpu]' (cupy-cuda12x and nvidia-nccl-cu12; on CUDA 13 "
                "use cupy-cuda13x and nvidia-nccl-cu13), or use backend: mpi")
MULTI_RANK_GPU_VERSION = (2, 30, 0)  # first NCCL that lets ranks share a GPU (opt-in variable)


def nccl_unavailable_reason() -> str | None:
    """Return why NCCL cannot run in this process, or None when it can.

    Local: asks only this process (cupy imports, libnccl loads, a GPU is visible). To decide for
    the job, gather it from every rank (``connector.allgather``) so all ranks choose alike.
    """
    try:
        import cupy
    except Exception as error:  # ImportError, or a CUDA library that fails to load
        return (f"backend 'nccl' needs cupy with NCCL (import cupy failed: {error}); install "
                f"them: {INSTALL_HINT}")
    try:
        from cupy.cuda import nccl
        loaded = bool(nccl.available)
    except Exception:
        loaded = False
    if not loaded:
        return ("backend 'nccl' needs NCCL (cupy.cuda.nccl could not load libnccl.so.2; "
                f"CUPY_DEBUG_LIBRARY_LOAD=1 shows why); install it: {INSTALL_HINT}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, or CUDA_VISIBLE_DEVICES hides every device
        count, why = 0, f"{type(error).__name__}: {error}"
    else:
        why = "getDeviceCount() == 0"
    if count == 0:
        return (f"backend 'nccl' needs a CUDA GPU; got none visible ({why}); run where a GPU "
                "and its driver are visible (check CUDA_VISIBLE_DEVICES) with a cupy for the "
                f"driver's CUDA: {INSTALL_HINT}")
    return None


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """Return (major, minor, patch) of an NCCL version code.

    NCCL >= 2.9 encodes X*10000 + Y*100 + Z; older ones X*1000 + Y*100 + Z (nccl.h NCCL_VERSION).
    """
    if code < 10000:
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


def nccl_version() -> tuple[int, int, int] | None:
    """Return the loaded NCCL's (major, minor, patch), or None when NCCL does not load."""
    try:
        from cupy.cuda import nccl

        return decode_nccl_version(int(nccl.get_version())) if nccl.available else None
    except Exception:  # no cupy, or no libnccl: there is no version to report
        return None


def ranks_problem(api: str, problems: list[str | None]) -> str | None:
    """Return one message naming every rank with a problem (by rank index), or None."""
    by_problem: dict[str, list[int]] = {}
    for rank, problem in enumerate(problems):
        if problem is not None:
            by_problem.setdefault(problem, []).append(rank)
    if not by_problem:
        return None
    count = sum(len(ranks) for ranks in by_problem.values())
    parts = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: "
                      f"{problem}" for problem, ranks in by_problem.items())
    return f"{api}: NCCL cannot run on {count} of {len(problems)} ranks; {parts}"


def gpu_survey(connector: MPIConnector) -> tuple[int, list[str | None]]:
    """Make this rank's GPU current; return it and why NCCL cannot run on each rank. Collective.

    A rank's entry is None where NCCL can run: cupy and libnccl load, a GPU is visible, and no
    other rank uses the same GPU unless NCCL lets them share it (NCCL >= 2.30 with
    NCCL_MULTI_RANK_GPU_ENABLE=1, gpu_facts.md 2). Every rank gets the same list, so every rank
    decides alike (``backend: auto``) or raises alike (``backend: nccl``).

    Returns:
        This rank's device (-1 where none could be selected) and the per-rank reasons.
    """
    problem, device, bus = nccl_unavailable_reason(), -1, None
    if problem is None:
        try:
            device = select_device(connector.local_rank)
            import cupy

            bus = cupy.cuda.Device(device).pci_bus_id
        except Exception as error:
            problem = f"selecting a GPU for local rank {connector.local_rank}: {error}"
    may_share = (os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
                 and (nccl_version() or (0, 0, 0)) >= MULTI_RANK_GPU_VERSION)
    everyone = connector.allgather((problem, platform.node(), bus, may_share))
    users: dict[tuple[str, str], list[int]] = {}
    for rank, (_, host, gpu, _) in enumerate(everyone):
        if gpu is not None:
            users.setdefault((host, gpu), []).append(rank)
    problems = [p for p, _, _, _ in everyone]
    for (host, gpu), ranks in users.items():
        if len(ranks) > 1 and not all(everyone[r][3] for r in ranks):
            for r in ranks:
                problems[r] = problems[r] or (
                    f"ranks {', '.join(map(str, ranks))} share GPU {gpu} on {host}; got "
                    f"{len(ranks)} ranks on one GPU, expected one GPU per rank; start one rank "
                    "per GPU, set NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30, experimental), "
                    "or use backend: mpi")
    return device, problems
