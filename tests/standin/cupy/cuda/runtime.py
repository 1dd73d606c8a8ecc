"""cupy.cuda.runtime of the stand-in: the device queries and errors meta_dist and tests use.

Imports the stand-in's _engine, _memory and _errors. Mirrors cupy_backends/cuda/api/runtime.pyx:
``getDeviceCount`` (cudaErrorNoDevice when none is visible), ``getDevice``/``setDevice`` (per host
thread, cudaErrorInvalidDevice for a bad index), ``deviceSynchronize``, ``memGetInfo``, the
version queries ``driverGetVersion``/``runtimeGetVersion`` (CUDA's encoding 1000*major +
10*minor), ``getDeviceProperties`` (a dict; ``name`` is bytes, as CuPy returns it) and the
stream handle constants.
"""

from __future__ import annotations

from .. import _engine, _memory
from .._errors import CUDARuntimeError

__all__ = ["CUDARuntimeError", "deviceSynchronize", "driverGetVersion", "getDevice",
           "getDeviceCount", "getDeviceProperties", "memGetInfo", "runtimeGetVersion",
           "setDevice"]

is_hip = False
streamLegacy = 1
streamPerThread = 2
errorMemoryAllocation = 2
errorInvalidDevice = 101
errorNoDevice = 100
errorInvalidResourceHandle = 400
errorNotReady = 600
MODELED_CUDA = 12080  # the CUDA version the stand-in reports, driver and runtime alike


def getDeviceCount() -> int:  # noqa: N802 (CUDA's name)
    """Return the number of visible devices (cudaGetDeviceCount).

    Raises:
        CUDARuntimeError: cudaErrorNoDevice when none is visible.
    """
    if _engine.device_count() == 0:
        _engine.device(0)  # raises cudaErrorNoDevice with the stand-in's explanation
    return _engine.device_count()


def getDevice() -> int:  # noqa: N802
    """Return this host thread's current device."""
    _engine.current_device()
    return _engine.current_device_id()


def setDevice(device: int) -> None:  # noqa: N802
    """Make ``device`` current for this host thread."""
    _engine.set_current_device(int(device))


def deviceSynchronize() -> None:  # noqa: N802
    """Wait for all work on the current device (every stream)."""
    _engine.synchronize_device(_engine.current_device())


def memGetInfo() -> tuple[int, int]:  # noqa: N802
    """Return (free, total) bytes of the current device."""
    return _memory.memory_info(_engine.current_device_id())


def driverGetVersion() -> int:  # noqa: N802
    """Return the CUDA version the driver supports (cudaDriverGetVersion: 1000*major + 10*minor)."""
    return MODELED_CUDA


def runtimeGetVersion() -> int:  # noqa: N802
    """Return the CUDA runtime's version (cudaRuntimeGetVersion: 1000*major + 10*minor)."""
    return MODELED_CUDA


def getDeviceProperties(device: int) -> dict:  # noqa: N802
    """Return some of cudaDeviceProp for ``device`` as CuPy does: a dict, ``name`` in bytes.

    Raises:
        CUDARuntimeError: cudaErrorInvalidDevice for an index that is not visible.
    """
    state = _engine.device(int(device))
    return {"name": b"meta_dist stand-in (numpy, not a GPU)",
            "totalGlobalMem": _memory.memory_info(int(device))[1],
            "pciBusID": int(state.pci_bus_id.split(":")[1], 16),
            "major": 9, "minor": 0}
