"""Jobs under Slurm: the MPI of this virtual environment started inside a Slurm allocation.

Needs a Slurm that answers (``scripts/ops/slurm_one_host.sh`` sets up one on this machine: one
node, 4 CPUs, as root); without one every test here skips, saying why. What is checked:

- ``salloc -n 4 mpirun python dist_example.py``: mpirun takes the job's size and hosts from the
  allocation (no -np, no hostfile), and the training is the same as under plain mpirun;
- ``srun --mpi=pmix`` (Open MPI) / ``srun --mpi=pmi2`` (MPICH): Slurm starts the ranks itself,
  and their MPI joins them into one job through Slurm's plugin.

On a node with fewer cores than the 4 CPUs its slurm.conf claims, the ranks share the cores:
mpi_env() lets Open MPI map more ranks than cores, and OMPI_MCA_mpi_yield_when_idle=1 keeps
its waiting ranks from spinning (Open MPI yields by itself only where it sees more ranks than
slots; under Slurm the slots are the 4 CPUs).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, SLURM_SETUP, flavour, launcher, mpi_env, run, slurm_missing

EXAMPLE = ["scripts/distributed/dist_example.py", "n_epoch=1"]
LIMIT = 240  # seconds for one job, allocation included


@pytest.fixture(scope="module")
def slurm():
    why = slurm_missing()
    if why is not None:
        pytest.skip(why)


def _env() -> dict[str, str]:
    env = mpi_env(OMPI_MCA_mpi_yield_when_idle="1",  # see the module's docstring
                  PMIX_MCA_psec="^munge")  # the wheel's PMIx has no munge: quiet its warning
    # this environment's python and mpirun, as an activated virtual environment gives them
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
               VIRTUAL_ENV=sys.prefix)
    return env


def _slurm_run(command: list[str]) -> tuple[int, str]:
    """Run a Slurm command line in a session of its own; return (exit code, output)."""
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        # SIGTERM first: salloc and srun then give the allocation and the step back
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, nothing else
            output, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} ran past {LIMIT} s; output:\n{output}")
    return proc.returncode, output


def _losses(output: str) -> list[str]:
    return re.findall(r"^epoch \d+/\d+  loss ([0-9.]+)", output, re.M)


@pytest.fixture(scope="module")
def plain_losses():
    """The epoch losses of the same job under plain mpirun: Slurm must not change them."""
    result = run(4, EXAMPLE, timeout=LIMIT, env=_env())
    assert result.returncode == 0, str(result)
    assert _losses(result.output), str(result)
    return _losses(result.output)


# -t: the allocation ends by itself if the test dies; -I: fail, not queue, when the node is busy
SALLOC = ["salloc", "-n", "4", "-t", "5", "-I60", "-J", "meta_dist_test"]


def test_mpirun_inside_salloc_takes_the_allocation(slurm, plain_losses):
    """No -np and no hostfile: mpirun (Open MPI's ras/plm slurm, Hydra's slurm RMK) sizes the
    job from the allocation; Hydra starts its proxy with srun."""
    command = [*SALLOC, *launcher()]
    if flavour() == "openmpi":
        command += ["--timeout", str(LIMIT)]
    code, output = _slurm_run([*command, sys.executable, *EXAMPLE])
    assert code == 0, output
    assert "4 rank(s) on 1 node(s)" in output, output
    assert _losses(output) == plain_losses, output


def test_srun_starts_the_ranks_through_the_mpi_plugin(slurm, plain_losses):
    """Open MPI 5 speaks only PMIx (srun --mpi=pmix); the MPICH wheel has no PMIx client but a
    PMI-2 one (srun --mpi=pmi2: with --mpi=pmix its ranks stop with "Runtime environment uses
    unsupported PMI version PMIx")."""
    plugin = "pmix" if flavour() == "openmpi" else "pmi2"
    listed = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True,
                            timeout=30)
    if plugin not in (listed.stdout + listed.stderr).split():
        pytest.skip(f"this Slurm has no mpi/{plugin} plugin (srun --mpi=list: "
                    f"{' '.join((listed.stdout + listed.stderr).split())})")
    code, output = _slurm_run(["srun", "-n", "4", "-t", "5", "-I60", "-J", "meta_dist_test",
                               f"--mpi={plugin}", sys.executable, *EXAMPLE])
    if plugin == "pmix" and "can not load PMIx library" in output:
        pytest.skip("Slurm's pmix plugin cannot load libpmix.so (Debian: apt-get install "
                    f"libpmix-dev, then restart slurmd; {SLURM_SETUP} does both)")
    assert code == 0, output
    assert "4 rank(s) on 1 node(s)" in output, output
    assert _losses(output) == plain_losses, output


def test_srun_with_pmix_and_the_mpich_wheel_stops_with_one_message(slurm):
    """The MPICH wheel has no PMIx client: under srun --mpi=pmix its MPI_Init aborted (exit 16,
    "unsupported PMI version PMIx"). meta_dist now says so before MPI starts, and what to use."""
    if flavour() != "mpich":
        pytest.skip("Open MPI speaks PMIx: srun --mpi=pmix is its way (the test above)")
    listed = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=30)
    if "pmix" not in (listed.stdout + listed.stderr).split():
        pytest.skip("this Slurm has no mpi/pmix plugin")
    code, output = _slurm_run(["srun", "-n", "2", "-t", "5", "-I60", "-J", "meta_dist_test",
                               "--mpi=pmix", sys.executable, *EXAMPLE])
    if "can not load PMIx library" in output:
        pytest.skip("Slurm's pmix plugin cannot load libpmix.so (Debian: apt-get install "
                    f"libpmix-dev, then restart slurmd; {SLURM_SETUP} does both)")
    assert code == 2, output
    assert "PMIx launcher" in output and "--mpi=pmi2" in output, output
    assert "Traceback" not in output and "unsupported PMI version" not in output, output


def test_srun_without_a_pmi_stops_with_one_message(slurm):
    """``srun -n 4`` with --mpi=none (the default where MpiDefault=none): four processes whose
    MPI each starts alone. The job stops saying which --mpi to use, instead of running four
    separate trainings that all exit 0."""
    code, output = _slurm_run(["srun", "-n", "4", "-t", "5", "-I60", "-J", "meta_dist_test",
                               "--mpi=none", sys.executable, *EXAMPLE])
    assert code == 2, output
    assert "srun started 4 tasks" in output and "--mpi=pmix" in output, output
    assert "Traceback" not in output and "epoch 1/1" not in output, output


def test_the_batch_recipe_trains_then_resumes(slurm, tmp_path):
    """scripts/distributed/dist_example.sbatch as the README shows it: sbatch --wait, 4 ranks
    through srun, a checkpoint; then the same script with resume_from=latest continues."""
    recipe = "scripts/distributed/dist_example.sbatch"
    out = tmp_path / "job-%j.out"
    runs = []
    for extra in (["n_epoch=1"], ["n_epoch=2", "resume_from=latest"]):
        code, said = _slurm_run(["sbatch", "--wait", "-t", "5", "-J", "meta_dist_test",
                                 f"--output={out}", recipe, f"checkpoint_dir={tmp_path}",
                                 *extra])
        logs = sorted(tmp_path.glob("job-*.out"), key=lambda p: p.stat().st_mtime)
        runs.append(logs[-1].read_text() if logs else "")
        assert code == 0, said + runs[-1]
    first, second = runs
    assert "4 rank(s) on 1 node(s)" in first and "epoch 1/1" in first, first
    assert re.search(r"resumed from \S+step-\d+ at epoch 1", second), second
    assert "epoch 2/2" in second, second
