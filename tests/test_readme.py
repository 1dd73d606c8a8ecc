"""README.md is true: every shell command in it runs, as it is written, and succeeds.

Each line of each ```bash block is a case. On this one machine two things differ from where the
README's reader stands, and the test says so instead of rewriting the commands:
- the environment carries what a small machine run as root needs (tests/mpirun.py ``mpi_env``:
  Open MPI's root permission and ``PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe``,
  since 4 or 8 ranks exceed 2 cores), as the README's Launching section tells its reader;
- the cluster examples run against localhost: the commands run in a copy of the repository's
  layout whose hostfiles/*-cluster.txt give node1's and node2's slots to one localhost line
  (an MPI refuses one host named twice), and ``-H node1:4,node2:4`` becomes ``-H localhost:8``.
Open MPI's own flags (--hostfile, -H, --oversubscribe, --bind-to, --allow-run-as-root) run
under Open MPI, MPICH's (``mpiexec -f``) under MPICH. The first two commands (set up and run,
then the test suite) are CI's to run: .ci/run runs them word for word in a fresh clone. The
benchmarks (``python -m meta_dist bench ...``) run with ``-m readme_bench``, which .ci/run also
runs; those that compare with PyTorch skip without it. The API tour's first block runs on 1
and 2 ranks.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import ROOT, flavour, mpi_env, run, slurm_missing

README = ROOT / "README.md"
OPENMPI_ONLY = ("--hostfile", "-H", "--oversubscribe", "--bind-to", "--allow-run-as-root")
CI_RUNS = 2  # the first two commands: set-up-and-train, and the test command


def blocks(language):
    return re.findall(rf"^```{language}\n(.*?)^```", README.read_text(), re.M | re.S)


def commands():
    lines = [line.split("  #")[0].strip() for block in blocks("bash")
             for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def cases():
    for number, command in enumerate(commands()[CI_RUNS:], start=CI_RUNS + 1):
        marks = [pytest.mark.readme_bench] if "meta_dist bench" in command else []
        yield pytest.param(command, id=f"{number}: {command[:60]}", marks=marks)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    """The repository's layout with the cluster hostfiles pointing at localhost."""
    where = tmp_path_factory.mktemp("readme")
    for name in ("scripts", "configs", "meta_dist"):
        (where / name).symlink_to(ROOT / name)
    (where / "hostfiles").mkdir()
    for hostfile in (ROOT / "hostfiles").iterdir():
        (where / "hostfiles" / hostfile.name).write_text(on_localhost(hostfile.read_text()))
    return where


def on_localhost(hostfile: str) -> str:
    """Return a cluster hostfile's nodes as one line for localhost with all their slots (an MPI
    refuses one host named twice), in the hostfile's own syntax; other lines unchanged."""
    slots = [int(n) for n in re.findall(r"^node\d+(?: slots=|:)(\d+)$", hostfile, re.M)]
    if not slots:
        return hostfile
    kept = [line for line in hostfile.splitlines() if not re.match(r"node\d+\b", line)]
    sep = " slots=" if " slots=" in hostfile else ":"
    return "\n".join([*kept, f"localhost{sep}{sum(slots)}"]) + "\n"


def environment(**extra):
    env = mpi_env(**extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3, mpirun
    return env


def test_the_first_two_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for command in commands()[:CI_RUNS]:
        assert shlex.quote(command) in ci or command in ci, (command, "not in .ci/run")


@pytest.mark.parametrize("command", list(cases()))
def test_readme_command_runs(command, layout):
    words = command.split()
    if words[0] == "mpiexec" and "-f" in words and flavour() != "mpich":
        pytest.skip("an MPICH command (mpiexec -f); this run's MPI is Open MPI")
    if words[0] in ("mpirun", "mpiexec") and flavour() != "openmpi" and any(
            flag in words for flag in OPENMPI_ONLY):
        pytest.skip("Open MPI's flags; this run's MPI is MPICH")
    if words[0] in ("salloc", "srun", "sbatch"):
        if slurm_missing():
            pytest.skip(slurm_missing())
        if "--mpi=pmix" in words and flavour() != "openmpi":
            pytest.skip("srun --mpi=pmix is Open MPI's; this run's MPI is MPICH")
        if "--mpi=pmi2" in words and flavour() != "mpich":
            pytest.skip("srun --mpi=pmi2 is MPICH's; this run's MPI is Open MPI")
    if "--torch" in words:
        pytest.importorskip("torch", reason="needs torch: pip install -e '.[bench]'")
    if "--plot" in words:
        pytest.importorskip("matplotlib", reason="needs matplotlib: pip install -e '.[bench]'")
    if "meta_dist.checkpoint" in command and not (layout / "checkpoints").exists():
        made = run(2, ["scripts/distributed/dist_example.py", "n_epoch=1",
                       f"checkpoint_dir={layout / 'checkpoints'}"], timeout=300)
        assert made.returncode == 0, str(made)
    if "trace merge traces" in command and not (layout / "traces").exists():
        made = run(2, ["scripts/distributed/dist_example.py", "n_epoch=1", "n_mini_batch=2",
                       f"trace={layout / 'traces'}"], timeout=300)
        assert made.returncode == 0, str(made)
    # a one-host Slurm claims 4 CPUs on 2 cores, and Open MPI busy-waits when slots >= ranks
    slurm = {"OMPI_MCA_mpi_yield_when_idle": "1"} if words[0] in ("salloc", "srun") else {}
    done = subprocess.run(command.replace("-H node1:4,node2:4", "-H localhost:8"),
                          shell=True, cwd=layout, env=environment(**slurm), capture_output=True,
                          text=True, timeout=600, check=False)
    output = (done.stdout + done.stderr).replace("\0", "")
    assert done.returncode == 0, f"{command}\nexit code {done.returncode}\n{output}"
    assert "Traceback" not in output, output


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_api_tour_runs_on_one_and_two_ranks(tmp_path, ranks):
    """One rank too: its point-to-point lines sent to peer 1, which one rank does not have."""
    tour = tmp_path / "tour.py"
    tour.write_text(blocks("python")[0])
    result = run(ranks, [str(tour)], timeout=120)
    assert result.returncode == 0, str(result)


def test_every_document_the_readme_links_is_in_the_repository():
    text = README.read_text()
    linked = re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"\b([\w./-]+\.md)\b", text)
    missing = [name for name in linked if "://" not in name and not (ROOT / name).exists()]
    assert not missing, missing
