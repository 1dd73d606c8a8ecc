"""Device memory of the stand-in: allocations, fake addresses, pool accounting, pinned memory.

Imports the stand-in's _engine, _knobs and _errors. A device allocation is a numpy byte buffer
that only stream workers touch, at a fake address that is stable, unique in the process and
never reused (so a stale pointer is always caught). Accounting follows CuPy's MemoryPool
(cupy/cuda/memory.pyx): sizes rounded up to 512 bytes, freed blocks kept per stream ("arena")
and reused by that stream's next allocations, ``used_bytes``/``total_bytes``/``free_bytes``,
``free_all_blocks``, ``set_limit``; zero-byte arrays get pointer 0 and no block.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import weakref

import numpy as np

from . import _engine, _knobs

ALLOCATION_UNIT = 512  # CuPy's ALLOCATION_UNIT_SIZE
_BASE_ADDRESS = 0x7F00_0000_0000
_STORAGE_IDS = itertools.count(1)
_NEXT_ADDRESS: dict[int, int] = {}
_BY_ADDRESS: dict[int, Storage] = {}
_ADDRESSES: list[int] = []  # sorted keys of _BY_ADDRESS
_PINNED: dict[int, tuple[int, weakref.ref]] = {}  # start -> (end, the numpy array's base)
# Finalizers only append here (deque appends are atomic); the work happens at the next stand-in
# call, under the engine lock. A finalizer can run in any thread at any allocation, even inside
# a locked section, so taking the lock (or touching shared tables) there could deadlock.
_DROPPED: collections.deque = collections.deque()


class OutOfMemoryError(MemoryError):
    """Out-of-memory error, worded as CuPy's (cupy.cuda.memory.OutOfMemoryError)."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        self._size, self._total, self._limit = size, total, limit
        if limit == 0:
            message = (f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} "
                       f"bytes).")
        else:
            message = (f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} "
                       f"bytes, limit set to: {limit:,} bytes).")
        super().__init__(message)


class Storage:
    """The bytes of one device allocation; kernels reach them, the host never does."""

    __slots__ = ("__weakref__", "accesses", "buf", "device", "freed", "ident", "nbytes", "ptr")

    def __init__(self, device: int, nbytes: int, ptr: int) -> None:
        self.device, self.nbytes, self.ptr = device, nbytes, ptr
        self.ident = next(_STORAGE_IDS)
        # garbage, not zeros: reading memory nobody wrote gives NaN / -1, as a reused block would
        self.buf = np.full(nbytes, 0xFF, np.uint8)
        self.accesses: list[_engine.Access] = []
        self.freed = False

    def describe(self) -> str:
        """Return e.g. "allocation 0x7f0000000200 (4096 bytes, device 0)"."""
        return f"allocation {self.ptr:#x} ({self.nbytes} bytes, device {self.device})"

    def view(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
             dtype: np.dtype) -> np.ndarray:
        """Return a numpy view of these bytes (stream workers only)."""
        if not _engine.in_worker():
            raise RuntimeError("cupy stand-in: device memory read on the host outside a "
                               "stream operation (internal error of the stand-in)")
        return np.ndarray(shape, dtype, buffer=self.buf, offset=offset, strides=strides)

    def shadow(self, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
               dtype: np.dtype) -> np.ndarray:
        """Return a numpy array with this layout, for view arithmetic only (never read it)."""
        return np.ndarray(shape, dtype, buffer=self.buf, offset=offset, strides=strides)


class Allocation:
    """Ownership of one Storage: when the last array using it is dropped, it goes back to the pool.

    The finalizer runs when Python drops the last reference, whatever the device still does
    with the memory, exactly as CuPy's PooledMemory does.
    """

    __slots__ = ("__weakref__", "storage")

    def __init__(self, storage: Storage, rounded: int, queue: _engine.Queue,
                 pool: DevicePool | None) -> None:
        self.storage = storage
        weakref.finalize(self, _DROPPED.append, ("free", storage, rounded, queue, pool))


def process_dropped() -> None:
    """Return dropped allocations to their pools and unregister dropped pinned arrays.

    Called under the engine lock at each stand-in call that could observe them: the pool
    reuses a freed block only at the next allocation, so checking here (rather than in the
    finalizer) sees the same stream order CuPy's pool would.
    """
    while _DROPPED:
        item = _DROPPED.popleft()
        if item[0] == "unpin":
            _PINNED.pop(item[1], None)
            continue
        _, storage, rounded, queue, pool = item
        storage.freed = True
        if storage.ptr:
            del _BY_ADDRESS[storage.ptr]
            _ADDRESSES.pop(bisect.bisect_left(_ADDRESSES, storage.ptr))
        _engine.note_free(storage, queue)
        if pool is not None:
            pool.give_back(rounded, queue.id)
        # the bytes stay readable: queued kernels hold the Storage, and addresses are never
        # reused, so a late use cannot touch another array's data


