"""Put the CuPy stand-in in place of the real cupy when the real one cannot run.

Imports only the standard library (and tries the real cupy). In a test process call
``use_standin()`` before anything imports cupy; for a subprocess (mpirun ranks included) pass
``standin_env()`` as its environment, which puts this folder first on PYTHONPATH. Tell which
cupy is loaded with ``is_standin(cupy)`` (the stand-in sets ``cupy.__standin__ = True``).

``META_DIST_STANDIN=1`` forces the stand-in even where the real cupy runs; ``=0`` never uses it.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

STANDIN_DIR = Path(__file__).resolve().parent
ENV_INSTALL = "META_DIST_STANDIN"
_PACKAGES = ("cupy", "cupyx", "cupy_backends")


def is_standin(module: ModuleType | None) -> bool:
    """Return True if ``module`` is the stand-in cupy (or cupyx)."""
    return bool(getattr(module, "__standin__", False))


def _forget_cupy() -> dict[str, ModuleType]:
    """Remove every cupy module from sys.modules; return what was removed."""
    removed = {}
    for name in list(sys.modules):
        if name.split(".")[0] in _PACKAGES:
            removed[name] = sys.modules.pop(name)
    return removed


def real_cupy_runs() -> bool:
    """Return True if the real cupy imports and sees a GPU (leaves it imported if so)."""
    if str(STANDIN_DIR) in sys.path:
        return False
    try:
        import cupy

        if is_standin(cupy):
            return False
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, a CUDA library that fails to load, no driver, no GPU
        _forget_cupy()
        return False


def use_standin(force: bool | None = None) -> bool:
    """Make ``import cupy`` give the stand-in if the real cupy cannot run; return True if so.

    Args:
        force: True always uses the stand-in, False never; None reads META_DIST_STANDIN
            ("1" / "0"), and when unset decides by trying the real cupy.

    Raises:
        RuntimeError: the stand-in is forced but the real cupy is already imported.
    """
    if force is None and os.environ.get(ENV_INSTALL) in ("0", "1"):
        force = os.environ[ENV_INSTALL] == "1"
    loaded = sys.modules.get("cupy")
    if loaded is not None:
        if force and not is_standin(loaded):
            raise RuntimeError("use_standin: the real cupy is already imported in this "
                               "process; call use_standin() before anything imports cupy")
        return is_standin(loaded)
    if force is False or (force is None and real_cupy_runs()):
        return False
    if str(STANDIN_DIR) not in sys.path:
        sys.path.insert(0, str(STANDIN_DIR))
    importlib.invalidate_caches()
    import cupy

    if not is_standin(cupy):
        raise RuntimeError(f"use_standin: 'import cupy' gave {cupy.__file__}, not the stand-in")
    return True


def standin_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Return ``env`` (default: os.environ) with the stand-in first on PYTHONPATH and forced."""
    result = dict(os.environ if env is None else env)
    paths = [p for p in result.get("PYTHONPATH", "").split(os.pathsep) if p]
    result["PYTHONPATH"] = os.pathsep.join([str(STANDIN_DIR), *paths])
    result[ENV_INSTALL] = "1"
    return result


class swapped_in:  # noqa: N801 (used as a context manager, like contextlib's helpers)
    """Make the stand-in *the* cupy inside a ``with`` block, restoring sys.modules after.

    For in-process tests of the stand-in itself: it works even where the real cupy was
    imported already, and leaves other tests' view of cupy as it was.
    """

    def __enter__(self) -> ModuleType:
        loaded = sys.modules.get("cupy")
        if is_standin(loaded):  # already the stand-in (e.g. PYTHONPATH under mpirun)
            self._saved = None
            return loaded
        self._saved = _forget_cupy()
        self._path_added = str(STANDIN_DIR) not in sys.path
        if self._path_added:
            sys.path.insert(0, str(STANDIN_DIR))
        importlib.invalidate_caches()
        import cupy

        if not is_standin(cupy):
            raise RuntimeError(f"swapped_in: 'import cupy' gave {cupy.__file__}")
        return cupy

    def __exit__(self, *args: object) -> None:
        if self._saved is None:
            return
        standin = _forget_cupy()
        if self._path_added and str(STANDIN_DIR) in sys.path:
            sys.path.remove(str(STANDIN_DIR))
        sys.modules.update(self._saved)
        self._standin = standin  # keep the stand-in's modules (and stream threads) referenced
