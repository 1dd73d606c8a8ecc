"""How the stand-in's NCCL ranks meet and move data: file rendezvous, then MPI messages.

Imports numpy, the stand-in's _engine and _knobs, and mpi4py (only for communicators of more
than one rank). ncclCommInitRank blocks until every rank of the unique id has joined (NCCL user
guide, usage/communicators.html); here each rank drops a small file named after the id in a
directory on the host, waits for the others' files (learning their MPI.COMM_WORLD ranks, hosts
and GPUs), then builds an MPI communicator of exactly those processes with
``COMM_WORLD.Create_group``, which is collective over the group only. Data then move as MPI
messages between stream worker threads (MPI_THREAD_MULTIPLE), each tagged by the call's
position in the communicator's call order and carrying a header, so a peer that called a
different collective is detected instead of silently mixing data.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import _knobs

MAGIC = 0x4E43434C  # "NCCL"
HEADER_WORDS = 6  # magic, kind, datatype, op, count, root/peer
KIND_NAMES = {1: "allReduce", 2: "broadcast", 3: "reduce", 4: "allGather", 5: "reduceScatter",
              6: "send/recv"}


class InitFailure(Exception):
    """Communicator init failed with NCCL status ``status`` for the reason in the message."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass
class Peer:
    """What one rank told the others at init."""

    rank: int
    world_rank: int
    world_size: int
    host: str
    bus: str
    nranks: int
    shares_gpu_ok: bool
    pid: int


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError("cupy stand-in: an NCCL communicator of more than one rank moves its "
                           f"data through MPI, and mpi4py does not import ({error}); run the "
                           "ranks under mpirun with mpi4py installed") from error
    if not MPI.Is_initialized() or MPI.Is_finalized():
        raise RuntimeError("cupy stand-in: NCCL ranks need MPI initialised (import mpi4py.MPI "
                           "first; mpi4py does it by default)")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("cupy stand-in: NCCL calls run on stream threads and need "
                           "MPI_THREAD_MULTIPLE (mpi4py's default); got a lower thread level")
    return MPI


def rendezvous(uid: bytes, nranks: int, rank: int, bus: str) -> tuple[Any, list[Peer]]:
    """Meet the other ranks of ``uid``; return (MPI communicator in NCCL rank order, peers).

    Raises:
        InitFailure: with NCCL's status when the ranks cannot form a communicator.
    """
    mpi = _mpi()
    world = mpi.COMM_WORLD
    me = Peer(rank, world.Get_rank(), world.Get_size(), platform.node(), bus, nranks,
              _knobs.nccl_version() >= (2, 30, 0) and _knobs.multi_rank_gpu_enabled(),
              os.getpid())
    directory = Path(_knobs.rendezvous_dir()) / hashlib.sha256(uid).hexdigest()[:32]
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".rank{rank}.{os.getpid()}"
    staging.write_text(json.dumps(me.__dict__))
    try:
        os.link(staging, directory / f"rank{rank}.json")
    except FileExistsError:
        raise InitFailure(5, f"rank {rank} of {nranks} has already checked in with this unique "
                             f"id (NCCL's bootstrap root refuses a second rank {rank})") from None
    finally:
        staging.unlink()
    peers = _wait_for_peers(directory, nranks)
    _check_peers(me, peers)
    group = world.Get_group().Incl([p.world_rank for p in peers])
    try:
        comm = world.Create_group(group, int.from_bytes(hashlib.sha256(uid).digest()[:2]) % 32768)
    finally:
        group.Free()
    (directory / f"rank{rank}.json").unlink()  # every rank has read the files by now
    try:
        directory.rmdir()
    except OSError:  # another rank's file is still there; the last one removes the directory
        pass
    return comm, peers


