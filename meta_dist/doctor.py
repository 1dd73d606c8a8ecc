"""``python -m meta_dist doctor``: what each rank sees, and whether the launch is sound.

    mpirun -np N python -m meta_dist doctor

Every rank reports its host, rank, local rank, MPI library and thread level, whether MPI takes
GPU pointers, its GPU (name, bus id, memory) or why there is none, NCCL's version or why NCCL
cannot run, its BLAS threads and the host's network interfaces; rank 0 prints them, then the
checks, each ``PASS`` or ``FAIL`` with the fix: the world size against the launcher's, ranks per
host against GPUs per host, two ranks on one GPU, versions that differ between ranks, a small
allreduce with a known answer; then, as ``INFO``, a point-to-point bandwidth probe from rank 0
to the first rank of every host (to rank 1 on one host). Exit code 1 on any FAIL. Runs without
a GPU.
"""

from __future__ import annotations

import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

PROBE_BYTES = 8 * 2**20  # the bandwidth probe's message
PROBE_ROUNDS = 5


def main(argv: list[str]) -> int:
    """Run the doctor on every rank; return 1 on any FAIL (the same on every rank)."""
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:  # every rank reads the same words: each leaves alike, before MPI starts
        from meta_dist import failfast

        print(f"python -m meta_dist doctor: unexpected argument {argv[0]!r}; it takes none "
              "(usage: mpirun -np N python -m meta_dist doctor)", file=sys.stderr)
        failfast.leave_together(2)
        return 2
    from meta_dist import failfast
    from meta_dist.connector import MPIConnector
    from meta_dist.errors import UsageError

    try:
        connector = MPIConnector()  # refuses a world that is not the one the launcher started
    except UsageError as error:
        print(f"FAIL  world size: {error}", flush=True)
        failfast.leave_together(1)  # every process of such a job is alone: no job to abort
        return 1
    try:
        return _run(connector)
    finally:
        connector.close()


def _run(connector: Any) -> int:
    from meta_dist.comm import make_communicator
    from meta_dist.gpus import gpu_survey

    device, problems = gpu_survey(connector)  # collective; makes this rank's GPU current
    mine = _describe(connector, device)
    every = connector.allgather(mine)
    checks = [(True, f"world size: {connector.size} rank(s), as launched"),  # the connector
              _gpus_per_host(every), _one_gpu_per_rank(problems), _same_versions(every)]
    comm = make_communicator("mpi", connector)
    try:
        checks.append(_allreduce(comm, connector.size))
    finally:
        comm.close()
    checks += _bandwidth(connector, every)
    failed = any(ok is False for ok, _ in checks)
    if connector.rank == 0:
        print(f"meta_dist doctor: {connector.size} rank(s) on "
              f"{len({r['host'] for r in every})} host(s)")
        for r in every:
            print(f"  rank {r['rank']} (local {r['local_rank']} of {r['local_size']}) on "
                  f"{r['host']}: {r['mpi']}; thread level {r['thread']}; CUDA-aware MPI "
                  f"{r['cuda_aware']}; GPU {r['gpu']}; NCCL {r['nccl']}; BLAS threads "
                  f"{r['blas']}; network {r['net']}")
        for ok, text in checks:  # None: a measurement, not a check
            print(f"{'INFO' if ok is None else 'PASS' if ok else 'FAIL'}  {text}")
        print("doctor: " + ("some checks FAILED" if failed else "every check passed"),
              flush=True)
    return 1 if failed else 0