class DevicePool:
    """CuPy's SingleDeviceMemoryPool accounting for one device (per-stream free lists)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.used = 0
        self.total = 0
        self.limit = 0
        self.free: dict[int, list[int]] = {}  # arena (queue id) -> sorted free block sizes

    def take(self, nbytes: int, arena: int) -> int:
        """Reserve a block for ``nbytes``; return its rounded size.

        Raises:
            OutOfMemoryError: past the pool limit or the device memory, after freeing the
                cached blocks once (CuPy retries after free_all_blocks).
        """
        rounded = -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT
        blocks = self.free.get(arena, [])
        index = bisect.bisect_left(blocks, rounded)
        if index < len(blocks):  # best fit; the remainder stays free (CuPy splits chunks)
            size = blocks.pop(index)
            if size > rounded:
                bisect.insort(blocks, size - rounded)
            self.used += rounded
            return rounded
        if not self._fits(rounded):
            self.free_all(None)
            if not self._fits(rounded):
                raise OutOfMemoryError(nbytes, self.total, self.limit)
        self.total += rounded
        self.used += rounded
        return rounded

    def _fits(self, rounded: int) -> bool:
        capacity = min(self.limit or _knobs.device_memory(), _knobs.device_memory())
        return self.total + rounded <= capacity

    def give_back(self, rounded: int, arena: int) -> None:
        """Return a block to its stream's free list."""
        self.used -= rounded
        bisect.insort(self.free.setdefault(arena, []), rounded)

    def free_all(self, arena: int | None) -> None:
        """Release cached free blocks (of one arena, or all)."""
        for key in list(self.free) if arena is None else [arena]:
            self.total -= sum(self.free.pop(key, []))

    def n_free_blocks(self) -> int:
        """Return the number of cached free blocks."""
        return sum(len(blocks) for blocks in self.free.values())


_POOLS: dict[int, DevicePool] = {}


def pool(device: int) -> DevicePool:
    """Return the pool accounting of device ``device`` (after processing dropped arrays)."""
    with _engine.LOCK:
        process_dropped()
        found = _POOLS.get(device)
        if found is None:
            found = _POOLS[device] = DevicePool(device)
        return found


def allocate(nbytes: int, queue: _engine.Queue) -> Allocation:
    """Allocate ``nbytes`` on ``queue``'s device from its stream's arena."""
    device = queue.device.index
    with _engine.LOCK:
        process_dropped()
        if nbytes == 0:
            return Allocation(Storage(device, 0, 0), 0, queue, None)
        device_pool = pool(device)
        rounded = device_pool.take(nbytes, queue.id)
        start = _NEXT_ADDRESS.get(device, _BASE_ADDRESS + (device << 40))
        _NEXT_ADDRESS[device] = start + rounded
        storage = Storage(device, nbytes, start)
        _BY_ADDRESS[start] = storage
        bisect.insort(_ADDRESSES, start)
        return Allocation(storage, rounded, queue, device_pool)


def find(ptr: int) -> tuple[Storage, int] | None:
    """Return (live storage, offset) holding device address ``ptr``, or None."""
    with _engine.LOCK:
        process_dropped()
        index = bisect.bisect_right(_ADDRESSES, ptr) - 1
        if index < 0:
            return None
        storage = _BY_ADDRESS[_ADDRESSES[index]]
        offset = ptr - storage.ptr
        return (storage, offset) if offset < storage.nbytes else None


def register_pinned(array: np.ndarray) -> None:
    """Mark ``array``'s memory as page-locked (cupyx.empty_pinned)."""
    if array.nbytes == 0:
        return
    start = array.__array_interface__["data"][0]
    with _engine.LOCK:
        process_dropped()
        _PINNED[start] = (start + array.nbytes, weakref.ref(array))
    weakref.finalize(array, _DROPPED.append, ("unpin", start))


def is_pinned(array: np.ndarray) -> bool:
    """Return True if all of ``array``'s bytes lie in page-locked memory."""
    return pinned_owner(array) is not None


def pinned_owner(array: np.ndarray) -> tuple[weakref.ref, int] | None:
    """Return (a weak reference to the pinned array holding all of ``array``'s bytes, the
    byte offset of ``array``'s data in it), or None when ``array`` is not page-locked."""
    if array.nbytes == 0:
        return None
    lo = array.__array_interface__["data"][0]
    with _engine.LOCK:
        process_dropped()
        for start, (end, ref) in _PINNED.items():
            if start <= lo < end and ref() is not None:
                return (ref, lo - start) if lo + array.nbytes <= end else None
    return None


def memory_info(device: int) -> tuple[int, int]:
    """Return (free, total) bytes of device ``device`` (cudaMemGetInfo)."""
    _engine.device(device)
    capacity = _knobs.device_memory()
    return capacity - pool(device).total, capacity


_engine.DROPPED_HOOKS.append(process_dropped)
