"""cupy.cuda of the stand-in: devices, streams, events, memory, runtime (and nccl on import).

Imports the stand-in's cuda submodules. As in CuPy, ``cupy.cuda.nccl`` is not imported by
``import cupy``: use ``from cupy.cuda import nccl``.
"""

from __future__ import annotations

from .. import _engine
from . import device, memory, runtime, stream
from .device import Device, get_device_id
from .memory import (
    Memory,
    MemoryPointer,
    MemoryPool,
    OutOfMemoryError,
    alloc,
    get_allocator,
    set_allocator,
)
from .runtime import CUDARuntimeError
from .stream import Event, Stream, get_current_stream, get_elapsed_time

__all__ = ["CUDARuntimeError", "Device", "Event", "Memory", "MemoryPointer", "MemoryPool",
           "OutOfMemoryError", "Stream", "alloc", "device", "get_allocator", "get_current_stream",
           "get_device_id", "get_elapsed_time", "is_available", "memory", "runtime",
           "set_allocator", "stream"]


def is_available() -> bool:
    """Return True if a (modeled) CUDA device is visible."""
    return _engine.device_count() > 0
