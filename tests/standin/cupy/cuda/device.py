"""cupy.cuda.device of the stand-in: Device, get_device_id.

Imports the stand-in's _engine and _memory. Mirrors cupy/cuda/device.pyx
(https://docs.cupy.dev/en/stable/reference/generated/cupy.cuda.Device.html): ``Device(i)`` does
not check ``i`` until used; ``use()`` makes it current for the calling host thread; ``with
Device(i)`` restores the previous device on exit; ``synchronize()`` waits for every stream of
the device; ``pci_bus_id`` is distinct per physical device of the host.
"""

from __future__ import annotations

import threading

from .. import _engine, _memory

_TLS = threading.local()


def get_device_id() -> int:
    """Return the current device of this host thread."""
    return _engine.current_device_id()


class Device:
    """A CUDA device; ``id`` is its index (default: the current device)."""

    def __init__(self, device: int | Device | None = None) -> None:
        self.id = _engine.current_device_id() if device is None else int(device)

    def __int__(self) -> int:
        return self.id

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and self.id == other.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __enter__(self) -> Device:
        stack = getattr(_TLS, "stack", None)
        if stack is None:
            stack = _TLS.stack = []
        stack.append(_engine.current_device_id())
        if self.id != stack[-1]:
            _engine.set_current_device(self.id)
        return self

    def __exit__(self, *args: object) -> None:
        _engine.set_current_device(_TLS.stack.pop())

    def use(self) -> Device:
        """Make this device current for the calling host thread."""
        _engine.set_current_device(self.id)
        return self

    def synchronize(self) -> None:
        """Block the host until every stream of this device has finished its work."""
        _engine.synchronize_device(_engine.device(self.id))

    @property
    def pci_bus_id(self) -> str:
        """The PCI bus id, "[domain]:[bus]:[device].[function]" in hexadecimal."""
        return _engine.device(self.id).pci_bus_id

    @property
    def compute_capability(self) -> str:
        """The compute capability string (modeled as an H100's, "90")."""
        _engine.device(self.id)
        return "90"

    @property
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of this device."""
        return _memory.memory_info(self.id)
