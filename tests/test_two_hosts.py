"""Two hosts on one machine: jobs launched across Linux namespaces joined by a veth pair.

scripts/ops/two_hosts.py makes two hosts (network + UTS namespaces with host names of their
own, a veth pair between them, /etc/hosts naming both); mpirun runs inside the first and starts
its daemon on the second (Open MPI's prted, Hydra's proxy) through scripts/ops/netns_agent.sh
where it would use ssh. The MPI is whichever tests/mpirun.py finds. What a single-host run
cannot show: the launcher's remote start, host names, local ranks per host, and messages between
the hosts over TCP on the veth. Skips, with the reason, where namespaces cannot be made.
"""

import os
import re
import subprocess
import sys

import pytest
from mpirun import ROOT, Result, finish, flavour, launcher, mpi_env, run

sys.path.insert(0, str(ROOT / "scripts" / "ops"))
import two_hosts  # noqa: E402  (scripts/ops is no package: the recipe a user reads)

RANKS_PER_HOST = 2
TIMEOUT = 120


@pytest.fixture(scope="module")
def hosts():
    """Make two hosts named for this process (parallel runs cannot clash); remove them after,
    whatever the tests did."""
    reason = two_hosts.unavailable()
    if reason:
        pytest.skip(f"cannot make two hosts here: {reason}")
    assert os.access(two_hosts.AGENT, os.X_OK), (
        f"{two_hosts.AGENT} must be executable (git update-index --chmod=+x)")
    names = [f"node1-{os.getpid()}", f"node2-{os.getpid()}"]
    try:
        two_hosts.up(names)
    except two_hosts.SetupError as error:
        two_hosts.down(names)
        pytest.skip(f"cannot make two hosts here: {error}")
    try:
        yield names
    finally:
        left = two_hosts.down(names)
        assert not left, "could not remove the hosts: " + "; ".join(left)


def across(hosts: list[str], args: list[str], tmp_path) -> Result:
    """Run ``python args...`` on 2 ranks per host, mpirun inside the first host; a job past
    TIMEOUT is killed and reported (as tests/mpirun.py's ``run``)."""
    limit = str(TIMEOUT + 30)  # the launcher's own limit: the job ends if the test dies
    hostfile = tmp_path / "hostfile.txt"
    if flavour() == "openmpi":
        hostfile.write_text("".join(f"{h} slots={RANKS_PER_HOST}\n" for h in hosts))
        options = ["--hostfile", str(hostfile), "--timeout", limit,
                   "--prtemca", "plm_ssh_agent", str(two_hosts.AGENT),
                   # 2 ranks a host (mpi_env's ":oversubscribe" mapping put all 4 on the
                   # first), unbound as on one oversubscribed host
                   "--map-by", f"ppr:{RANKS_PER_HOST}:node", "--bind-to", "none",
                   # 4 ranks share 2 cores, which Open MPI cannot see across hosts: yield
                   # while waiting, as it does by itself on one oversubscribed host (spinning
                   # ranks starve the ones with work: a step took 254 ms instead of 10.5)
                   "--mca", "mpi_yield_when_idle", "1"]
    else:
        hostfile.write_text("".join(f"{h}:{RANKS_PER_HOST}\n" for h in hosts))
        options = ["-f", str(hostfile), "-launcher", "ssh",
                   "-launcher-exec", str(two_hosts.AGENT),
                   # UCX sees one machine (one boot id) and would pass messages between the
                   # hosts by shared memory; a real second host has only the network
                   "-genv", "UCX_TLS", "tcp,self"]
    command = [*two_hosts.inside(hosts[0]), *launcher(), "-n", str(2 * RANKS_PER_HOST),
               *options, sys.executable, *args]
    proc = subprocess.Popen(command, cwd=ROOT, env=mpi_env(MPIEXEC_TIMEOUT=limit),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return finish(proc, TIMEOUT)


def printed_numbers(output: str) -> list[str]:
    """Return every loss and accuracy rank 0 printed, as printed."""
    return re.findall(r"(?:loss|accuracy) \d+\.\d+", output)


def test_dist_example_at_zero2_trains_on_two_hosts_as_on_one(hosts, tmp_path):
    """The same world size and data on 2 hosts x 2 ranks as on 4 ranks of one host: the same
    losses and accuracies to every printed digit, though the messages now cross TCP."""
    args = ["scripts/distributed/dist_example.py", "zero_opt_level=2"]
    two = across(hosts, args, tmp_path)
    assert two.returncode == 0 and not two.timed_out, str(two)
    assert "4 rank(s) on 2 node(s)" in two.output, str(two)
    one = run(4, args, timeout=TIMEOUT)
    assert one.returncode == 0 and "4 rank(s) on 1 node(s)" in one.output, str(one)
    assert len(printed_numbers(one.output)) == 22, str(one)  # 10 epochs x 2 losses, 2 accuracies
    assert printed_numbers(two.output) == printed_numbers(one.output), (
        f"two hosts:\n{two.output}\none host:\n{one.output}")


def test_the_doctor_sees_two_hosts_and_passes(hosts, tmp_path):
    """Each host's ranks are local ranks 0 and 1 of 2 under its own name, every check passes
    (exit 0), and the bandwidth probe goes to the other host."""
    result = across(hosts, ["-m", "meta_dist", "doctor"], tmp_path)
    assert result.returncode == 0 and not result.timed_out, str(result)
    assert "meta_dist doctor: 4 rank(s) on 2 host(s)" in result.output, str(result)
    for rank in range(4):
        host, local = hosts[rank // RANKS_PER_HOST], rank % RANKS_PER_HOST
        assert re.search(rf"^  rank {rank} \(local {local} of {RANKS_PER_HOST}\) on {host}: ",
                         result.output, re.M), str(result)
    assert "FAIL" not in result.output and "doctor: every check passed" in result.output
    assert re.search(rf"INFO  bandwidth: rank 0 <-> rank 2 \(another host, {hosts[1]}\): "
                     r"[\d.]+ GB/s", result.output), str(result)
