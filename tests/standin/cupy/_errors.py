"""Exceptions of the stand-in: CUDA runtime errors and the race detector's error.

Leaf module of the stand-in. ``CUDARuntimeError`` mirrors CuPy's
(cupy_backends/cuda/api/runtime.pyx): it has ``.status`` and reads "<cudaErrorName>: <text>".
"""

from __future__ import annotations

# cudaError_t values and their cudaGetErrorName / cudaGetErrorString texts (CUDA runtime API,
# "Data types: cudaError")
CUDA_ERRORS: dict[int, tuple[str, str]] = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    2: ("cudaErrorMemoryAllocation", "out of memory"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    710: ("cudaErrorAssert", "device-side assert triggered"),
    800: ("cudaErrorNotPermitted", "operation not permitted"),
}

NO_DEVICE = 100
INVALID_DEVICE = 101
INVALID_HANDLE = 400
NOT_READY = 600
ILLEGAL_ADDRESS = 700
ASSERT = 710
NOT_PERMITTED = 800


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime call failed; ``status`` is the cudaError_t value."""

    def __init__(self, status: int) -> None:
        self.status = status
        name, text = CUDA_ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self) -> tuple:
        return type(self), (self.status,)


def cuda_error(status: int, detail: str) -> CUDARuntimeError:
    """Return CUDARuntimeError(status) with the stand-in's explanation attached as a note."""
    error = CUDARuntimeError(status)
    add_note(error, detail)
    return error


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to an exception (shown in tracebacks; Python >= 3.11 only)."""
    if hasattr(error, "add_note"):
        error.add_note(f"cupy stand-in: {note}")


class StandinRaceError(RuntimeError):
    """Two streams touch the same device memory with nothing ordering them (stand-in only).

    Real CUDA gives no error here: the program reads stale data or corrupts memory, sometimes.
    """
