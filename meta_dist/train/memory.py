"""Memory as the system measures it, beside what ZeRO predicts (``zero.memory.predict``).

``PeakMeter`` reads a process's high-water mark: on the CPU the resident set's (Linux VmHWM,
which writing 5 to /proc/self/clear_refs resets to the RSS now; ru_maxrss elsewhere, which
cannot be reset), on a GPU the CuPy memory pool's most bytes in use. CuPy keeps no peak, so the
first meter on a GPU installs an allocator (``cupy.cuda.set_allocator``) that wraps the default
pool's ``malloc`` and reads ``used_bytes`` after each allocation: one Python call more per
allocation, for the rest of the process (a chained allocator someone set before is kept).
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import numpy as np

from meta_dist.zero.memory import FIELDS

MIB = 2**20


class PeakMeter:
    """This process's memory high-water mark, and its growth since ``reset``.

    Args:
        xp: numpy (host memory) or cupy (the current device's default memory pool).
    """

    def __init__(self, xp: Any = np) -> None:
        self.xp = xp
        self._pool = None if xp is np else _pool_peak(xp)
        self.base = self.current()

    def current(self) -> int:
        """Bytes held now: the resident set, or the pool's bytes in use."""
        if self._pool is None:
            return _status("VmRSS") or 0
        return self._pool.used()

    def peak(self) -> int:
        """Bytes at the high-water mark (since the process started or the last reset)."""
        if self._pool is None:
            hwm = _status("VmHWM")
            return hwm if hwm is not None else \
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self._pool.high

    def reset(self) -> None:
        """Measure from now: ``growth`` counts from here.

        The high-water mark restarts at what is held now, where the system allows (Linux).
        """
        if self._pool is None:
            try:
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass  # the peak then keeps the process's whole history
        else:
            self._pool.high = self._pool.used()
        self.base = self.current()

    def growth(self) -> int:
        """Bytes the high-water mark rose above what was held at the last reset."""
        return max(0, self.peak() - self.base)


class _PoolPeak:
    """The allocator that keeps the CuPy pool's peak of bytes in use (one per process)."""

    def __init__(self, cupy: Any) -> None:
        self.cupy, self.pool = cupy, cupy.get_default_memory_pool()
        self.inner = cupy.cuda.get_allocator()  # the pool's malloc, or a user's allocator
        self.high = self.used()
        cupy.cuda.set_allocator(self.malloc)

    def used(self) -> int:
        return int(self.pool.used_bytes())

    def malloc(self, size: int) -> Any:
        memory = self.inner(size)
        used = self.used()
        if used > self.high:
            self.high = used
        return memory


_POOL_PEAK: _PoolPeak | None = None


def _pool_peak(cupy: Any) -> _PoolPeak:
    global _POOL_PEAK
    if _POOL_PEAK is None or _POOL_PEAK.cupy is not cupy:
        _POOL_PEAK = _PoolPeak(cupy)
    return _POOL_PEAK


def _status(field: str) -> int | None:
    """Return a /proc/self/status field in bytes (None off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


HEADING = ("memory per rank, MiB predicted (the partition plan) / held (the arrays); peak "
           "growth: the high-water mark's rise since the start, measured (activations and "
           "temporaries included)")


def format_memory(predicted: dict[str, int], held: dict[str, int], growth: int) -> str:
    """Return one rank's predicted and held bytes (MiB) and its measured peak growth."""
    p, h = sum(predicted[k] for k in FIELDS), sum(held[k] for k in FIELDS)
    cells = "  ".join(f"{k} {predicted[k] / MIB:.3f}/{held[k] / MIB:.3f}" for k in FIELDS)
    return f"{cells}  total {p / MIB:.3f}/{h / MIB:.3f}  peak growth {growth / MIB:.1f}"
