"""Knobs of the CuPy/NCCL stand-in: every environment variable it reads, in one place.

Leaf module of the stand-in (imports only the standard library); the other stand-in modules read
their settings here. Values are read when first needed and cached, except where noted.

Machine model:

- ``META_DIST_STANDIN_DEVICES`` (int, default 1): GPUs per host. ``CUDA_VISIBLE_DEVICES`` is
  honoured on top of it (a comma list of physical indices), as CUDA does; an empty value hides
  every device, so ``getDeviceCount()`` raises cudaErrorNoDevice.
- ``META_DIST_STANDIN_DEVICE_MEMORY`` (bytes, default 80 GiB): memory per device; the memory
  pool raises ``OutOfMemoryError`` beyond it.
- ``CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1``: the default current stream is ``Stream.ptds``
  instead of ``Stream.null`` (CuPy's own variable, read at import).

Asynchrony and checking:

- ``META_DIST_STANDIN_SEED`` (int, default 0): seeds each stream worker's random delays.
- ``META_DIST_STANDIN_DELAY_US`` ("lo:hi" microseconds, default "0:200"): every kernel, copy,
  event record and NCCL call waits a uniform random delay in [lo, hi] on its stream's worker
  before it runs, so a missing synchronisation shows up as a wrong result.
- ``META_DIST_STANDIN_RACES`` ("raise" or "off", default "raise"): "raise" makes an access to
  device memory that another stream touched without an event or host synchronisation ordering
  the two raise ``StandinRaceError`` when it is enqueued; "off" leaves only the delays.

NCCL model:

- ``META_DIST_STANDIN_NCCL_VERSION`` ("X.Y.Z" or an NCCL version code, default "2.28.9"): what
  ``nccl.get_version()`` reports and which features exist (avg and bfloat16 from 2.10, fp8 from
  2.24, ranks sharing a GPU from 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``).
- ``NCCL_MULTI_RANK_GPU_ENABLE=1``: NCCL's own opt-in for several ranks on one GPU (>= 2.30).
- ``NCCL_DEBUG=WARN|INFO|TRACE``: print the stand-in's NCCL warnings to stderr, as NCCL does.
- ``META_DIST_STANDIN_NCCL_HANG`` ("R:N[,R:N...]"): on every communicator, the N-th NCCL call
  (1-based, counting collectives, sends and receives) of rank R never completes: its stream
  stays busy until ``abort()``.
- ``META_DIST_STANDIN_NCCL_ASYNC_ERROR`` ("R:N:S[,...]"): the N-th call of rank R never
  completes and ``check_async_error()`` then reports NCCL status S (7 and 8 raise KeyError,
  CuPy's bug).
- ``META_DIST_STANDIN_NCCL_ABORT_HANG=1``: ``abort()`` (ncclCommAbort) never returns, as it
  was seen to hang, stuck in commFree or cudaFree (NVIDIA/nccl#992 on 2.18.1, #549); NCCL's
  fault-tolerance notes (usage/communicators.html) allow a safe abort only on non-blocking
  communicators with no other thread inside NCCL, and CuPy can only drive blocking ones.
- ``META_DIST_STANDIN_NCCL_INIT_TIMEOUT`` (seconds, default none): give up an init whose peers
  never arrive with NcclError(2) instead of blocking forever as NCCL does.
- ``META_DIST_STANDIN_RENDEZVOUS`` (directory, default ``$TMPDIR/meta_dist_standin_nccl``):
  where ranks of one unique id meet (ranks must share a file system: one host).

Installation (read by ``tests/standin/install.py``):

- ``META_DIST_STANDIN`` ("1" always use the stand-in, "0" never, unset: only when the real cupy
  cannot run).
"""

from __future__ import annotations

import functools
import os

ENV_DEVICES = "META_DIST_STANDIN_DEVICES"
ENV_DEVICE_MEMORY = "META_DIST_STANDIN_DEVICE_MEMORY"
ENV_SEED = "META_DIST_STANDIN_SEED"
ENV_DELAY = "META_DIST_STANDIN_DELAY_US"
ENV_RACES = "META_DIST_STANDIN_RACES"
ENV_NCCL_VERSION = "META_DIST_STANDIN_NCCL_VERSION"
ENV_NCCL_HANG = "META_DIST_STANDIN_NCCL_HANG"
ENV_NCCL_ASYNC_ERROR = "META_DIST_STANDIN_NCCL_ASYNC_ERROR"
ENV_NCCL_INIT_TIMEOUT = "META_DIST_STANDIN_NCCL_INIT_TIMEOUT"
ENV_NCCL_ABORT_HANG = "META_DIST_STANDIN_NCCL_ABORT_HANG"
ENV_RENDEZVOUS = "META_DIST_STANDIN_RENDEZVOUS"
ENV_INSTALL = "META_DIST_STANDIN"

DEFAULT_NCCL_VERSION = "2.28.9"  # torch 2.11's NCCL on the lent GPU machine (gpu_facts.md 8)
DEFAULT_DEVICE_MEMORY = 80 << 30


