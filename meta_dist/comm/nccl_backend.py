"""NcclCommunicator: collectives on CuPy arrays through NCCL (``cupy.cuda.nccl``).

Imports meta_dist.comm.base / checks / streams, meta_dist.connector, meta_dist.gpus and
meta_dist.watchdog; cupy only inside functions, so this module imports where cupy is missing
(``meta_dist.gpus`` says why NCCL cannot run). Imported lazily by
``meta_dist.comm.make_communicator``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from meta_dist.comm.base import Communicator
from meta_dist.comm.checks import DTYPES
from meta_dist.comm.streams import mark
from meta_dist.connector import MPIConnector
from meta_dist.errors import UsageError
from meta_dist.gpus import gpu_survey, nccl_version, ranks_problem
from meta_dist.watchdog import DEFAULT_STALL_TIMEOUT_S, StallWatchdog, resolve_stall_timeout
from meta_dist.xp import is_cupy_array

# cupy.cuda.nccl's names for the ncclDataType_t and ncclRedOp_t of each dtype and op, looked up
# when a communicator is made, and their values in nccl.h where a CuPy lacks the name (CuPy 13
# has no NCCL_AVG). avg is ncclAvg from NCCL 2.10 on: floats are multiplied by 1/size before
# the sum (src/enqueue.cc), so an fp16 average does not overflow where the sum would; before
# 2.10 it is a sum that the base divides by size once. On one rank avg is a sum (the array
# itself): NCCL before 2.29.7 leaves the last elements of a one-rank ncclAvg unwritten
# (NVIDIA/nccl#1950; seen on an H200 with NCCL 2.28.3, 17 of 70001 float32 elements).
NCCL_DTYPE_NAMES = {"uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "int64": "NCCL_INT64",
                    "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
                    "float64": "NCCL_FLOAT64", "bfloat16": "NCCL_BFLOAT16"}
NCCL_OP_NAMES = {"sum": "NCCL_SUM", "avg": "NCCL_AVG", "prod": "NCCL_PROD", "max": "NCCL_MAX",
                 "min": "NCCL_MIN"}
NCCL_H = {"NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT64": 4, "NCCL_FLOAT16": 6,
          "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9, "NCCL_SUM": 0,
          "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
AVG_AND_BF16_VERSION = (2, 10, 0)  # ncclAvg and ncclBfloat16 appeared together
# CuPy's NcclError knows statuses up to 6 and raises KeyError(7) / KeyError(8) for the rest.
NCCL_STATUS = {1: "unhandled cuda error", 2: "system error", 3: "internal error",
               4: "invalid argument", 5: "invalid usage", 6: "remote error",
               7: "in progress", 8: "timeout"}
ABORTED = "the communicator is aborted (make a new one); NCCL_DEBUG=WARN shows NCCL's own log"


def broadcast_unique_id(connector: MPIConnector) -> Any:
    """Return an NCCL unique id made on rank 0, identical on every rank. Collective.

    The id is passed through as NCCL made it (bytes in CuPy 14, a tuple in CuPy 13). A failure
    on rank 0 is broadcast too, so every rank raises instead of waiting.

    Raises:
        RuntimeError: on every rank, when rank 0 could not create the id.
    """
    reply = None
    if connector.is_root:
        try:
            from cupy.cuda import nccl

            reply = ("ok", nccl.get_unique_id())
        except Exception as error:
            reply = ("error", _describe(error))
    status, value = connector.broadcast(reply)
    if status != "ok":
        raise RuntimeError(f"NcclCommunicator: rank 0 could not create the NCCL unique id: "
                           f"{value}; run with NCCL_DEBUG=WARN for details, or use backend: mpi")
    return value


def _agree(connector: MPIConnector, api: str, problem: str | None) -> None:
    """Raise RuntimeError on every rank when any rank has a problem. Collective."""
    message = ranks_problem(api, connector.allgather(problem))
    if message is not None:
        raise RuntimeError(message)


def _describe(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args and isinstance(error.args[0], int):
        status = error.args[0]
        return f"NCCL status {status} ({NCCL_STATUS.get(status, 'unknown')})"
    return f"{type(error).__name__}: {error}"


class NcclCommunicator(Communicator):
    """Communicator on CuPy arrays through NCCL. See ``Communicator`` for every collective.

    Streams (``comm.streams``): the communicator owns a non-blocking CUDA stream. A call made
    on the caller's current stream S runs after everything enqueued on S before the call (an
    event), all its device work (packing a list, NCCL, averaging, unpacking) goes on the
    communicator's stream, and S waits for it when the caller takes the result: the return of
    a blocking call, or ``Handle.wait()``. The host does not wait for NCCL, except in
    ``barrier`` and ``close``: a collective returns once enqueued, so compute and communication
    overlap. Arrays stay referenced until their work has finished: CuPy's memory pool is per
    stream and would hand a freed block to another allocation while NCCL still reads it.

    Hangs and errors: NCCL has no timeouts. With ``stall_timeout`` (the default) the
    communicator's watchdog also watches its unfinished NCCL work and polls NCCL for
    asynchronous errors; work older than the timeout, or an error, prints what waited and
    every thread's stack, aborts the NCCL communicator and ends the job (MPI_Abort). The
    communicator's creation (ncclCommInitRank waits for every rank) is watched the same way.

    Each rank uses GPU ``local_rank % gpu_count()`` (respecting CUDA_VISIBLE_DEVICES), whichever
    device is current when a call is made or its result taken. Ranks may share a GPU only with
    NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (experimental). ``send`` and ``recv`` run in
    order with the collectives (NCCL takes one thread at a time per communicator): a blocking
    one waits for the asynchronous collectives started before it.

    Args:
        connector: the MPI world; carries the unique id and the collective checks.
        stream: the CuPy stream NCCL runs on; None creates a non-blocking one.
        **kwargs: ``check`` and ``stall_timeout``, see ``Communicator``.

    Raises:
        UsageError: on every rank, before any NCCL call, when some rank cannot run NCCL (no
            cupy, no GPU, two ranks on one GPU: the environment's to mend); the message names
            those ranks and what is missing.
    """

    backend_name = "nccl"

    def __init__(self, connector: MPIConnector, *, stream: Any = None, **kwargs: Any) -> None:
        self.device, problems = gpu_survey(connector)
        message = ranks_problem("make_communicator('nccl')", problems)
        if message is not None:
            raise UsageError(message)
        import cupy
        from cupy.cuda import nccl

        uid = broadcast_unique_id(connector)
        comm, problem = None, None
        timeout = resolve_stall_timeout(kwargs.get("stall_timeout", DEFAULT_STALL_TIMEOUT_S))
        init_watch = StallWatchdog(connector.rank, connector.size, timeout) if timeout else None
        try:
            if init_watch is not None:
                init_watch.enter("NCCL communicator creation (ncclCommInitRank)",
                                 collective=False)
            comm = nccl.NcclCommunicator(connector.size, uid, connector.rank)
        except Exception as error:
            problem = f"ncclCommInitRank failed: {_describe(error)}"
        finally:
            if init_watch is not None:
                init_watch.stop()
        try:
            _agree(connector, "NcclCommunicator", problem)
            super().__init__(connector, **kwargs)
        except BaseException:
            if comm is not None:
                comm.abort()
            raise
        self._cupy, self._nccl, self._comm = cupy, nccl, comm
        self.version = nccl_version() or (0, 0, 0)
        new = self.version >= AVG_AND_BF16_VERSION
        # keyed by the dtype itself: dtype.name is Python code in numpy (about 3.4 us a call on
        # an H200's host, several calls per collective), a dict lookup by dtype is not
        self._dtypes = {dtype: getattr(nccl, NCCL_DTYPE_NAMES[dtype.name],
                                       NCCL_H[NCCL_DTYPE_NAMES[dtype.name]])
                        for dtype in DTYPES if dtype.name != "bfloat16" or new}
        self._ops = {name: getattr(nccl, code, NCCL_H[code])
                     for name, code in NCCL_OP_NAMES.items()}
        if not new or self.size == 1:  # no ncclAvg (a sum the base divides), or one rank
            self._ops["avg"] = self._ops["sum"]
        self._stream = cupy.cuda.Stream(non_blocking=True) if stream is None else stream
        self.stream.streams[self.device] = self._stream  # calls run there (comm.streams)
        self._token = cupy.zeros(1, cupy.float32)  # barrier's one-element allreduce
        # (done event, arrays it uses, operation, its sequence number (None: point to point),
        # when it was enqueued), oldest first
        self._in_flight: deque[tuple[Any, tuple[Any, ...], str, int | None, float]] = deque()
        self._aborted = self._closing = False
        # The watchdog's probe queries NCCL from its own thread: it holds this lock, and close and
        # abort take it to mark the communicator gone, so that it never queries one being freed;
        # the first to mark it frees it (the watchdog's abort, on its hooks' thread, may come
        # while close waits or destroys: ncclCommAbort and ncclCommDestroy both free it)
        self._probe_lock = threading.Lock()
        self._probe_thread: int | None = None  # the thread _oldest_unfinished made GPU current on
        watchdog = self._threads.watchdog
        if watchdog is not None:
            watchdog.probes.append(self._oldest_unfinished)
            watchdog.before_abort.append(self._abort)

    # ---------------------------------------------------------------- primitives

    def _allreduce(self, send: Any, recv: Any, op: str) -> None:
        self._launch("allreduce", (send, recv), send.size, lambda s: self._comm.allReduce(
            send.data.ptr, recv.data.ptr, send.size, self._dt(send), self._ops[op], s))

    def _reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        self._launch("reduce_scatter", (send, recv), recv.size, lambda s: self._comm.reduceScatter(
            send.data.ptr, recv.data.ptr, recv.size, self._dt(send), self._ops[op], s))

    def _allgather(self, send: Any, recv: Any) -> None:
        self._launch("allgather", (send, recv), send.size, lambda s: self._comm.allGather(
            send.data.ptr, recv.data.ptr, send.size, self._dt(send), s))

    def _broadcast(self, buf: Any, root: int) -> None:
        self._launch("broadcast", (buf,), buf.size, lambda s: self._comm.bcast(
            buf.data.ptr, buf.size, self._dt(buf), root, s))

    def _reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        target = send if recv is None else recv  # NCCL ignores recvbuff off the root
        self._launch("reduce", (send, target), send.size, lambda s: self._comm.reduce(
            send.data.ptr, target.data.ptr, send.size, self._dt(send), self._ops[op], root, s))

    def _send(self, buf: Any, peer: int) -> None:
        self._launch("send", (buf,), buf.size, lambda s: self._grouped(
            lambda: self._comm.send(buf.data.ptr, buf.size, self._dt(buf), peer, s)))

    def _recv(self, buf: Any, peer: int) -> None:
        self._launch("recv", (buf,), buf.size, lambda s: self._grouped(
            lambda: self._comm.recv(buf.data.ptr, buf.size, self._dt(buf), peer, s)))

    def _barrier(self) -> None:
        token = self._token
        done = self._launch("barrier", (token,), 1, lambda s: self._comm.allReduce(
            token.data.ptr, token.data.ptr, 1, self._dt(token), self._ops["sum"], s))
        self._host_wait(done)  # a barrier returns only when every rank has arrived

    def _close_backend(self) -> None:
        if self._comm is None:
            return
        try:
            if not self._aborted:
                # destroy would block on unfinished work; the event belongs to the stream's
                # device, whichever is current
                with self._cupy.cuda.Device(self.device):
                    self._host_wait(mark(self._cupy, self._stream))  # watched: still probed
            with self._probe_lock:  # the watchdog may have aborted it during the wait
                self._closing = not self._aborted
            if self._closing:
                self._comm.destroy()
        except Exception as error:
            self._abort()
            raise RuntimeError(f"close: NCCL communicator of rank {self.rank} failed to shut "
                               f"down: {_describe(error)}; it was aborted") from error
        finally:
            self._comm = None
            self._in_flight.clear()

    def _average(self, flat: Any, op: str) -> None:
        """Divide by size where avg ran as a sum (NCCL before 2.10; one rank needs no division)."""
        if self._ops["avg"] == self._ops["sum"]:
            super()._average(flat, op)

    # ---------------------------------------------------------------- checks, streams, watchdog

    def _check_arrays(self, api: str, arrays: list[Any]) -> None:
        for a in arrays:
            if not is_cupy_array(a):
                raise TypeError(
                    f"{api}: nccl backend moves CuPy arrays; got {type(a).__module__}."
                    f"{type(a).__qualname__}; use backend 'mpi' for host arrays or "
                    "cupy.asarray(x)")
            if a.device.id != self.device:
                raise ValueError(
                    f"{api}: array is on GPU {a.device.id} (rank {self.rank}); expected GPU "
                    f"{self.device}, this rank's (local_rank % gpu_count()); allocate it under "
                    f"cupy.cuda.Device({self.device})")
            if a.dtype not in self._dtypes:
                raise TypeError(
                    f"{api}: {a.dtype.name} needs NCCL >= 2.10; got NCCL "
                    f"{'.'.join(map(str, self.version))}; install a newer nvidia-nccl wheel, "
                    "or use backend: mpi")

    def _async_p2p_problem(self) -> str | None:
        return ("the nccl backend has no independent point-to-point operations (one NCCL "
                "communicator must not be driven from several threads)")

    def _worker_started(self) -> None:
        self._cupy.cuda.Device(self.device).use()  # the async thread's own current device

    def _grouped(self, call: Callable[[], None]) -> None:
        self._nccl.groupStart()
        try:
            call()
        finally:
            self._nccl.groupEnd()

    def _launch(self, api: str, arrays: tuple[Any, ...], count: int,
                enqueue: Callable[[int], None]) -> Any:
        """Enqueue one NCCL call on this communicator's stream; return its done event."""
        if self._aborted or self._comm is None:
            raise RuntimeError(f"{api}: the NCCL communicator of rank {self.rank} was aborted "
                               "after an earlier failure; create a new communicator")
        self._check_arrays(api, list(arrays))  # the buffers a plan made, too
        if count == 0:
            return None
        with self._cupy.cuda.Device(self.device):
            current = self._cupy.cuda.get_current_stream()
            if current.ptr != self._stream.ptr:  # called outside _stream_for (barrier, close)
                self._stream.wait_event(mark(self._cupy, current))
            try:
                enqueue(self._stream.ptr)
            except Exception as error:
                self._abort()
                raise RuntimeError(f"nccl {api} failed on rank {self.rank}: {_describe(error)}; "
                                   f"{ABORTED}") from error
            done = mark(self._cupy, self._stream)
        while self._in_flight and self._in_flight[0][0].done:
            self._in_flight.popleft()
        watchdog = self._threads.watchdog
        seq = watchdog.seq if watchdog is not None and api not in ("send", "recv") else None
        self._in_flight.append((done, arrays, api, seq, time.monotonic()))
        return done

    def _host_wait(self, done: Any) -> None:
        """Wait on the host for ``done`` (the watchdog, if any, ends a stall).

        Without a watchdog this wait polls NCCL's asynchronous error itself: an operation hit
        by one "will usually not progress and never complete", and "when waiting for NCCL
        operations to complete, applications should call ncclCommGetAsyncError and destroy
        the communicator when an error happens" (NCCL user guide, usage/communicators.html).

        Raises:
            RuntimeError: NCCL reported an asynchronous error (the communicator is aborted).
        """
        if done is None:
            return
        pause, polls = 1e-5, self._threads.watchdog is None
        while not done.done:
            if polls:
                try:
                    self._comm.check_async_error()
                except Exception as error:  # NcclError, or KeyError for statuses CuPy lacks
                    self._abort()
                    raise RuntimeError(f"NCCL reported an error on rank {self.rank}: "
                                       f"{_describe(error)}; {ABORTED}") from error
            time.sleep(pause)  # a host core spinning here would slow the peers sharing it
            pause = min(2 * pause, 1e-3)

    def _oldest_unfinished(self) -> tuple[str, int | None, float, Any] | None:
        """The watchdog's probe: NCCL's asynchronous error, else the oldest unfinished call.

        Runs on the watchdog's thread, which makes this rank's GPU current first: a thread
        with no device set that queries an event gets device 0's primary context (CUDA
        runtime API, "Interactions with the CUDA Driver API"), hundreds of MiB of GPU 0 for
        every rank of a node (torchcomms PR #777). ``use()``, not ``with``: leaving the block
        would set device 0 again, and cudaSetDevice initializes its context too.
        """
        with self._probe_lock:  # close() may be destroying it on another thread (see __init__)
            if self._comm is None or self._aborted or self._closing:
                return None
            if self._probe_thread != threading.get_ident():
                self._cupy.cuda.Device(self.device).use()
                self._probe_thread = threading.get_ident()
            try:
                self._comm.check_async_error()
            except Exception as error:  # NcclError, or KeyError for statuses CuPy cannot name
                raise RuntimeError(f"NCCL reported an error on rank {self.rank}: "
                                   f"{_describe(error)}; NCCL_DEBUG=WARN shows NCCL's own log"
                                   ) from error
        for done, arrays, api, seq, start in list(self._in_flight):
            if not done.done:
                return f"nccl {api}", seq, start, list(arrays[:1])
        return None

    def _abort(self) -> None:
        with self._probe_lock:
            comm = None if self._aborted or self._closing else self._comm
            self._aborted = True
        if comm is not None:
            try:
                comm.abort()
            except Exception:  # already failing: the error being raised is the one to report
                pass

    def _dt(self, arr: Any) -> int:
        return self._dtypes[arr.dtype]
