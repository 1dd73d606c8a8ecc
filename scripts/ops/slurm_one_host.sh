#!/usr/bin/env bash
# A one-host Slurm on this machine (slurmctld and slurmd side by side), to run and test the
# launch of meta_dist jobs under Slurm without a cluster. Debian/Ubuntu, as root.
#
#   scripts/ops/slurm_one_host.sh [start]   install (apt) if missing, write the config, start
#                                           munged, slurmctld and slurmd where not running, wait
#                                           until the node takes jobs
#   scripts/ops/slurm_one_host.sh stop      stop the three daemons (by the PIDs in their files)
#   scripts/ops/slurm_one_host.sh status    sinfo, and the daemons' PIDs
#
# Idempotent: a second `start` changes nothing that is already right. It writes
# /etc/slurm/slurm.conf only when there is none or when the one there was written by this script
# (first line); another file is left alone and the script stops with an error. The node gets
# SLURM_ONE_HOST_CPUS CPUs (default: 4, or the host's count when that is more) whatever the host
# has, so `salloc -n 4` works on 2 cores; ranks then share the cores (oversubscribed). No
# systemd is needed: the daemons are started directly and put themselves in the background.
set -euo pipefail

action=${1:-start}
conf=/etc/slurm/slurm.conf
mark="# written by meta_dist scripts/ops/slurm_one_host.sh"
host=$(hostname -s)
cores=$(nproc)
cpus=${SLURM_ONE_HOST_CPUS:-$(( cores > 4 ? cores : 4 ))}
ctld_pid=/run/slurmctld.pid
slurmd_pid=/run/slurmd.pid
munged_pid=/run/munge/munged.pid

say() { echo "slurm_one_host: $*"; }
die() { echo "slurm_one_host: error: $*" >&2; exit 1; }
alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_one() {  # stop the daemon whose PID is in file $1
    local file=$1 pid
    if alive "$file"; then
        pid=$(cat "$file")
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        say "stopped $(basename "$file" .pid) (pid $pid)"
    fi
}

case $action in
stop)
    stop_one "$slurmd_pid"; stop_one "$ctld_pid"; stop_one "$munged_pid"
    exit 0 ;;
status)
    for f in "$munged_pid" "$ctld_pid" "$slurmd_pid"; do
        if alive "$f"; then say "$(basename "$f" .pid) running, pid $(cat "$f")"
        else say "$(basename "$f" .pid) not running"; fi
    done
    sinfo 2>&1 || true
    exit 0 ;;
start) ;;
*) die "unknown action '$action' (start, stop or status)" ;;
esac

[[ $(id -u) == 0 ]] || die "run as root (it installs packages and starts daemons)"

# 1. packages: the controller, the node daemon, the client commands (salloc, srun, sbatch,
# sinfo) and munge for authentication; and libpmix-dev for srun --mpi=pmix: Debian's plugin
# (mpi_pmix_v4.so) loads .../pmix2/lib/libpmix.so, the unversioned name, which only the -dev
# package installs (with libpmix2 alone srun says "pmi/pmix: can not load PMIx library")
need=()
for pair in slurmctld:slurmctld slurmd:slurmd salloc:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null || need+=("${pair#*:}")
done
pmix_lib=(/usr/lib/*/pmix2/lib/libpmix.so)
[[ -e ${pmix_lib[0]} ]] || need+=(libpmix-dev)
if (( ${#need[@]} )); then
    say "installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # a running slurmd keeps the plugins it failed to load: restart it below
    stop_one "$slurmd_pid"
fi

# 2. the config
new=$(cat <<CONF
$mark
# A one-host cluster: controller and the only node are this machine ($host), reached at
# 127.0.0.1 whether or not its name resolves.
ClusterName=onehost
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# no cgroups (none in a container): processes tracked by their parent, tasks not bound
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=$ctld_pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# the node is taken to have the CPUs written here, not those slurmd counts, so that 4 tasks
# fit on fewer cores; without this a node with CPUs above the count is drained
SlurmdParameters=config_overrides
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
)
changed=0
if [[ -e $conf ]]; then
    [[ $(head -n1 "$conf") == "$mark" ]] || die "$conf exists and was not written by this script; not touching it"
    [[ $(cat "$conf") == "$new" ]] || changed=1
else
    changed=1
fi
if (( changed )); then
    mkdir -p /etc/slurm
    printf '%s\n' "$new" > "$conf"
    say "wrote $conf (node $host, CPUs=$cpus)"
    # running daemons must read the new file
    stop_one "$slurmd_pid"; stop_one "$ctld_pid"
fi
mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm

# 3. munge: a key (the Debian package makes one), then the daemon, run as its own user
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
fi
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    say "started munged (pid $(cat "$munged_pid"))"
fi
munge -n </dev/null | unmunge >/dev/null || die "munge does not work; see /var/log/munge/munged.log"

# 4. the controller, then the node daemon (each forks into the background, writes its PID file)
if ! alive "$ctld_pid"; then
    slurmctld
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    say "started slurmctld (pid $(cat "$ctld_pid"))"
fi
if ! alive "$slurmd_pid"; then
    slurmd
    for _ in $(seq 50); do alive "$slurmd_pid" && break; sleep 0.1; done
    say "started slurmd (pid $(cat "$slurmd_pid"))"
fi

# 5. wait until the node takes jobs (a node left down or drained by an earlier run is resumed)
for i in $(seq 60); do
    state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null | head -n1)
    case $state in
        idle*|mix*|alloc*) break ;;
        down*|drain*|drng*)
            if (( i % 5 == 1 )); then
                scontrol update NodeName="$host" State=RESUME 2>/dev/null || true
            fi ;;
    esac
    sleep 0.5
done
sinfo
case $state in
    idle*|mix*|alloc*) say "ready: node $host, $cpus CPUs, partition debug" ;;
    *) die "node $host is '$state'; see /var/log/slurm/slurmctld.log and slurmd.log" ;;
esac
