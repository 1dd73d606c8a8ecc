"""cupy.cuda.nccl of the stand-in: NCCL communicators whose calls run on stand-in streams.

Imports numpy and the stand-in's _engine, _memory, _knobs, _errors, cuda.stream,
cuda._nccl_ranks (rendezvous, transport) and cuda._nccl_data (what a call computes). The API
is CuPy 14's (cupy_backends/cuda/libs/nccl.pyx, and docs/source/reference/cuda.rst "NCCL");
the behaviour is NCCL's user guide
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/):

- Constants: ncclDataType_t and ncclRedOp_t values as CuPy names them (nccl.h.in).
- ``NcclError(status)`` reads "<NAME>: <ncclGetErrorString text>"; CuPy's name table stops at 6,
  so constructing it with 7 (ncclInProgress) or 8 (ncclTimeout) raises KeyError(status).
- ``NcclCommunicator(ndev, commId: bytes, rank)`` joins on the *current* device and blocks until
  all ``ndev`` ranks have joined (usage/communicators.html). Two ranks on one GPU fail with
  status 5 (invalid usage), unless NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 on each rank.
- Calls check their arguments as NCCL's ArgsCheck does (status 4, invalid argument: bad
  datatype or op for the version, root or peer out of range, a pointer that is not live
  device memory of this communicator's GPU) and, stricter than NCCL, refuse buffers that
  overlap other than in place (usage/inplace.html: sendbuff == recvbuff; reduce-scatter in
  place is recvbuff == sendbuff + rank*recvcount; all-gather sendbuff == recvbuff +
  rank*sendcount) and send/recv outside ncclGroupStart/ncclGroupEnd (usage/p2p.html).
- A call returns once enqueued; it runs on the given stream (``stream.ptr``; 0 is the legacy
  default stream) after that stream's earlier work (usage/streams.html). Inside a group,
  calls are only enqueued at the outer ``groupEnd`` (usage/groups.html).
- A call some rank never makes never completes: its stream stays busy ("Failure to do so will
  result in other ranks waiting indefinitely", usage/operations.html) until ``abort()``
  (ncclCommAbort), after which every call on the communicator fails with status 4.
- ``destroy()`` waits for the communicator's queued calls (ncclCommDestroy finalizes, i.e.
  flushes, first); ``check_async_error()`` raises the communicator's asynchronous error.
"""

from __future__ import annotations

import itertools
import operator
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _engine, _knobs, _memory
from .._errors import add_note
from . import _nccl_data, _nccl_ranks
from ._nccl_data import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    DATATYPES,
    OPS,
    P2P,
    REDUCE,
    REDUCESCATTER,
)
from .stream import queue_of_handle

available = True

NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_UNIQUE_ID_BYTES = 128
BUILD_VERSION = 22501  # what the cupy-cuda12x 14.2.0 wheel was built against (gpu_facts.md)

_ERROR_NAMES = {0: "NCCL_ERROR_SUCCESS", 1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
                2: "NCCL_ERROR_SYSTEM_ERROR", 3: "NCCL_ERROR_INTERNAL_ERROR",
                4: "NCCL_ERROR_INVALID_ARGUMENT", 5: "NCCL_ERROR_INVALID_USAGE",
                6: "NCCL_ERROR_REMOTE_ERROR"}
_ERROR_TEXTS = {0: "no error",
                1: "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
                2: "unhandled system error (run with NCCL_DEBUG=INFO for details)",
                3: "internal error - please report this issue to the NCCL developers",
                4: "invalid argument (run with NCCL_DEBUG=WARN for details)",
                5: "invalid usage (run with NCCL_DEBUG=WARN for details)",
                6: "remote process exited or there was a network error",
                7: "NCCL operation in progress", 8: "timeout"}
_HANDLES = itertools.count(0x6C00_0000, 0x1000)
_GROUP = threading.local()