def reset() -> None:
    """Forget cached values so that changed environment variables take effect (tests only)."""
    for cached in (devices_per_host, visible_devices, device_memory, seed, delay_range_s,
                   nccl_version):
        cached.cache_clear()


def _int(name: str, default: int, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"{name}: not an integer; got {raw!r}, expected e.g. {default}") from None
    if value < minimum:
        raise ValueError(f"{name}: too small; got {value}, expected >= {minimum}")
    return value


@functools.cache
def devices_per_host() -> int:
    """Return the number of GPUs the modeled host has (before CUDA_VISIBLE_DEVICES)."""
    return _int(ENV_DEVICES, 1)


@functools.cache
def visible_devices() -> tuple[int, ...]:
    """Return the physical indices of the devices this process sees, in visible order."""
    total = devices_per_host()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return tuple(range(total))
    seen: list[int] = []
    for part in raw.split(","):
        part = part.strip()
        # CUDA stops at the first entry it cannot use and ignores the rest
        if not part.isdigit() or int(part) >= total or int(part) in seen:
            break
        seen.append(int(part))
    return tuple(seen)


@functools.cache
def device_memory() -> int:
    """Return the bytes of memory each modeled device has."""
    return _int(ENV_DEVICE_MEMORY, DEFAULT_DEVICE_MEMORY, 1)


@functools.cache
def seed() -> int:
    """Return the seed of the workers' random delays."""
    return _int(ENV_SEED, 0)


@functools.cache
def delay_range_s() -> tuple[float, float]:
    """Return the (low, high) delay before each stream operation, in seconds."""
    raw = os.environ.get(ENV_DELAY, "0:200").strip()
    try:
        low, high = (float(v) for v in raw.split(":"))
    except ValueError:
        raise ValueError(f"{ENV_DELAY}: expected 'lo:hi' in microseconds; got {raw!r}") from None
    if not 0 <= low <= high:
        raise ValueError(f"{ENV_DELAY}: expected 0 <= lo <= hi; got {raw!r}")
    return low * 1e-6, high * 1e-6


def races_raise() -> bool:
    """Return True when unordered cross-stream accesses raise (read on every check)."""
    raw = os.environ.get(ENV_RACES, "raise").strip().lower()
    if raw not in ("raise", "off"):
        raise ValueError(f"{ENV_RACES}: got {raw!r}, expected 'raise' or 'off'")
    return raw == "raise"


def encode_nccl_version(major: int, minor: int, patch: int) -> int:
    """Return NCCL's version code: X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after (nccl.h)."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


@functools.cache
def nccl_version() -> tuple[int, int, int]:
    """Return the modeled NCCL version as (major, minor, patch)."""
    raw = os.environ.get(ENV_NCCL_VERSION, DEFAULT_NCCL_VERSION).strip()
    parts = raw.split(".")
    try:
        if len(parts) == 3:
            return int(parts[0]), int(parts[1]), int(parts[2])
        code = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_NCCL_VERSION}: expected 'X.Y.Z' or a version code such as "
                         f"22809; got {raw!r}") from None
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def nccl_debug() -> bool:
    """Return True when NCCL_DEBUG asks for warnings."""
    return os.environ.get("NCCL_DEBUG", "").strip().upper() in ("WARN", "INFO", "TRACE")


def multi_rank_gpu_enabled() -> bool:
    """Return True when NCCL_MULTI_RANK_GPU_ENABLE=1 is set in this process."""
    return os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "").strip() == "1"


def _faults(name: str, fields: int) -> list[tuple[int, ...]]:
    raw = os.environ.get(name, "").strip()
    faults = []
    for item in filter(None, (p.strip() for p in raw.split(","))):
        try:
            values = tuple(int(v) for v in item.split(":"))
        except ValueError:
            values = ()
        if len(values) != fields:
            shape = "R:N" if fields == 2 else "R:N:S"
            raise ValueError(f"{name}: bad entry {item!r}; expected {shape}[,{shape}...]")
        faults.append(values)
    return faults


def nccl_hangs() -> list[tuple[int, int]]:
    """Return the injected hangs as (rank, n-th call) pairs (read at each communicator init)."""
    return [(r, n) for r, n in _faults(ENV_NCCL_HANG, 2)]


def nccl_async_errors() -> list[tuple[int, int, int]]:
    """Return the injected asynchronous errors as (rank, n-th call, status) triples."""
    return [(r, n, s) for r, n, s in _faults(ENV_NCCL_ASYNC_ERROR, 3)]


def nccl_abort_hangs() -> bool:
    """Return True if ncclCommAbort is to never return (read at each abort)."""
    return os.environ.get(ENV_NCCL_ABORT_HANG, "").strip() == "1"


def nccl_init_timeout() -> float | None:
    """Return the rendezvous timeout in seconds, or None to wait forever as NCCL does."""
    raw = os.environ.get(ENV_NCCL_INIT_TIMEOUT, "").strip()
    return float(raw) if raw else None


def rendezvous_dir() -> str:
    """Return the directory where the ranks of one NCCL unique id meet."""
    import tempfile
    from pathlib import Path

    return os.environ.get(ENV_RENDEZVOUS) or str(Path(tempfile.gettempdir())
                                                 / "meta_dist_standin_nccl")
