"""One node's cores shared out among its ranks' BLAS threads, as torchrun does for OpenMP.

Leaf module: standard library only. numpy's OpenBLAS starts one thread per core in every
process; with several ranks on a node and no binding (Open MPI binds only while ranks <= cores;
MPICH's Hydra does not bind by default) each rank's threads then spin against the others' for
the same cores, and a step that should take milliseconds waits for time slices. So each rank
keeps ``cores // ranks on its node`` threads (at least one, and never more than it had), unless
the user chose (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or MKL_NUM_THREADS set), or the launcher
bound the rank to part of the node (OpenBLAS then sized itself to those cores). numpy reads those
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

    The share is ``cores // local_size`` (at least one), never more than OpenBLAS already
    uses. Returns None where nothing was changed: one rank on the node, the user set a thread
    count, the launcher bound this rank to part of the node (its binding decides), or no
    OpenBLAS is loaded.
    """
    cores = os.cpu_count() or 1
    if local_size <= 1 or any(os.environ.get(name) for name in USER_VARS):
        return None
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < cores:
        return None  # bound: OpenBLAS sized itself to the cores the launcher gave this rank
    share, changed = max(1, cores // local_size), None
    for library in _loaded_openblas():
        setter = next((getattr(library, name) for name in SETTERS if hasattr(library, name)),
                      None)
        current = _threads_of(library)
        if setter is not None and (current is None or share < current):
            setter(share)
            changed = share
    return changed


def use_threads(count: int) -> None:
    """Run this process's BLAS with ``count`` threads, as OMP_NUM_THREADS etc. would at start.

    The variables for libraries not loaded yet (torch's OpenMP), the OpenBLAS setter for the one
    numpy loaded. A benchmark's fairness setting, not training's (``share_cores``).
    """
    for name in USER_VARS:
        os.environ[name] = str(count)
    for library in _loaded_openblas():
        setter = next((getattr(library, name) for name in SETTERS if hasattr(library, name)),
                      None)
        if setter is not None:
            setter(count)


def openblas_threads() -> int | None:
    """Return the thread count of the OpenBLAS numpy loaded (None without one)."""
    for library in _loaded_openblas():
        count = _threads_of(library)
        if count is not None:
            return count
    return None


def _threads_of(library: ctypes.CDLL) -> int | None:
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