def _wait_for_peers(directory: Path, nranks: int) -> list[Peer]:
    limit = _knobs.nccl_init_timeout()
    deadline = None if limit is None else time.monotonic() + limit
    pause = 1e-3
    while True:
        found = {}
        for path in directory.glob("rank*.json"):
            try:
                found[path.name] = Peer(**json.loads(path.read_text()))
            except (OSError, ValueError):  # being written or removed right now
                continue
        if len(found) >= nranks:
            return sorted(found.values(), key=lambda p: p.rank)
        if deadline is not None and time.monotonic() > deadline:
            raise InitFailure(2, f"only {len(found)} of {nranks} ranks arrived within {limit} s "
                                 f"({_knobs.ENV_NCCL_INIT_TIMEOUT}); NCCL itself would wait "
                                 f"forever")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def _check_peers(me: Peer, peers: list[Peer]) -> None:
    if any(p.nranks != me.nranks for p in peers) or [p.rank for p in peers] != list(
            range(me.nranks)):
        raise InitFailure(5, f"ranks disagree on the communicator size: "
                             f"{sorted((p.rank, p.nranks) for p in peers)}")
    if len({p.world_rank for p in peers}) != len(peers) or any(
            p.world_size != me.world_size for p in peers):
        raise RuntimeError("cupy stand-in: the ranks of one NCCL communicator must be processes "
                           "of one MPI job (one mpirun); got clashing MPI ranks")
    by_gpu: dict[tuple[str, str], list[Peer]] = {}
    for p in peers:
        by_gpu.setdefault((p.host, p.bus), []).append(p)
    for (host, bus), sharing in by_gpu.items():
        if len(sharing) > 1 and not all(p.shares_gpu_ok for p in sharing):
            ranks = [p.rank for p in sharing]
            if _knobs.nccl_version() >= (2, 30, 0):
                why = ("Multiple Ranks are using the same GPU/Partition. Set "
                       "NCCL_MULTI_RANK_GPU_ENABLE=1 on every rank to allow it (experimental)")
            else:
                why = (f"Duplicate GPU detected : rank {ranks[0]} and rank {ranks[1]} both on "
                       f"CUDA device {bus}")
            raise InitFailure(5, f"{why}; ranks {ranks} on host {host} share GPU {bus}")


class Transport:
    """Tagged byte messages between the ranks of one communicator (MPI, or none for 1 rank)."""

    def __init__(self, comm: Any, rank: int) -> None:
        self.comm, self.rank = comm, rank
        self._local: dict[tuple[int, int], np.ndarray] = {}  # one-rank self messages
        self._lock = threading.Lock()
        span = 32767
        if comm is not None:
            from mpi4py import MPI

            span = int(comm.Get_attr(MPI.TAG_UB) or span)
        self.tag_span = span // 2

    def exchange(self, sends: list[tuple[int, int, np.ndarray]], recvs: list[tuple[int, int]],
                 aborted: threading.Event) -> dict[tuple[int, int], np.ndarray] | None:
        """Send each (peer, tag, bytes), receive each (peer, tag); None if aborted first."""
        if self.comm is None:
            with self._lock:
                for peer, tag, data in sends:
                    self._local[(peer, tag)] = data
                return {key: self._local.pop(key) for key in recvs}
        from mpi4py import MPI

        # a point-to-point send (odd tag, NcclCommunicator._tag) completes only once its peer
        # has matched it, however small: ncclSend "is blocking for the GPU" (api/p2p.html),
        # where MPI's eager Isend would finish before the peer ever called ncclRecv
        requests = [(self.comm.Issend if tag & 1 else self.comm.Isend)(data, dest=peer, tag=tag)
                    for peer, tag, data in sends]
        pending, got = list(recvs), {}
        status, pause = MPI.Status(), 1e-5
        while pending or requests:
            moved = False
            for key in list(pending):
                message = self.comm.Improbe(source=key[0], tag=key[1], status=status)
                if message is not None:
                    buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                    message.Recv(buf)
                    got[key] = buf
                    pending.remove(key)
                    moved = True
            if requests and MPI.Request.Testall(requests):
                requests, moved = [], True
            if aborted.is_set():
                return None  # ncclCommAbort: the kernel stops; unmatched sends are dropped
            if not moved:
                time.sleep(pause)  # other ranks share the cores: do not spin
                pause = min(pause * 2, 1e-3)
        return got


def pack(kind: int, datatype: int, op: int, count: int, root: int, payload: np.ndarray
         ) -> np.ndarray:
    """Return header + payload bytes of one message."""
    header = np.array([MAGIC, kind, datatype, op, count, root], np.int64).view(np.uint8)
    return np.concatenate([header, payload.reshape(-1).view(np.uint8)])


def unpack(message: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """Return (header values, payload bytes) of a message."""
    size = HEADER_WORDS * 8
    return tuple(int(v) for v in message[:size].view(np.int64)), message[size:]


def describe_header(header: tuple[int, ...]) -> str:
    """Return e.g. "allReduce(count=10, datatype=7, op=0, root=0)"."""
    _, kind, datatype, op, count, root = header
    return (f"{KIND_NAMES.get(kind, kind)}(count={count}, datatype={datatype}, op={op}, "
            f"root/peer={root})")
