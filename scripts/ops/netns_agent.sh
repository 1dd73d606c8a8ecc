#!/bin/sh
# A remote-shell agent that stands in for ssh when the "hosts" are network + UTS namespaces of
# this machine (made by scripts/ops/two_hosts.py). MPI launchers call it as they would call ssh:
#
#   netns_agent.sh [ssh options] HOST COMMAND...
#
# and it runs COMMAND with `sh -c` inside HOST's namespaces: the network namespace
# /run/netns/HOST (`ip netns exec`, which also puts /etc/netns/HOST/hosts over /etc/hosts) and
# the UTS namespace bound at /run/utsns/HOST (`nsenter --uts`, for the host name).
#
# Name it by its absolute path (AGENT below), and start the launcher inside the first host
# (ip netns exec HOST nsenter --uts=/run/utsns/HOST ...):
#   Open MPI:  mpirun --prtemca plm_ssh_agent AGENT --hostfile FILE ...
#   MPICH:     mpiexec -launcher ssh -launcher-exec AGENT -f FILE ...
#
# Like ssh, it does not pass the caller's environment on: COMMAND starts with a login's few
# variables, plus PATH and PYTHONPATH as the caller has them (what a login shell on a real host
# would set up to find the same virtual environment and project). What else the ranks need,
# the launcher must forward, as it would across real hosts.
set -eu

# ssh options: those that take a value skip it too (ssh -o X, -p N, -l USER, ...)
while [ $# -gt 0 ]; do
    case "$1" in
        -[BbcDEeFIiJLlmOopQRSWw]) shift 2 ;;
        -?*) shift ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "netns_agent.sh: usage: netns_agent.sh [ssh options] HOST COMMAND..." >&2
    exit 255  # what ssh returns when it cannot run the command
fi
host=$1
shift
if [ ! -e "/run/netns/$host" ] || [ ! -e "/run/utsns/$host" ]; then
    echo "netns_agent.sh: no host '$host' (no /run/netns/$host or /run/utsns/$host);" \
         "make it with scripts/ops/two_hosts.py up" >&2
    exit 255
fi
# ssh starts in the home directory (the launchers set each rank's own) and joins the words of
# COMMAND with spaces for the remote shell, as "$*" does
cd "${HOME:-/}"
exec ip netns exec "$host" nsenter --uts="/run/utsns/$host" \
    env -i HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \
    PATH="$PATH" PYTHONPATH="${PYTHONPATH:-}" \
    sh -c "$*"