class NcclError(RuntimeError):
    """An NCCL call failed; ``status`` is the ncclResult_t value."""

    def __init__(self, status: int) -> None:
        self.status = status
        text = _ERROR_TEXTS.get(status, "unknown result code")
        name = _ERROR_NAMES[status]  # KeyError for 7 and 8, as CuPy's table stops at 6
        super().__init__(f"{name}: {text}")

    def __reduce__(self) -> tuple:
        return type(self), (self.status,)


def check_status(status: int) -> None:
    """Raise NcclError unless ``status`` is 0 (ncclSuccess)."""
    if status != 0:
        raise NcclError(status)


def _fail(status: int, detail: str) -> NcclError:
    error = NcclError(status)
    add_note(error, detail)
    if _knobs.nccl_debug():
        sys.stderr.write(f"{os.uname().nodename}:{os.getpid()} NCCL WARN {detail}\n")
    return error


def get_version() -> int:
    """Return the modeled NCCL runtime version code (e.g. 22809 for 2.28.9)."""
    return _knobs.encode_nccl_version(*_knobs.nccl_version())


def get_build_version() -> int:
    """Return the NCCL version CuPy was built against."""
    return BUILD_VERSION


_ID_MAGIC = b"meta_dist-standin-nccl-id\x00"


def get_unique_id() -> bytes:
    """Return a new unique id: bytes of length 128 (CuPy 14; CuPy 13 returned a tuple)."""
    body = _ID_MAGIC + os.urandom(32)
    return body + bytes(NCCL_UNIQUE_ID_BYTES - len(body))


def groupStart() -> None:  # noqa: N802 (CuPy's name)
    """Start a group: calls until the matching ``groupEnd`` are enqueued together."""
    _GROUP.depth = getattr(_GROUP, "depth", 0) + 1
    if _GROUP.depth == 1:
        _GROUP.calls = []


def groupEnd() -> None:  # noqa: N802
    """End a group; at the outermost end, enqueue its calls (per communicator, in order)."""
    depth = getattr(_GROUP, "depth", 0)
    if depth == 0:
        raise _fail(5, "ncclGroupEnd called without a matching ncclGroupStart")
    _GROUP.depth = depth - 1
    if depth > 1:
        return
    calls, _GROUP.calls = _GROUP.calls, []
    by_comm: dict[int, list[_Call]] = {}
    for call in calls:
        by_comm.setdefault(id(call.comm), []).append(call)
    for grouped in by_comm.values():
        grouped[0].comm._launch(grouped)


class NcclConfig:
    """Communicator options (CuPy exposes only splitShare)."""

    def __init__(self, split_share: int = 0) -> None:
        self.split_share = split_share


def _c_int(name: str, value: Any, unsigned: bool = False) -> int:
    """Convert as Cython does for int / intptr_t / size_t parameters."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"an integer is required (argument {name!r}, got "
                        f"{type(value).__name__})") from None
    if unsigned and number < 0:
        raise OverflowError(f"can't convert negative value to size_t (argument {name!r})")
    return number


@dataclass(eq=False)
class _Buffer:
    storage: _memory.Storage
    offset: int
    nbytes: int

    def region(self, write: bool) -> _engine.Region:
        return _engine.Region(self.storage, self.offset, self.offset + self.nbytes, write)

    def read(self) -> np.ndarray:
        return self.storage.view(self.offset, (self.nbytes,), (1,), np.dtype(np.uint8)).copy()

    def write(self, data: np.ndarray) -> None:
        self.storage.view(self.offset, (self.nbytes,), (1,), np.dtype(np.uint8))[...] = data

    def write_prefix(self, data: np.ndarray) -> None:
        """Write ``data`` over the buffer's first bytes; the rest keep what they held."""
        self.storage.view(self.offset, (len(data),), (1,), np.dtype(np.uint8))[...] = data

    def overlaps(self, other: _Buffer) -> bool:
        return (self.storage is other.storage and self.offset < other.offset + other.nbytes
                and other.offset < self.offset + self.nbytes)


