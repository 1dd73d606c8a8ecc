"""cupy.lib of the stand-in: ``stride_tricks``."""

from . import stride_tricks

__all__ = ["stride_tricks"]
