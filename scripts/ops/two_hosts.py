"""Make two "hosts" on this machine (network + UTS namespaces joined by a veth pair); remove them.

    python scripts/ops/two_hosts.py up node1 node2      # as root; prints how to launch across
    python scripts/ops/two_hosts.py down node1 node2

Each host NAME is three things, all made with iproute2 and util-linux:

1. A network namespace, /run/netns/NAME (``ip netns add NAME``), with its loopback up and one
   end of a veth pair named eth0, at 10.77.0.1/24 on the first host and 10.77.0.2/24 on the
   second (``ip link add eth0 netns A type veth peer name eth0 netns B``): a cable between
   two machines. Deleting a namespace deletes its end, and so the pair.
2. A UTS namespace bound to the file /run/utsns/NAME, whose host name is NAME
   (``unshare --uts=/run/utsns/NAME hostname NAME``): what MPI_Get_processor_name, Open MPI's
   daemons and Hydra's proxies report. The bind mount keeps it alive with no process in it.
3. /etc/netns/NAME/hosts naming both hosts, which ``ip netns exec NAME`` mounts over
   /etc/hosts: each host resolves the other's name (the launchers' daemons connect back to
   mpirun by name or address).

``ip netns exec NAME nsenter --uts=/run/utsns/NAME COMMAND`` runs COMMAND on host NAME;
scripts/ops/netns_agent.sh does that for the MPI launchers, in place of ssh. Everything else
(the file system, /dev/shm, the cores, the boot id) stays shared. Open MPI's ob1 sends between
the hosts over TCP on eth0, as between real machines; UCX (MPICH's network module here) sees
the same boot id, takes the other host for this one and uses shared memory and CMA between
them unless told ``UCX_TLS=tcp,self``.

Standard library only; tests/test_two_hosts.py imports it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SUBNET = "10.77.0"  # host i (from 1) is SUBNET.i/24 on its eth0; namespaces keep runs apart
UTS_DIR = Path("/run/utsns")  # where the UTS namespaces are bound, as /run/netns for ip netns
AGENT = Path(__file__).resolve().parent / "netns_agent.sh"


class SetupError(RuntimeError):
    """A command that makes the hosts failed (its command line and error output)."""


def unavailable() -> str | None:
    """Return why two hosts cannot be made here, or None where they can be tried."""
    if os.geteuid() != 0:
        return "making network and UTS namespaces needs root"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    return None


def address(names: list[str], name: str) -> str:
    """Return host ``name``'s address on the veth."""
    return f"{SUBNET}.{names.index(name) + 1}"


def inside(name: str) -> list[str]:
    """Return the command prefix that runs a program on host ``name``, environment kept."""
    return ["ip", "netns", "exec", name, "nsenter", f"--uts={UTS_DIR / name}"]


def up(names: list[str]) -> None:
    """Make the two hosts ``names`` (see the module docstring); raise SetupError on failure.

    A failure leaves what was made so far: call ``down(names)`` to remove it.
    """
    first, second = names
    hosts = "127.0.0.1 localhost\n" + "".join(f"{address(names, n)} {n}\n" for n in names)
    UTS_DIR.mkdir(parents=True, exist_ok=True)
    for name in names:
        _run("ip", "netns", "add", name)
        _run("ip", "-n", name, "link", "set", "lo", "up")
        (UTS_DIR / name).touch()
        _run("unshare", f"--uts={UTS_DIR / name}", "hostname", name)
        Path(f"/etc/netns/{name}").mkdir(parents=True, exist_ok=True)
        Path(f"/etc/netns/{name}/hosts").write_text(hosts)
    _run("ip", "link", "add", "eth0", "netns", first, "type", "veth",
         "peer", "name", "eth0", "netns", second)
    for name in names:
        _run("ip", "-n", name, "addr", "add", f"{address(names, name)}/24", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
    for name in names:
        _wait_until_up(name)


def _wait_until_up(name: str, timeout: float = 10) -> None:
    """Wait until eth0 on host ``name`` is up: UCX leaves out an interface that is not
    running, and MPICH then finds no transport between the hosts ("Destination is
    unreachable"; seen in jobs started right after the hosts were made)."""
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(["ip", "-n", name, "-o", "link", "show", "eth0"],
                              capture_output=True, text=True, timeout=30, check=False)
        if "state UP" in done.stdout:
            return
        if time.monotonic() > deadline:
            raise SetupError(f"eth0 on {name} not up after {timeout:g} s: {done.stdout.strip()}")
        time.sleep(0.05)


def down(names: list[str]) -> list[str]:
    """Remove the hosts ``names``, whatever part of them exists; return what could not go."""
    left = []
    for name in names:
        if Path(f"/run/netns/{name}").exists():
            _end_processes_in(name)  # a job cut off: its daemons would keep the namespace
            left += _try("ip", "netns", "delete", name)  # and its veth end: the pair goes
        uts = UTS_DIR / name
        if uts.exists():
            if os.path.ismount(uts):
                left += _try("umount", str(uts))
            uts.unlink(missing_ok=True)
        shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
    return left


def _end_processes_in(name: str) -> None:
    """Kill what still runs in host ``name``'s network namespace (only ours: we made it)."""
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                          timeout=30, check=False)
    for pid in done.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass  # ended meanwhile


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise SetupError(f"{' '.join(command)}: exit {done.returncode}: "
                         f"{(done.stderr or done.stdout).strip()}")


def _try(*command: str) -> list[str]:
    try:
        _run(*command)
    except SetupError as error:
        return [str(error)]
    return []


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("up", "down"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    action, names = argv[0], argv[1:]
    if action == "down":
        left = down(names)
        print("\n".join(left) or f"removed {' and '.join(names)}")
        return 1 if left else 0
    reason = unavailable()
    if reason:
        print(f"two_hosts.py: cannot make hosts here: {reason}", file=sys.stderr)
        return 1
    try:
        up(names)
    except SetupError as error:
        down(names)
        print(f"two_hosts.py: {error}", file=sys.stderr)
        return 1
    first, second = names
    print(f"made {first} ({address(names, first)}) and {second} ({address(names, second)}) "
          f"on eth0; run on {first}: {' '.join(inside(first))} COMMAND\n"
          f"Open MPI: mpirun --prtemca plm_ssh_agent {AGENT} -H {first}:2,{second}:2 "
          f"--map-by ppr:2:node --bind-to none --mca mpi_yield_when_idle 1 -np 4 ...\n"
          f"MPICH:    mpiexec -launcher ssh -launcher-exec {AGENT} -hosts {first}:2,{second}:2 "
          f"-genv UCX_TLS tcp,self -np 4 ...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
