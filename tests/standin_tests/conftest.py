"""Tests of the CuPy/NCCL stand-in (tests/standin): marker, isolation, knobs.

Every test here carries the ``gpu_standin`` marker (registered in pyproject.toml), so
``python -m pytest -m gpu_standin`` runs them all without a GPU. Single-process tests get the
stand-in as ``cupy`` for the duration of their module only
(other tests keep whatever cupy they had).
tests/standin_tests/mpi holds the multi-rank tests; it is collected only under mpirun with
META_DIST_STANDIN_MPI_SUITE=1 (test_standin_suite.py launches it).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest


def _load_install():
    """Import tests/standin/install.py without putting tests/standin on sys.path."""
    path = Path(__file__).resolve().parent.parent / "standin" / "install.py"
    spec = importlib.util.spec_from_file_location("standin_install", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["standin_install"] = module
    spec.loader.exec_module(module)
    return module


install = sys.modules.get("standin_install") or _load_install()
swapped_in = install.swapped_in

if os.environ.get("META_DIST_STANDIN_MPI_SUITE") != "1":
    collect_ignore = ["mpi"]
else:
    collect_ignore = []


@pytest.fixture(scope="module")
def cupy():
    """The stand-in cupy module, as ``sys.modules['cupy']`` for this test module."""
    with swapped_in() as module:
        yield module


@pytest.fixture
def knobs(monkeypatch, cupy):
    """Set stand-in knobs (environment variables) for one test: ``knobs(NAME=value, ...)``."""
    from cupy import _knobs

    def set_knobs(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, str(value))
        _knobs.reset()

    yield set_knobs
    monkeypatch.undo()
    _knobs.reset()


@pytest.fixture
def fresh_device(cupy):
    """Clear a sticky device fault a test provoked on purpose (CUDA itself cannot)."""
    yield
    from cupy import _engine

    for index in range(_engine.device_count()):
        _engine.clear_fault(_engine.device(index))
