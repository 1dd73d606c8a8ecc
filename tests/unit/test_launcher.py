"""launcher.launcher_mismatch: which launcher and MPI pairs are refused before MPI starts."""

import importlib.metadata

import pytest
from mpirun import only_the_mpich_wheel

from meta_dist.launcher import launcher_mismatch

LAUNCH_VARS = ("PMIX_RANK", "PMI_RANK", "MPI4PY_LIBMPI", "MPI4PY_MPIABI")


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


def test_the_refusal_names_the_mpich_wheels_own_mpirun(launched, monkeypatch, tmp_path):
    """A ``pip install --user mpich`` puts mpirun in ~/.local/bin, not beside sys.executable
    (where the system's Open MPI mpirun, the one that failed, may be): the line named
    sys.executable's folder. It names the mpirun the mpich distribution installed."""
    site = tmp_path / "user" / "lib" / "python3" / "site-packages"
    info = site / "mpich-5.0.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mpich\nVersion: 5.0.2\n")
    (info / "RECORD").write_text("../../../bin/mpirun,,\n../../../bin/mpiexec,,\n")

    def distribution(name):
        if name == "mpich":
            return importlib.metadata.PathDistribution(info)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [distribution("mpich")])
    launched(PMIX_RANK="0")
    problem = launcher_mismatch()
    assert problem is not None and "PMIx launcher" in problem, problem
    assert f"mpich package's mpirun ({tmp_path / 'user' / 'bin' / 'mpirun'})" in problem, problem
    assert "--mpi=pmi2" in problem, problem