def _describe(connector: Any, device: int) -> dict[str, Any]:
    """This rank's facts (plain values, so they pickle)."""
    from mpi4py import MPI

    from meta_dist.blas_threads import openblas_threads
    from meta_dist.comm.mpi_backend import cuda_aware_requested
    from meta_dist.gpus import nccl_unavailable_reason, nccl_version

    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    query = getattr(MPI, "Query_cuda_support", None)
    library = "unknown" if query is None else ("yes" if query() else "no")
    version = nccl_version()
    return {
        "rank": connector.rank, "local_rank": connector.local_rank,
        "local_size": connector.local_size, "host": connector.host,
        "mpi": connector.library_version, "thread": levels.get(MPI.Query_thread(), "?"),
        "cuda_aware": f"{library} (META_DIST_CUDA_AWARE_MPI "
                      f"{'on' if cuda_aware_requested() else 'off'})",
        "gpu": _gpu(device), "gpus_here": _gpu_count(),
        "nccl": ".".join(map(str, version)) if version else
                f"cannot run ({(nccl_unavailable_reason() or 'no version').split('; ')[0]})",
        "blas": openblas_threads(), "net": _interfaces(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "mpi4py": _version("mpi4py"), "meta_dist": _version("meta_dist"),
                     "mpi": connector.library_version, "cupy": _version("cupy"),
                     "nccl": version},
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # not installed, or fails to import here
        return None


def _gpu_count() -> int:
    from meta_dist.xp import gpu_count

    return gpu_count()


def _gpu(device: int) -> str:
    if device < 0:
        return "none"
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return (f"{device}: {name}, bus {cupy.cuda.Device(device).pci_bus_id}, "
            f"{props['totalGlobalMem'] / 2**30:.1f} GiB")


def _interfaces() -> str:
    names = [name for _, name in socket.if_nameindex()]
    states = []
    for name in names:
        state = Path(f"/sys/class/net/{name}/operstate")
        states.append(f"{name} ({state.read_text().strip()})" if state.exists() else name)
    return ", ".join(states) or "none found"


def _gpus_per_host(every: list[dict]) -> tuple[bool, str]:
    hosts: dict[str, list[dict]] = {}
    for r in every:
        hosts.setdefault(r["host"], []).append(r)
    over = [f"{host}: {len(ranks)} ranks, {ranks[0]['gpus_here']} GPU(s)"
            for host, ranks in hosts.items() if 0 < ranks[0]["gpus_here"] < len(ranks)]
    if over:
        return False, ("ranks per host: more ranks than GPUs (" + "; ".join(over) + "); fix: "
                       "start one rank per GPU on each host (-np and the hostfile's slots)")
    if all(r["gpus_here"] == 0 for r in every):
        return True, "ranks per host: no GPU on any host; training runs on the CPU (backend mpi)"
    return True, "ranks per host: at most one rank per GPU on every host"


def _one_gpu_per_rank(problems: list[str | None]) -> tuple[bool, str]:
    shared = sorted({p for p in problems if p and " share GPU " in p})
    if shared:
        return False, "GPU per rank: " + "; ".join(shared)
    return True, "GPU per rank: no two ranks on one GPU"


def _same_versions(every: list[dict]) -> tuple[bool, str]:
    differ = []
    for name in every[0]["versions"]:
        values = {repr(r["versions"][name]) for r in every}
        if len(values) > 1:
            differ.append(f"{name}: " + ", ".join(
                f"rank {r['rank']} {r['versions'][name]}" for r in every))
    if differ:
        return False, ("versions: the ranks differ (" + "; ".join(differ) + "); fix: install "
                       "the same environment on every host")
    return True, "versions: the same on every rank"


def _allreduce(comm: Any, size: int) -> tuple[bool, str]:
    x = np.full(1024, comm.rank + 1, np.float64)
    start = time.perf_counter()
    got = comm.allreduce(x)
    took = time.perf_counter() - start
    want = size * (size + 1) / 2
    if not np.all(got == want):
        return False, (f"allreduce: got {got[0]}, expected {want}; fix: check the network "
                       "between the hosts (and MPI's interface selection)")
    return True, f"allreduce: 8 KiB summed right on {size} rank(s) in {took * 1e3:.2f} ms"


def _bandwidth(connector: Any, every: list[dict]) -> list[tuple[bool | None, str]]:
    """Ping-pong PROBE_BYTES between rank 0 and the first rank of each host (rank 1 alone)."""
    comm = connector.comm
    firsts: dict[str, int] = {}
    for r in every:
        firsts.setdefault(r["host"], r["rank"])
    peers = [rank for rank in firsts.values() if rank != 0] or ([1] if connector.size > 1 else [])
    buffer = np.zeros(PROBE_BYTES, np.uint8)
    results = []
    for peer in peers:
        took = None
        if connector.rank in (0, peer):
            other = peer if connector.rank == 0 else 0
            start = time.perf_counter()
            for _ in range(PROBE_ROUNDS):
                if connector.rank == 0:
                    comm.Send(buffer, dest=other, tag=7)
                    comm.Recv(buffer, source=other, tag=7)
                else:
                    comm.Recv(buffer, source=other, tag=7)
                    comm.Send(buffer, dest=other, tag=7)
            took = time.perf_counter() - start
        took = comm.bcast(took, root=0)
        rate = 2 * PROBE_ROUNDS * PROBE_BYTES / took / 1e9
        where = "another host" if every[peer]["host"] != every[0]["host"] else "the same host"
        results.append((None, f"bandwidth: rank 0 <-> rank {peer} ({where}, "
                              f"{every[peer]['host']}): {rate:.2f} GB/s "
                              f"({PROBE_BYTES // 2**20} MiB ping-pong x {PROBE_ROUNDS})"))
    return results


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
