"""Installing the stand-in: use_standin(), standin_env() for subprocesses, swapped_in().

Python's import system (https://docs.python.org/3/reference/import.html): the first match on
sys.path wins and sys.modules caches modules, so putting tests/standin first on sys.path (or
PYTHONPATH, for mpirun ranks) makes ``import cupy`` give the stand-in.
"""

import subprocess
import sys
import types

import pytest
from standin_install import STANDIN_DIR, is_standin, standin_env, swapped_in, use_standin

pytestmark = pytest.mark.gpu_standin


def run_python(code, env):
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_subprocess_environment_gives_the_standin():
    """A subprocess with standin_env() (as mpirun ranks get it) imports the stand-in: cupy,
    cupyx and cupy.cuda.nccl, with cupy.__standin__ set."""
    code = ("import cupy, cupyx; from cupy.cuda import nccl; "
            "print(cupy.__standin__, cupyx.__standin__, nccl.available, "
            f"cupy.__file__.startswith({str(STANDIN_DIR)!r}))")
    assert run_python(code, standin_env()) == "True True True True"


def test_use_standin_in_a_fresh_process():
    """use_standin(): forced ("1") it always installs the stand-in; "0" never does; unset, it
    does exactly when the real cupy cannot run."""
    path = STANDIN_DIR / "install.py"
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('inst', {str(path)!r}); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "used = m.use_standin(); "
            "print(used, m.is_standin(sys.modules.get('cupy')))")
    env = {k: v for k, v in standin_env().items() if k not in ("PYTHONPATH", "META_DIST_STANDIN")}
    assert run_python(code, dict(env, META_DIST_STANDIN="1")) == "True True"
    assert run_python(code, dict(env, META_DIST_STANDIN="0")) == "False False"
    used, loaded = run_python(code, env).split()
    assert used == loaded


def test_forcing_after_the_real_cupy_was_imported_fails(monkeypatch):
    """use_standin(force=True) cannot replace a cupy that is already imported."""
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    with pytest.raises(RuntimeError, match="already imported"):
        use_standin(force=True)
    assert use_standin() is False


def test_swapped_in_restores_the_previous_cupy(monkeypatch):
    """swapped_in() makes the stand-in sys.modules['cupy'] inside the block only."""
    sentinel = types.ModuleType("cupy")
    monkeypatch.setitem(sys.modules, "cupy", sentinel)
    with swapped_in() as cupy:
        assert is_standin(cupy) and sys.modules["cupy"] is cupy
        assert str(STANDIN_DIR) in sys.path
    assert sys.modules["cupy"] is sentinel and str(STANDIN_DIR) not in sys.path