@dataclass(eq=False)
class _Call:
    comm: NcclCommunicator
    kind: int
    name: str
    count: int
    datatype: int
    op: int
    root: int
    send: _Buffer | None
    recv: _Buffer | None
    queue: _engine.Queue
    tag: int
    fault: tuple[str, int] | None = None  # ("hang", 0) or ("error", status)
    own: np.ndarray | None = None  # this rank's input bytes, read when the call runs

    def header(self) -> tuple[int, ...]:
        op = self.op if self.kind in (ALLREDUCE, REDUCE, REDUCESCATTER) else 0
        root = self.root if self.kind in (BROADCAST, REDUCE) else 0
        return _nccl_ranks.MAGIC, self.kind, self.datatype, op, self.count, root


class NcclCommunicator:
    """One rank of an NCCL communicator, on the device current at construction."""

    def __init__(self, ndev: int, commId: bytes, rank: int,  # noqa: N803 (CuPy's names)
                 config: NcclConfig | None = None) -> None:
        self._handle = 0
        ndev, rank = _c_int("ndev", ndev), _c_int("rank", rank)
        if not isinstance(commId, bytes):
            raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                            f"{type(commId).__name__})")
        if len(commId) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"commId length {len(commId)} != {NCCL_UNIQUE_ID_BYTES}.")
        if ndev < 1 or not 0 <= rank < ndev:
            raise _fail(4, f"ncclCommInitRank: rank {rank} and nranks {ndev}; expected "
                           f"0 <= rank < nranks")
        if not commId.startswith(_ID_MAGIC):
            raise _fail(2, "ncclCommInitRank: the unique id was not made by get_unique_id(); "
                           "bootstrap cannot reach its root")
        self._device = _engine.current_device()
        try:
            comm, _ = (_nccl_ranks.rendezvous(commId, ndev, rank, self._device.pci_bus_id)
                       if ndev > 1 else (None, None))
        except _nccl_ranks.InitFailure as failure:
            raise _fail(failure.status, f"ncclCommInitRank: {failure}") from None
        self._rank, self._size = rank, ndev
        self._transport = _nccl_ranks.Transport(comm, rank)
        self._aborted = threading.Event()
        self._async_status = 0
        self._calls = 0
        self._collectives = 0
        self._p2p: dict[tuple[str, int], int] = {}
        self._pending: list[tuple[_engine.Queue, int, dict[int, int]]] = []
        self._hangs = {n for r, n in _knobs.nccl_hangs() if r == rank}
        self._errors = {n: s for r, n, s in _knobs.nccl_async_errors() if r == rank}
        self._handle = next(_HANDLES)

    @property
    def comm(self) -> int:
        """The raw ncclComm_t handle (0 after destroy or abort)."""
        return self._handle

    @staticmethod
    def initAll(devices: Any) -> list[NcclCommunicator]:  # noqa: N802
        """Not modeled: the stand-in runs one device per process (see the report)."""
        raise NotImplementedError("cupy stand-in: NcclCommunicator.initAll (one process driving "
                                  "several GPUs) is not modeled; create one communicator per "
                                  "process with NcclCommunicator(ndev, uid, rank)")

    def _live(self, api: str) -> None:
        if not self._handle:
            raise _fail(4, f"{api}: the communicator was destroyed or aborted (comm is NULL)")

    def device_id(self) -> int:
        """Return the CUDA device of this rank."""
        self._live("ncclCommCuDevice")
        return self._device.index

    def rank_id(self) -> int:
        """Return this rank's index."""
        self._live("ncclCommUserRank")
        return self._rank

    def size(self) -> int:
        """Return the number of ranks."""
        self._live("ncclCommCount")
        return self._size

    def check_async_error(self) -> None:
        """Raise NcclError for an asynchronous error of this communicator (KeyError for 7, 8)."""
        self._live("ncclCommGetAsyncError")
        if self._async_status:
            raise NcclError(self._async_status)

    def abort(self) -> None:
        """Stop every queued call of this communicator (ncclCommAbort); later calls fail.

        With META_DIST_STANDIN_NCCL_ABORT_HANG=1 it then never returns (see ``_knobs``).
        """
        if self._handle:
            self._aborted.set()
            self._handle = 0
            if _knobs.nccl_abort_hangs():
                threading.Event().wait()  # stuck inside ncclCommAbort

    def destroy(self) -> None:
        """Wait for this communicator's queued calls, then free it (ncclCommDestroy)."""
        if not self._handle:
            return
        for q, seq, clock in self._pending:
            _engine.wait(q, seq, clock)
        self._pending.clear()
        self._handle = 0
        if self._transport.comm is not None:
            self._transport.comm.Free()

    def __del__(self) -> None:
        # CuPy destroys on deallocation. A finalizer may run in any thread, so this one takes
        # no stand-in lock and does not wait: a communicator with queued calls is left alone
        try:
            if self._handle and all(q.completed >= seq for q, seq, _ in self._pending):
                self._handle = 0
                if self._transport.comm is not None:
                    from mpi4py import MPI

                    if not MPI.Is_finalized():
                        self._transport.comm.Free()
        except Exception:  # interpreter shutdown: nothing left to free
            pass

    def commSplit(self, color: int, key: int,  # noqa: N802
                  config: NcclConfig | None = None) -> NcclCommunicator | None:
        """Split into disjoint communicators by ``color`` (-1: none), ranked by ``key``.

        Collective over this communicator, with no call of it outstanding (NCCL >= 2.18).
        """
        self._live("ncclCommSplit")
        if _knobs.nccl_version() < (2, 18, 0):
            raise _fail(5, "ncclCommSplit needs NCCL >= 2.18")
        color, key = _c_int("color", color), _c_int("key", key)
        comm = None
        if self._transport.comm is not None:  # collective: every rank calls Split
            from mpi4py import MPI

            comm = self._transport.comm.Split(MPI.UNDEFINED if color < 0 else color, key)
        if color < 0:
            return None
        child = NcclCommunicator.__new__(NcclCommunicator)
        child.__dict__.update(self.__dict__)
        child._rank = 0 if comm is None else comm.Get_rank()
        child._size = 1 if comm is None else comm.Get_size()
        child._transport = _nccl_ranks.Transport(comm, child._rank)
        child._aborted, child._async_status = threading.Event(), 0
        child._calls = child._collectives = 0
        child._p2p, child._pending = {}, []
        child._handle = next(_HANDLES)
        return child

    # ------------------------------------------------------------------ calls

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  op: int, stream: int) -> None:
        """Reduce ``count`` elements across ranks into every rank's recvbuf."""
        self._submit(ALLREDUCE, "allReduce", sendbuf, recvbuf, count, datatype, op, 0, stream)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        """Reduce ``count`` elements across ranks into recvbuf of rank ``root``."""
        self._submit(REDUCE, "reduce", sendbuf, recvbuf, count, datatype, op, root, stream)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        """Copy ``count`` elements of rank ``root``'s sendbuff into every rank's recvbuff."""
        self._submit(BROADCAST, "broadcast", sendbuff, recvbuff, count, datatype, 0, root,
                     stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        """In-place broadcast: ``broadcast(buff, buff, ...)``."""
        self._submit(BROADCAST, "bcast", buff, buff, count, datatype, 0, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int,  # noqa: N802
                      datatype: int, op: int, stream: int) -> None:
        """Reduce nranks*recvcount elements; rank r receives block r (recvcount elements)."""
        self._submit(REDUCESCATTER, "reduceScatter", sendbuf, recvbuf, recvcount, datatype, op,
                     0, stream)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,  # noqa: N802
                  stream: int) -> None:
        """Gather ``count`` elements of every rank, in rank order, into every recvbuf."""
        self._submit(ALLGATHER, "allGather", sendbuf, recvbuf, count, datatype, 0, 0, stream)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """Send ``count`` elements to ``peer`` (inside groupStart/groupEnd)."""
        self._submit(P2P, "send", sendbuf, None, count, datatype, 0, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """Receive ``count`` elements from ``peer`` (inside groupStart/groupEnd)."""
        self._submit(P2P, "recv", None, recvbuf, count, datatype, 0, peer, stream)

    def _submit(self, kind: int, name: str, sendbuf: Any, recvbuf: Any, count: Any,
                datatype: Any, op: Any, root: Any, stream: Any) -> None:
        grouped = getattr(_GROUP, "depth", 0) > 0
        if kind == P2P and not grouped:
            raise _fail(5, f"nccl {name}: point-to-point calls must be inside "
                           f"groupStart()/groupEnd() (the stand-in is stricter than NCCL here; "
                           f"usage/p2p.html)")
        call = self._check(kind, name, sendbuf, recvbuf, count, datatype, op, root, stream)
        if grouped:
            _GROUP.calls.append(call)
        else:
            self._launch([call])

    def _check(self, kind: int, name: str, sendbuf: Any, recvbuf: Any, count: Any,
               datatype: Any, op: Any, root: Any, stream: Any) -> _Call:
        """Validate one call as NCCL's ArgsCheck does; return it ready to enqueue."""
        api = f"nccl {name}"
        sendbuf = None if sendbuf is None else _c_int("sendbuf", sendbuf)
        recvbuf = None if recvbuf is None else _c_int("recvbuf", recvbuf)
        count, datatype = _c_int("count", count, True), _c_int("datatype", datatype)
        op, root, stream = _c_int("op", op), _c_int("root", root), _c_int("stream", stream)
        self._live(api)
        version = _knobs.nccl_version()
        if datatype not in DATATYPES or version < DATATYPES[datatype][2]:
            raise _fail(4, f"{api}: invalid datatype {datatype} for NCCL "
                           f"{'.'.join(map(str, version))}")
        if datatype in (10, 11) and _nccl_data.fp8(datatype) is None:
            raise _fail(4, f"{api}: fp8 datatypes need ml_dtypes installed in the stand-in")
        if kind in (ALLREDUCE, REDUCE, REDUCESCATTER) and (
                op not in OPS or version < OPS[op][2]):
            raise _fail(4, f"{api}: invalid reduction operation {op} for NCCL "
                           f"{'.'.join(map(str, version))}")
        if kind in (BROADCAST, REDUCE, P2P) and not 0 <= root < self._size:
            what = "peer" if kind == P2P else "root"
            raise _fail(4, f"{api}: {what} {root} out of range; expected 0 <= {what} < "
                           f"{self._size}")
        q = queue_of_handle(stream, self._device.index)
        if q is None:
            raise _fail(1, f"{api}: stream {stream:#x} is not a live stream of device "
                           f"{self._device.index} (cudaErrorInvalidResourceHandle)")
        size = np.dtype(DATATYPES[datatype][1]).itemsize
        whole = count * (self._size if kind in (ALLGATHER, REDUCESCATTER) else 1) * size
        send_bytes = count * size * (self._size if kind == REDUCESCATTER else 1)
        recv_bytes = whole if kind in (ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, P2P) else (
            count * size)
        uses_send = sendbuf is not None and (kind != BROADCAST or root == self._rank)
        uses_recv = recvbuf is not None and (kind != REDUCE or root == self._rank)
        send = self._buffer(api, "sendbuff", sendbuf, send_bytes) if uses_send else None
        recv = self._buffer(api, "recvbuff", recvbuf, recv_bytes) if uses_recv else None
        self._check_overlap(api, kind, send, recv, count * size)
        return _Call(self, kind, name, count, datatype, op, root, send, recv, q,
                     self._tag(kind, name, root), self._fault())

    def _buffer(self, api: str, what: str, ptr: int, nbytes: int) -> _Buffer | None:
        if nbytes == 0:
            return None
        found = _memory.find(ptr)
        if found is None:
            raise _fail(4, f"{api}: {what} {ptr:#x} is not live device memory (freed, host "
                           f"memory, or never allocated)")
        storage, offset = found
        if storage.device != self._device.index:
            raise _fail(4, f"{api}: {what} {ptr:#x} is on device {storage.device}, the "
                           f"communicator on device {self._device.index}")
        if offset + nbytes > storage.nbytes:
            raise _fail(4, f"{api}: {what} {ptr:#x} needs {nbytes} bytes but its allocation "
                           f"{storage.describe()} ends {storage.nbytes - offset} bytes after it")
        return _Buffer(storage, offset, nbytes)

    def _check_overlap(self, api: str, kind: int, send: _Buffer | None,
                       recv: _Buffer | None, block: int) -> None:
        if send is None or recv is None or not send.overlaps(recv):
            return
        delta = send.offset - recv.offset
        in_place = {ALLREDUCE: delta == 0, BROADCAST: delta == 0, REDUCE: delta == 0,
                    ALLGATHER: delta == self._rank * block,
                    REDUCESCATTER: -delta == self._rank * block}.get(kind, False)
        if not in_place:
            raise _fail(4, f"{api}: sendbuff and recvbuff overlap without being in place "
                           f"(recvbuff - sendbuff = {-delta} bytes); NCCL defines in place only "
                           f"as usage/inplace.html states, anything else is undefined")

    def _tag(self, kind: int, name: str, peer: int) -> int:
        span = self._transport.tag_span
        if kind != P2P:
            self._collectives += 1
            return 2 * (self._collectives % span)
        key = (name, peer)
        self._p2p[key] = self._p2p.get(key, 0) + 1
        return 2 * (self._p2p[key] % span) + 1

    def _fault(self) -> tuple[str, int] | None:
        self._calls += 1
        if self._calls in self._errors:
            return "error", self._errors[self._calls]
        return ("hang", 0) if self._calls in self._hangs else None

    def _launch(self, calls: list[_Call]) -> None:
        q = calls[0].queue
        if any(call.queue is not q for call in calls):
            raise _fail(5, "ncclGroupEnd: calls of one communicator on different streams in "
                           "one group (the stand-in refuses mixing streams in a group)")
        self._live(f"nccl {calls[0].name}")
        regions = [call.send.region(False) for call in calls if call.send is not None]
        regions += [call.recv.region(True) for call in calls if call.recv is not None]
        label = "nccl " + "+".join(call.name for call in calls)
        op = _engine.enqueue(q, lambda: self._run(calls), label, regions=regions)
        self._pending = [p for p in self._pending if p[0].completed < p[1]]
        self._pending.append((q, op.seq, op.clock))

    # ------------------------------------------------------------------ on the stream

    def _run(self, calls: list[_Call]) -> None:
        faults = [call.fault for call in calls if call.fault is not None]
        if faults:
            for kind, status in faults:
                if kind == "error":
                    self._async_status = status
            self._aborted.wait()  # the kernel never finishes; ncclCommAbort ends it
            return
        me, n = self._rank, self._size
        sends, recvs = [], []
        for call in calls:
            data = call.send.read() if call.send is not None else None
            for peer, payload in _nccl_data.outgoing(call, me, n, data):
                sends.append((peer, call.tag, _nccl_ranks.pack(*call.header()[1:], payload)))
            recvs += [(peer, call.tag) for peer in _nccl_data.incoming(call, me, n)]
            call.own = data
        got = self._transport.exchange(sends, recvs, self._aborted)
        if got is None:
            return
        for call in calls:
            payloads = {}
            for peer in _nccl_data.incoming(call, me, n):
                header, payload = _nccl_ranks.unpack(got[(peer, call.tag)])
                if header != call.header():
                    self._mismatch(call, peer, header)
                    return
                payloads[peer] = payload
            _nccl_data.finish(call, me, n, call.own, payloads, _knobs.nccl_version())

    def _mismatch(self, call: _Call, peer: int, header: tuple[int, ...]) -> None:
        detail = (f"rank {self._rank} called {_nccl_ranks.describe_header(call.header())} but "
                  f"rank {peer} called {_nccl_ranks.describe_header(header)}; NCCL would hang "
                  f"or corrupt data")
        sys.stderr.write(f"cupy stand-in NCCL WARN {detail}\n")
        self._async_status = 5
        self._aborted.wait()
