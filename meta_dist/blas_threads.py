"""One node's cores shared out among its ranks' BLAS threads, as torchrun does for OpenMP.

Leaf module: standard library only. numpy's OpenBLAS starts one thread per core in every
process; with several ranks on a node and no binding (Open MPI binds only while ranks <= cores;
MPICH's Hydra does not bind by default) each rank's threads then spin against the others' for
the same cores, and a step that should take milliseconds waits for time slices. So each rank
keeps ``cores it may run on // ranks on its node`` threads (at least one), unless the user chose
(OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS set), or the launcher bound the rank
to its own cores (its affinity mask then already leaves BLAS that many). numpy reads those
variables only when it loads, which is usually before MPI starts, so the count is set through
OpenBLAS's own ``openblas_set_num_threads`` in the library numpy loaded.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

USER_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# the setter's name in numpy's bundled OpenBLAS (64-bit ints, scipy_ prefix) and in plain builds
SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
           "openblas_set_num_threads64_", "openblas_set_num_threads")


def share_cores(local_size: int) -> int | None:
    """Limit this process's OpenBLAS threads to its share of the node; return the count set.

    Returns None where nothing was changed: the user set a thread count, no OpenBLAS is loaded,
    or the share is not below what OpenBLAS already uses.
    """
    if local_size <= 1 or any(os.environ.get(name) for name in USER_VARS):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = max(1, (cores or 1) // local_size)
    for library in _loaded_openblas():
        setter = next((getattr(library, name) for name in SETTERS if hasattr(library, name)),
                      None)
        if setter is not None:
            setter(share)
            return share
    return None


def openblas_threads() -> int | None:
    """Return the thread count of the OpenBLAS numpy loaded (None without one)."""
    for library in _loaded_openblas():
        for name in SETTERS:
            getter = name.replace("set_num_threads", "get_num_threads")
            if hasattr(library, getter):
                return int(getattr(library, getter)())
    return None


def _loaded_openblas() -> list[ctypes.CDLL]:
    """The OpenBLAS libraries mapped into this process (Linux: /proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return []
    paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps.read_text())))
    libraries = []
    for path in paths:
        try:
            libraries.append(ctypes.CDLL(path))
        except OSError:
            continue
    return libraries
