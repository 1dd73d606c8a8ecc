"""cupy.cuda.memory of the stand-in: MemoryPointer, Memory, MemoryPool, OutOfMemoryError.

Imports the stand-in's _engine and _memory. Mirrors cupy/cuda/memory.pyx
(https://docs.cupy.dev/en/stable/reference/generated/cupy.cuda.MemoryPool.html): one pool for
all devices whose methods answer for the current device; ``used_bytes``, ``total_bytes``,
``free_bytes``, ``n_free_blocks``, ``free_all_blocks(stream=None)``, ``set_limit``,
``get_limit``, ``malloc``. CuPy's pool has no peak counter, so neither has this one. Every new
array's memory comes from the current allocator (``alloc``; ``set_allocator``,
``get_allocator``; docs.cupy.dev, reference/generated/cupy.cuda.set_allocator.html),
by default the default pool's ``malloc``. Stricter than CuPy: an allocator must return a
MemoryPointer of at least the size asked for (TypeError/ValueError), and ``set_allocator(None)``
(CuPy: raw cudaMalloc, no pool) raises NotImplementedError: the stand-in models the pool only.
"""

from __future__ import annotations

from typing import Any

from .. import _engine, _memory
from .._memory import OutOfMemoryError

__all__ = ["Memory", "MemoryPointer", "MemoryPool", "OutOfMemoryError", "alloc", "get_allocator",
           "set_allocator"]


class Memory:
    """A device allocation: ``ptr``, ``size`` (bytes) and ``device_id``."""

    def __init__(self, allocation: _memory.Allocation) -> None:
        self._allocation = allocation
        storage = allocation.storage
        self.ptr, self.size, self.device_id = storage.ptr, storage.nbytes, storage.device

    def __int__(self) -> int:
        return self.ptr


class MemoryPointer:
    """A device address inside an allocation: ``mem`` plus a byte offset."""

    def __init__(self, mem: Memory, offset: int) -> None:
        self.mem = mem
        self._offset = offset
        self.device_id = mem.device_id
        self.ptr = mem.ptr + offset if mem.ptr else 0

    @property
    def device(self) -> Any:
        """The Device the memory is on."""
        from .device import Device

        return Device(self.device_id)

    def __int__(self) -> int:
        return self.ptr

    def __add__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self._offset + int(offset))

    def __sub__(self, offset: int) -> MemoryPointer:
        return MemoryPointer(self.mem, self._offset - int(offset))

    def __repr__(self) -> str:
        return f"<MemoryPointer {self.ptr:#x} (device {self.device_id})>"


class MemoryPool:
    """CuPy's device memory pool; every method answers for the current device."""

    def _pool(self) -> _memory.DevicePool:
        return _memory.pool(_engine.current_device().index)

    def malloc(self, size: int) -> MemoryPointer:
        """Allocate ``size`` bytes on the current device and stream."""
        from .stream import current_queue

        return MemoryPointer(Memory(_memory.allocate(int(size), current_queue())), 0)

    def used_bytes(self) -> int:
        """Bytes held by live arrays."""
        return self._pool().used

    def total_bytes(self) -> int:
        """Bytes obtained from the device (in use plus cached free blocks)."""
        return self._pool().total

    def free_bytes(self) -> int:
        """Bytes cached in free blocks."""
        pool = self._pool()
        return pool.total - pool.used

    def n_free_blocks(self) -> int:
        """Number of cached free blocks."""
        return self._pool().n_free_blocks()

    def free_all_blocks(self, stream: Any = None) -> None:
        """Release cached free blocks, of one stream's arena or of all."""
        arena = None if stream is None else stream._queue().id
        with _engine.LOCK:
            self._pool().free_all(arena)

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        """Cap the pool's total bytes (0 or None: no cap)."""
        if size is not None and fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if fraction is not None:
            if not 0 <= fraction <= 1:
                raise ValueError(f"memory limit fraction out of range: {fraction}")
            size = int(_memory.memory_info(_engine.current_device_id())[1] * fraction)
        self._pool().limit = int(size or 0)

    def get_limit(self) -> int:
        """The cap set by ``set_limit`` (0: none)."""
        return self._pool().limit


_DEFAULT_POOL = MemoryPool()


def get_default_pool() -> MemoryPool:
    """Return the pool ``cupy.get_default_memory_pool()`` returns."""
    return _DEFAULT_POOL


_ALLOCATOR: Any = None  # None: the default pool's malloc (CuPy's default)


def set_allocator(allocator: Any = None) -> None:
    """Make ``allocator`` (size -> MemoryPointer, as ``alloc``) serve every new array."""
    global _ALLOCATOR
    if allocator is None:
        raise NotImplementedError("set_allocator(None) selects CuPy's raw cudaMalloc allocator "
                                  "(no pool); the stand-in models the memory pool only")
    if not callable(allocator):
        raise TypeError(f"set_allocator: the allocator must be callable; got {allocator!r}")
    _ALLOCATOR = allocator


def get_allocator() -> Any:
    """Return the current allocator."""
    return _ALLOCATOR if _ALLOCATOR is not None else _DEFAULT_POOL.malloc


def alloc(size: int) -> MemoryPointer:
    """Allocate ``size`` bytes through the current allocator."""
    pointer = get_allocator()(int(size))
    if not isinstance(pointer, MemoryPointer):
        raise TypeError(f"the allocator returned {type(pointer).__name__}, expected a "
                        "MemoryPointer")
    if pointer.mem.size - pointer._offset < int(size):
        raise ValueError(f"the allocator returned {pointer.mem.size - pointer._offset} bytes "
                         f"for a request of {size}")
    return pointer
