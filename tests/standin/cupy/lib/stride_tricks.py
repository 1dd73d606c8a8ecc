"""cupy.lib.stride_tricks of the stand-in: ``as_strided`` (bounds-checked) and ``broadcast_to``."""

from .._routines import as_strided, broadcast_to

__all__ = ["as_strided", "broadcast_to"]
