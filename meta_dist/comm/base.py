"""Communicator: the one interface for moving array data, shared by the MPI and NCCL backends.

Imports numpy and meta_dist.connector / xp / comm.consistency / comm.worker. This module owns,
once for every backend: the docstring of each collective, argument checks with identical
messages, and fusion of a list of arrays into one buffer; ``consistency`` compares the ranks'
calls (and bounds the wait for them) and ``worker`` runs the ``*_async`` variants in order. A
backend implements only the ``_allreduce``-style primitives on flat, contiguous 1-D buffers.
"""

from __future__ import annotations

import functools
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from meta_dist.comm.consistency import ConsistencyCheck, StallWatchdog, shape_code
from meta_dist.comm.worker import Handle, OrderedWorker
from meta_dist.connector import MPIConnector
from meta_dist.xp import array_module, data_ptr

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
SCATTER_OPS = ("sum", "avg")
DTYPES = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int32", "int64", "uint8"))
_DTYPE_SET = frozenset(DTYPES)
# (op, dtype) pairs a reduction accepts: "avg" needs a floating dtype
_REDUCIBLE = frozenset((op, d) for op in REDUCE_OPS for d in DTYPES if op != "avg" or d.kind == "f")
_SCATTERABLE = frozenset(pair for pair in _REDUCIBLE if pair[0] in SCATTER_OPS)
_MOVABLE = frozenset(("", d) for d in DTYPES)  # operations without an op: any dtype
_OP_CODES = {op: i for i, op in enumerate((*REDUCE_OPS, ""))}
_Plan = Callable[..., Callable[[], Any]]
DEFAULT_STALL_TIMEOUT_S = 300.0


def _refused_everywhere(api: str) -> Callable[[_Plan], _Plan]:
    """Make a collective's plan method tell the peers when it refuses this rank's arguments.

    The arguments are checked on each rank before the cross-rank check; a bad one on some ranks
    only (a read-only ``out`` here, say) would leave the others waiting in the check. With this,
    they raise there at once, naming the refusal (see ``ConsistencyCheck.refuse``).
    """
    def wrap(make_plan: _Plan) -> _Plan:
        @functools.wraps(make_plan)
        def planned(self: Communicator, *args: Any) -> Callable[[], Any]:
            try:
                return make_plan(self, *args)
            except Exception as error:  # anything refused before the check (AttributeError too)
                self._tell_peers(api, error)
                raise

        return planned

    return wrap


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in ("0", "false", "no", "")


class Communicator(ABC):
    """Collectives on arrays among the ranks of a connector, with one of two backends.

    Every collective takes one array or a list of arrays. A list is fused: packed into one
    reused buffer, moved with one collective, and split back, so many small arrays cost about
    one large call. An in-place allreduce of a host list packs nothing when the arrays lie back
    to back in one buffer (``meta_dist.contiguous_arrays``), and moves large lists straight
    between the arrays (the MPI backend; see ``comm/mpi_lists.py``). Lists must share one
    dtype. Inputs may be non-contiguous (they are copied); an ``out`` buffer must be contiguous
    and writeable. ``out`` may be the input itself, which makes the operation in place.
    Supported dtypes: float16, float32, float64, int32, int64, uint8. Reduction ops: "sum",
    "avg" (floating dtypes only: the sum divided by size once), "max", "min", "prod".

    Before each collective the ranks compare a fingerprint of (operation, op, root, dtype,
    shapes) with one small allreduce on the host; a difference raises ValueError on every rank
    naming each rank's arrays, instead of a hang or garbage. Set META_DIST_CHECK=0 or pass
    ``check=False`` to skip it. A watchdog thread ends the job (every thread's stack printed,
    then MPI_Abort) when a collective has waited longer than ``stall_timeout`` seconds, so a
    rank that took another path never leaves the job hanging silently.

    The ``*_async`` variants return a Handle at once; the operations run in order on one
    communication thread. Do not touch their arrays until ``wait()`` returns.

    Args:
        connector: the MPI world these ranks belong to.
        check: compare shapes and dtypes across ranks before each collective.
        stall_timeout: seconds a collective may wait for its peers before the job is aborted
            (None: no watchdog).
    """

    backend_name = "base"

    def __init__(
        self,
        connector: MPIConnector,
        *,
        check: bool | None = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self.connector = connector
        self.rank = connector.rank
        self.size = connector.size
        self.check = _env_flag("META_DIST_CHECK", True) if check is None else check
        self.stall_timeout = stall_timeout
        self._thread_level = MPI.Query_thread()  # async calls need THREAD_MULTIPLE
        self._agree({"check": self.check, "thread_level": self._thread_level,
                     **self._call_settings()})
        self._check_comm = connector.comm.Dup()
        self._consistency = ConsistencyCheck(self._check_comm)
        self._watchdog = StallWatchdog(self.rank, stall_timeout) if stall_timeout else None
        self._fusion: dict[tuple[Any, np.dtype], Any] = {}
        self._worker = OrderedWorker(on_start=self._worker_started)
        self._p2p: dict[tuple[str, int], OrderedWorker] = {}  # (send|recv, peer) -> its thread
        self.closed = False

    # ---------------------------------------------------------------- public collectives

    def allreduce(self, send: Any, op: str = "sum", *, out: Any = None) -> Any:
        """Reduce arrays element-wise across ranks; every rank gets the result.

        Collective: every rank must call this, in the same order, with the same shapes and dtype.

        Args:
            send: an array, or a list of arrays of one dtype (fused into one collective).
            op: "sum", "avg", "max", "min" or "prod".
            out: where to write the result (same shapes); ``out=send`` reduces in place.
                None allocates new arrays.

        Returns:
            The reduced array (or list of arrays), which is ``out`` when given.
        """
        if out is send and self._host_ready(send, op, _REDUCIBLE) and send.flags.writeable:
            flat = flat_view(send)
            self._run_host("allreduce", send, op, -1, self._allreduce, flat, flat, op)
            self._average((send,), op)
            return send
        return self._sync(self._allreduce_plan(send, op, out), "allreduce")

    def allreduce_async(self, send: Any, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``allreduce`` and return a Handle; see ``allreduce``. Collective."""
        return self._start("allreduce", self._allreduce_plan, send, op, out)

    def reduce_scatter(self, send: Any, op: str = "sum", *, out: Any = None) -> Any:
        """Reduce arrays across ranks and leave each rank its part along axis 0.

        Rank r gets rows ``[r*m, (r+1)*m)`` of the reduced array, where ``m = len(send) // size``.
        The length along axis 0 must divide by size: pad it (``meta_dist.zero.partition``
        has ``padded_size``) or use allreduce. Collective: every rank must call this, in the
        same order, with the same shapes and dtype.

        Args:
            send: an array of shape (size*m, ...), or a list of such arrays of one dtype.
            op: "sum" or "avg".
            out: arrays of shape (m, ...) for the result; the matching rows of ``send``
                make it in place (``out=send[rank*m:(rank+1)*m]``). None allocates.

        Returns:
            This rank's part (or a list of parts).
        """
        if (type(out) is np.ndarray and self._host_ready(send, op, _SCATTERABLE) and send.ndim
                and not send.shape[0] % self.size and self._host_out(out, send, _scatter_shape)
                and not self._scatter_overlap(send, out)):
            self._run_host("reduce_scatter", send, op, -1, self._reduce_scatter, flat_view(send),
                           flat_view(out), op)
            self._average((out,), op)
            return out
        return self._sync(self._reduce_scatter_plan(send, op, out), "reduce_scatter")

    def reduce_scatter_async(self, send: Any, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``reduce_scatter`` and return a Handle; see ``reduce_scatter``. Collective."""
        return self._start("reduce_scatter", self._reduce_scatter_plan, send, op, out)

    def allgather(self, send: Any, *, out: Any = None) -> Any:
        """Concatenate every rank's array along axis 0, in rank order, on every rank.

        Collective: every rank must call this, in the same order, with the same shapes and dtype.

        Args:
            send: an array of shape (m, ...), or a list of arrays of one dtype.
            out: arrays of shape (size*m, ...); if ``send`` is ``out[rank*m:(rank+1)*m]``
                the gather is in place. None allocates.

        Returns:
            The gathered array (or list of arrays).
        """
        if (type(out) is np.ndarray and self._host_ready(send, "", _MOVABLE) and send.ndim
                and self._host_out(out, send, _gather_shape)):
            self._run_host("allgather", send, "", -1, self._allgather, flat_view(send),
                           flat_view(out))
            return out
        return self._sync(self._allgather_plan(send, out), "allgather")

    def allgather_async(self, send: Any, *, out: Any = None) -> Handle:
        """Start ``allgather`` and return a Handle; see ``allgather``. Collective."""
        return self._start("allgather", self._allgather_plan, send, out)

    def broadcast(self, buf: Any, root: int = 0, *, out: Any = None) -> Any:
        """Copy rank ``root``'s array to every rank.

        Collective: every rank must call this, in the same order, with the same shapes and dtype
        (on non-root ranks ``buf`` gives the shape and dtype; its values are ignored).

        Args:
            buf: an array or a list of arrays of one dtype.
            root: the rank whose values are sent.
            out: where to write the result; ``out=buf`` broadcasts in place. None allocates.

        Returns:
            Root's array (or list), which is ``out`` when given.
        """
        if (out is buf and self._host_ready(buf, "", _MOVABLE) and buf.flags.writeable
                and self._rank_ok(root)):
            self._run_host("broadcast", buf, "", root, self._broadcast, flat_view(buf), root)
            return buf
        return self._sync(self._broadcast_plan(buf, root, out), "broadcast")

    def broadcast_async(self, buf: Any, root: int = 0, *, out: Any = None) -> Handle:
        """Start ``broadcast`` and return a Handle; see ``broadcast``. Collective."""
        return self._start("broadcast", self._broadcast_plan, buf, root, out)

    def reduce(self, send: Any, root: int = 0, op: str = "sum", *, out: Any = None) -> Any:
        """Reduce arrays element-wise across ranks onto rank ``root`` only.

        Collective: every rank must call this, in the same order, with the same shapes and dtype.

        Args:
            send: an array, or a list of arrays of one dtype.
            root: the rank that receives the result.
            op: "sum", "avg", "max", "min" or "prod".
            out: where root writes the result (ignored elsewhere); ``out=send`` is in place.

        Returns:
            The reduced array (or list) on root; None on every other rank.
        """
        return self._sync(self._reduce_plan(send, root, op, out), "reduce")

    def reduce_async(self, send: Any, root: int = 0, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``reduce`` and return a Handle; see ``reduce``. Collective."""
        return self._start("reduce", self._reduce_plan, send, root, op, out)

    def send(self, send: Any, peer: int) -> None:
        """Send an array (or a fused list) to rank ``peer``, which must call ``recv``.

        Blocks until the data is handed to the library; the matching ``recv`` must use the same
        shapes and dtype, or it raises ValueError after receiving the message (nothing is lost).
        """
        self._p2p_sync(self._send_plan(send, peer), "send", peer)

    def recv(self, out: Any, peer: int) -> Any:
        """Receive into ``out`` (an array or list of arrays) what rank ``peer`` sends; return it."""
        return self._p2p_sync(self._recv_plan(out, peer), "recv", peer)

    def send_async(self, send: Any, peer: int) -> Handle:
        """Start ``send`` and return a Handle at once; see ``send``.

        Point-to-point operations are not queued behind the collectives: sends to each peer run
        in order on a thread of their own, and receives from each peer on another, as
        MPI_Isend/MPI_Irecv would, so two ranks may each start a send to the other and then
        receive without deadlocking. Do not touch ``send`` until ``wait()`` returns.
        """
        return self._p2p_submit(self._send_plan(send, peer), "send", peer, send)

    def recv_async(self, out: Any, peer: int) -> Handle:
        """Start ``recv`` into ``out`` and return a Handle whose ``wait()`` returns it."""
        return self._p2p_submit(self._recv_plan(out, peer), "recv", peer, out)

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier. Collective."""
        self._sync(self._barrier, "barrier")

    def close(self) -> None:
        """Finish pending asynchronous work and release buffers; later calls raise RuntimeError."""
        if self.closed:
            return
        self._worker.close()
        for worker in self._p2p.values():
            worker.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        self._fusion.clear()
        try:
            self._close_backend()
        finally:  # whatever the backend did, this communicator is done
            self._consistency.close()
            self._check_comm.Free()
            self._check_comm = None
            self.closed = True

    def _call_settings(self) -> dict[str, Any]:
        """Return the backend's settings that decide which library calls a collective makes."""
        return {}

    def _agree(self, settings: dict[str, Any]) -> None:
        """Raise ValueError on every rank unless every rank has these settings. Collective.

        Each one decides which calls a collective makes (the check's extra allreduce, where the
        pairwise exchange starts): a rank with other values would leave its peers waiting.
        """
        if self.size == 1:
            return
        every = self.connector.allgather(settings)
        differ = [k for k in settings if any(s[k] != settings[k] for s in every)]
        if differ:
            listing = "; ".join(
                f"rank {r}: " + ", ".join(f"{k}={s[k]!r}" for k in differ)
                for r, s in enumerate(every))
            raise ValueError(
                f"{type(self).__name__}: settings differ across ranks: {listing}; expected the "
                "same values on every rank (set META_DIST_CHECK, mpi4py.rc.thread_level and the "
                "communicator's arguments alike everywhere)"
            )

    # ---------------------------------------------------------- plans (validate now, run later)

    @_refused_everywhere("allreduce")
    def _allreduce_plan(self, send: Any, op: str, out: Any) -> Callable[[], Any]:
        sends, is_list = self._inputs("allreduce", send)
        self._check_op("allreduce", op, REDUCE_OPS, sends[0].dtype)
        outs = self._outputs("allreduce", out, None, sends, is_list)

        def run() -> Any:
            self._fingerprint("allreduce", sends, op=op)
            if len(sends) == 1:  # [x] is the call x: the same library calls on every rank
                self._allreduce(*_flat_pair(sends[0], outs[0]), op)
            else:
                self._allreduce_list(sends, outs, op)
            self._average(outs, op)
            return outs if is_list else outs[0]

        return run

    @_refused_everywhere("reduce_scatter")
    def _reduce_scatter_plan(self, send: Any, op: str, out: Any) -> Callable[[], Any]:
        sends, is_list = self._inputs("reduce_scatter", send)
        self._check_op("reduce_scatter", op, SCATTER_OPS, sends[0].dtype)
        for s in sends:
            if s.ndim == 0 or s.shape[0] % self.size:
                rows = s.shape[0] if s.ndim else "no axis 0"
                raise ValueError(
                    f"reduce_scatter: send has {rows} rows along axis 0 (shape {s.shape}), "
                    f"size is {self.size}; expected a multiple of {self.size}; pad axis 0 "
                    "(meta_dist.zero.partition.padded_size) or use allreduce"
                )
        shapes = [_scatter_shape(s.shape, self.size) for s in sends]
        outs = self._outputs("reduce_scatter", out, shapes, sends, is_list)
        if not is_list:
            self._check_scatter_alias(sends[0], outs[0])

        def run() -> Any:
            self._fingerprint("reduce_scatter", sends, op=op)
            if not is_list:
                self._reduce_scatter(flat_view(sends[0]), flat_view(outs[0]), op)
            else:
                # rank-major packing: rank r's segment holds row block r of every array
                parts = [s.reshape(self.size, -1) for s in sends]
                buf = self._pack([p[r] for r in range(self.size) for p in parts], "reduce_scatter")
                seg = buf.size // self.size
                mine = buf[self.rank * seg : (self.rank + 1) * seg]
                self._reduce_scatter(buf, mine, op)
                unpack(mine, outs)
            self._average(outs, op)
            return outs if is_list else outs[0]

        return run

    @_refused_everywhere("allgather")
    def _allgather_plan(self, send: Any, out: Any) -> Callable[[], Any]:
        sends, is_list = self._inputs("allgather", send)
        for s in sends:
            if s.ndim == 0:
                raise ValueError("allgather: send is 0-d; expected an array with axis 0")
        shapes = [_gather_shape(s.shape, self.size) for s in sends]
        outs = self._outputs("allgather", out, shapes, sends, is_list)

        def run() -> Any:
            self._fingerprint("allgather", sends)
            if not is_list:
                self._allgather(flat_view(sends[0]), flat_view(outs[0]))
                return outs[0]
            seg = sum(s.size for s in sends)
            buf = self._fusion_buffer(sends[0], seg * self.size, "allgather")
            mine = buf[self.rank * seg : (self.rank + 1) * seg]
            self._pack(sends, "allgather", into=mine)
            self._allgather(mine, buf)
            by_rank = buf.reshape(self.size, seg)
            start = 0
            for o, s in zip(outs, sends, strict=True):
                o.reshape(self.size, -1)[...] = by_rank[:, start : start + s.size]
                start += s.size
            return outs

        return run

    @_refused_everywhere("broadcast")
    def _broadcast_plan(self, buf: Any, root: int, out: Any) -> Callable[[], Any]:
        bufs, is_list = self._inputs("broadcast", buf)
        self._check_rank("broadcast", "root", root)
        outs = self._outputs("broadcast", out, None, bufs, is_list)

        def run() -> Any:
            self._fingerprint("broadcast", bufs, root=root)
            if not is_list:
                if outs[0] is not bufs[0] and self.rank == root:
                    outs[0][...] = bufs[0]
                self._broadcast(flat_view(outs[0]), root)
            else:
                fused = self._pack(bufs, "broadcast")
                self._broadcast(fused, root)
                unpack(fused, outs)
            return outs if is_list else outs[0]

        return run

    @_refused_everywhere("reduce")
    def _reduce_plan(self, send: Any, root: int, op: str, out: Any) -> Callable[[], Any]:
        sends, is_list = self._inputs("reduce", send)
        self._check_rank("reduce", "root", root)
        self._check_op("reduce", op, REDUCE_OPS, sends[0].dtype)
        is_root = self.rank == root
        outs = self._outputs("reduce", out if is_root else None, None, sends,
                             is_list) if is_root else None

        def run() -> Any:
            self._fingerprint("reduce", sends, op=op, root=root)
            if not is_list:
                self._reduce(*(_flat_pair(sends[0], outs[0]) if is_root else
                               (flat_view(sends[0]), None)), op, root)
            else:
                buf = self._pack(sends, "reduce")
                self._reduce(buf, buf if is_root else None, op, root)
                if is_root:
                    unpack(buf, outs)
            if not is_root:
                return None
            self._average(outs, op)
            return outs if is_list else outs[0]

        return run

    def _send_plan(self, send: Any, peer: int) -> Callable[[], None]:
        sends, is_list = self._inputs("send", send)
        self._check_rank("send", "peer", peer)

        def run() -> None:
            if self.check:
                header = np.array([DTYPES.index(sends[0].dtype), sum(s.size for s in sends),
                                   shape_code([s.shape for s in sends])], np.int64)
                self._check_comm.Send(header, dest=peer)
            if not is_list:
                self._send(flat_view(sends[0]), peer)
            else:  # its own buffer: a send may run beside a collective on another thread
                total = sum(s.size for s in sends)
                self._send(self._pack(sends, "send", into=array_module(sends[0]).empty(
                    total, sends[0].dtype)), peer)

        return run

    def _recv_plan(self, out: Any, peer: int) -> Callable[[], Any]:
        outs, is_list = self._inputs("recv", out)
        self._check_rank("recv", "peer", peer)
        for o in outs:
            self._check_writable("recv", o)
        total = sum(o.size for o in outs)

        def run() -> Any:
            if self.check:
                header = np.empty(3, np.int64)
                self._check_comm.Recv(header, source=peer)
                sent_dtype = DTYPES[int(header[0])]
                if (sent_dtype, int(header[1]), int(header[2])) != (
                        outs[0].dtype, total, shape_code([o.shape for o in outs])):
                    xp = array_module(outs[0])
                    self._recv(xp.empty(int(header[1]), sent_dtype), peer)  # drain: lose nothing
                    raise ValueError(
                        f"recv: rank {peer} sent {int(header[1])} elements of {sent_dtype} "
                        f"with other shapes; this rank ({self.rank}) expected {total} elements "
                        f"of {outs[0].dtype} shaped {[o.shape for o in outs]}; send and recv "
                        "must use the same shapes and dtype"
                    )
            if not is_list:
                self._recv(flat_view(outs[0]), peer)
            else:
                buf = array_module(outs[0]).empty(total, outs[0].dtype)  # not the shared one
                self._recv(buf, peer)
                unpack(buf, outs)
            return outs if is_list else outs[0]

        return run

    # ---------------------------------------------------------------- shared checks

    def _live(self, api: str) -> None:
        if self.closed:
            raise RuntimeError(
                f"{api} called after close(); create a new communicator "
                "(meta_dist.init() or meta_dist.make_communicator) first"
            )

    def _inputs(self, api: str, arrays: Any) -> tuple[list[Any], bool]:
        self._live(api)
        if (type(arrays) is np.ndarray and arrays.dtype in _DTYPE_SET
                and arrays.flags.c_contiguous):  # the common case, checked in ~0.5 µs
            self._check_arrays(api, [arrays])
            return [arrays], False
        is_list = isinstance(arrays, (list, tuple))
        items = list(arrays) if is_list else [arrays]
        if not items:
            raise ValueError(f"{api}: got an empty list; expected at least one array")
        first = type(items[0])
        if first is np.ndarray and items[0].dtype in _DTYPE_SET:  # one pass for a clean list
            dtype = items[0].dtype
            if all(type(a) is first and (a.dtype is dtype or a.dtype == dtype)
                   and a.flags.c_contiguous for a in items):
                self._check_arrays(api, items)
                return items, is_list
        for i, a in enumerate(items):
            if not hasattr(a, "dtype") or not hasattr(a, "shape"):
                where = f" (item {i})" if is_list else ""
                raise TypeError(f"{api}: expected a numpy or cupy array{where}; got {type(a)}")
            if a.dtype not in _DTYPE_SET:
                raise TypeError(
                    f"{api}: unsupported dtype; got {a.dtype}, expected one of "
                    f"{', '.join(str(d) for d in DTYPES)}"
                )
            if a.dtype != items[0].dtype:
                raise TypeError(
                    f"{api}: a fused list must share one dtype; got {items[0].dtype} (item 0) and "
                    f"{a.dtype} (item {i}); convert them or call once per dtype"
                )
        self._check_arrays(api, items)
        xp = array_module(items[0])
        return [a if a.flags.c_contiguous else xp.ascontiguousarray(a) for a in items], is_list

    def _check_arrays(self, api: str, arrays: list[Any]) -> None:  # noqa: B027 (optional hook)
        """Let a backend refuse arrays it cannot move (e.g. host arrays on NCCL)."""

    def _outputs(self, api: str, out: Any, shapes: list[tuple[int, ...]] | None,
                 like: list[Any], is_list: bool) -> list[Any]:
        """Check or allocate the output arrays; ``shapes`` None means the inputs' shapes."""
        if out is None:
            if shapes is None:
                shapes = [a.shape for a in like]
            xp = array_module(like[0])
            return [xp.empty(shape, like[0].dtype) for shape in shapes]
        if not is_list and type(out) is np.ndarray and type(like[0]) is np.ndarray:  # common
            if out is like[0] and shapes is None and out.flags.writeable:
                return [out]  # in place: already checked as an input
            due = like[0].shape if shapes is None else shapes[0]
            if (out.shape == due and out.dtype == like[0].dtype
                    and out.flags.c_contiguous and out.flags.writeable):
                return [out]
        if (shapes is None and _same_arrays(out, like, is_list)
                and all(getattr(o.flags, "writeable", True) for o in out)):
            return list(out)  # a list in place: its arrays were checked as inputs
        if shapes is None:
            shapes = [a.shape for a in like]
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if isinstance(out, (list, tuple)) != is_list or len(outs) != len(shapes):
            raise ValueError(
                f"{api}: out must match the input: {len(shapes)} "
                f"{'arrays in a list' if is_list else 'array'}; got {type(out).__name__} "
                f"of {len(outs)}"
            )
        for i, (o, shape) in enumerate(zip(outs, shapes, strict=True)):
            if not hasattr(o, "shape") or not hasattr(o, "dtype"):
                raise TypeError(f"{api}: out[{i}] is a {type(o).__name__}; expected a numpy or "
                                "cupy array, or out=None")
            if tuple(o.shape) != tuple(shape) or o.dtype != like[0].dtype:
                raise ValueError(
                    f"{api}: out[{i}] has shape {tuple(o.shape)} and dtype {o.dtype}; expected "
                    f"shape {tuple(shape)} and dtype {like[0].dtype}"
                )
            self._check_writable(api, o)
        self._check_arrays(api, outs)  # before the cross-rank check, as for the inputs
        return outs

    def _check_writable(self, api: str, arr: Any) -> None:
        if not arr.flags.c_contiguous:
            raise ValueError(
                f"{api}: output buffer is not contiguous (shape {arr.shape}, strides "
                f"{arr.strides}); expected a C-contiguous array; pass a contiguous copy "
                "and copy it back"
            )
        if not getattr(arr.flags, "writeable", True):
            raise ValueError(
                f"{api}: output buffer is read-only; expected a writeable array; "
                "pass out=None or a writeable copy"
            )

    def _scatter_overlap(self, send: Any, out: Any) -> bool:
        """Return True if ``out`` overlaps ``send`` elsewhere than this rank's rows."""
        if memory_owner(send) is not memory_owner(out):  # separate allocations: ~0.2 µs
            return False
        start, offset = address(send), address(out)
        if offset == start + self.rank * out.nbytes:
            return False  # exactly this rank's rows: in place
        return not (offset + out.nbytes <= start or start + send.nbytes <= offset)

    def _check_scatter_alias(self, send: Any, out: Any) -> None:
        """In place means exactly this rank's rows of ``send``; any other overlap is refused."""
        if self._scatter_overlap(send, out):
            raise ValueError(
                "reduce_scatter: out overlaps send elsewhere than this rank's rows; expected out "
                f"to be send[{self.rank}*m:({self.rank}+1)*m] (in place) or separate memory")

    def _check_op(self, api: str, op: str, allowed: tuple[str, ...], dtype: np.dtype) -> None:
        if op not in allowed:
            raise ValueError(f"{api}: unknown op; got {op!r}, expected one of {', '.join(allowed)}")
        if op == "avg" and dtype.kind != "f":
            raise TypeError(
                f"{api}: op 'avg' needs a floating dtype; got {dtype}; use op='sum' and divide, "
                "or convert to float"
            )

    def _rank_ok(self, value: Any) -> bool:
        return isinstance(value, (int, np.integer)) and 0 <= value < self.size

    def _check_rank(self, api: str, what: str, value: int) -> None:
        if not self._rank_ok(value):
            raise ValueError(
                f"{api}: {what} out of range; got {value}, expected 0 <= {what} < {self.size}"
            )

    # ---------------------------------------------------------------- fusion and averaging

    def _fusion_buffer(self, like: Any, numel: int, api: str) -> Any:
        """Return a reused buffer of ``numel`` elements; fresh ones cost page faults every call."""
        xp = array_module(like)
        key = (xp.__name__, like.dtype)
        buf = self._fusion.get(key)
        if buf is None or buf.size < numel:
            buf = xp.empty(numel, like.dtype)
            self._fusion[key] = buf
        return buf[:numel]

    def _allreduce_list(self, sends: list[Any], outs: list[Any], op: str) -> None:
        """Allreduce a list through the reused fusion buffer (backends may do better)."""
        # a fresh fused result would be first-touched page by page (measured 4x slower)
        buf = self._pack(sends, "allreduce")
        self._allreduce(buf, buf, op)
        unpack(buf, outs)

    def _pack(self, arrays: list[Any], api: str, into: Any = None) -> Any:
        total = sum(a.size for a in arrays)
        buf = self._fusion_buffer(arrays[0], total, api) if into is None else into
        xp = array_module(arrays[0])
        xp.concatenate([flat_view(a) for a in arrays], out=buf)
        return buf

    def _average(self, outs: list[Any], op: str) -> None:
        """Divide sums by size for op "avg": the only place gradients get averaged."""
        if op == "avg" and self.size > 1:
            for o in outs:
                o /= o.dtype.type(self.size)

    def _fingerprint(self, api: str, arrays: list[Any], op: str = "", root: int = -1) -> None:
        """Raise ValueError on every rank if the ranks called different collectives or shapes."""
        if self.size > 1 and self.check:
            self._consistency.verify(api, arrays, DTYPES, _OP_CODES[op], root)

    def _tell_peers(self, api: str, error: Exception) -> None:
        """Meet the peers in the check of ``api``, whose arguments this rank refused.

        They raise there too, instead of waiting for this rank (when the check is on).
        Collective.
        """
        if self.size > 1 and self.check and not self.closed:
            reason = f"{type(error).__name__}: {error}"
            self._sync(lambda: self._consistency.refuse(api, reason), api)

    # ---------------------------------------------------------------- running now or on the worker

    # The fast path: one numpy array that the general plan would accept unchanged goes
    # straight to the primitive (the checks below, then _run_host). Anything else, errors
    # included, takes the general way. It saves about 3 µs a call, most of meta_dist's cost
    # over the library at 4 KiB.

    def _host_ready(self, arr: Any, op: str, allowed: frozenset) -> bool:
        """Return True for a contiguous numpy input whose (op, dtype) is allowed, run now."""
        return (type(arr) is np.ndarray and type(op) is str and (op, arr.dtype) in allowed
                and arr.flags.c_contiguous and not self.closed and self._worker.idle())

    def _host_out(self, out: np.ndarray, send: np.ndarray,
                  shape_of: Callable[[tuple[int, ...], int], tuple[int, ...]]) -> bool:
        """Return True for a writeable, contiguous numpy ``out`` of the shape and dtype due."""
        return (out.dtype == send.dtype and out.shape == shape_of(send.shape, self.size)
                and out.flags.c_contiguous and out.flags.writeable)

    def _run_host(self, api: str, arr: np.ndarray, op: str, root: int,
                  primitive: Callable[..., None], *args: Any) -> None:
        """Run ``primitive(*args)`` now, checked and watched as ``_sync`` would."""
        try:
            self._check_arrays(api, [arr])  # the backend may refuse host arrays (NCCL does)
        except Exception as error:
            self._tell_peers(api, error)
            raise
        watchdog = self._watchdog
        if watchdog is not None:
            watchdog.enter(api)
        try:
            self._fingerprint(api, (arr,), op, root)
            primitive(*args)
        finally:
            if watchdog is not None:
                watchdog.leave()

    def _sync(self, run: Callable[[], Any], api: str = "collective") -> Any:
        if not self._worker.idle():  # queued async work goes first, in order
            return self._submit(run, api).wait()
        watchdog = self._watchdog
        if watchdog is None:
            return run()
        watchdog.enter(api)  # as _watched, without a closure: this is every blocking call
        try:
            return run()
        finally:
            watchdog.leave()

    def _start(self, api: str, make_plan: _Plan, *args: Any) -> Handle:
        """Start an async collective on the communication thread.

        Refused first if MPI forbids threads: then every rank stops here, and none has told its
        peers about refused arguments in a check that they would never reach.
        """
        self._check_threads(api)
        return self._submit(make_plan(*args), api)

    def _submit(self, run: Callable[[], Any], api: str = "collective") -> Handle:
        return self._worker.submit(self._watched(run, api))

    def _check_threads(self, api: str) -> None:
        """Refuse work on a communication thread unless MPI allows calls from any thread."""
        if self._thread_level < MPI.THREAD_MULTIPLE:
            names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                     MPI.THREAD_SERIALIZED: "serialized"}
            raise RuntimeError(
                f"{api}_async: MPI was initialised with thread level "
                f"{names.get(self._thread_level, self._thread_level)!r}, and the async "
                "collectives (and the trainer's overlap_comm) call MPI from a communication "
                "thread, which needs 'multiple'; leave mpi4py.rc.thread_level at its default "
                "('multiple') before MPI starts, or call the blocking collective (overlap_comm: "
                "false in meta_dist_config)")

    def _watched(self, run: Callable[[], Any], api: str) -> Callable[[], Any]:
        """Wrap ``run`` so the stall watchdog sees it (for the communication threads)."""
        watchdog = self._watchdog
        if watchdog is None:
            return run

        def watched() -> Any:
            watchdog.enter(api)
            try:
                return run()
            finally:
                watchdog.leave()

        return watched

    def _p2p_sync(self, run: Callable[[], Any], api: str, peer: int) -> Any:
        """Blocking send/recv: after this peer's queued async ones, else as any call."""
        worker = self._p2p.get((api, peer))
        if worker is not None and not worker.idle():
            return worker.submit(self._watched(run, api)).wait()
        return self._sync(run, api)

    def _p2p_submit(self, run: Callable[[], Any], api: str, peer: int, arrays: Any) -> Handle:
        self._check_threads(api)
        problem = self._async_p2p_problem(arrays)
        if problem is not None:
            raise NotImplementedError(f"{api}_async: {problem}; use the blocking {api} (pair "
                                      "sends and receives in the same order on both ranks)")
        key = (api, peer)
        if key not in self._p2p:
            self._p2p[key] = OrderedWorker(on_start=self._worker_started)
        return self._p2p[key].submit(self._watched(run, api))

    def _async_p2p_problem(self, arrays: Any) -> str | None:
        """Return why this backend cannot run point-to-point asynchronously, or None."""
        return None

    def _worker_started(self) -> None:  # noqa: B027 (optional hook)
        """Called first on the communication thread; backends set per-thread state here."""

    # ---------------------------------------------------------------- backend primitives

    @abstractmethod
    def _allreduce(self, send: Any, recv: Any, op: str) -> None:
        """Reduce flat ``send`` into flat ``recv`` (the same object: in place); "avg" as a sum."""

    @abstractmethod
    def _reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        """Reduce flat ``send`` (size*m) and write this rank's m elements into ``recv``."""

    @abstractmethod
    def _allgather(self, send: Any, recv: Any) -> None:
        """Gather flat ``send`` (m) from every rank into ``recv`` (size*m), in rank order."""

    @abstractmethod
    def _broadcast(self, buf: Any, root: int) -> None:
        """Overwrite flat ``buf`` with root's ``buf``."""

    @abstractmethod
    def _reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        """Reduce flat ``send`` into ``recv`` on root (recv is None elsewhere)."""

    @abstractmethod
    def _send(self, buf: Any, peer: int) -> None:
        """Send flat ``buf`` to ``peer``."""

    @abstractmethod
    def _recv(self, buf: Any, peer: int) -> None:
        """Receive into flat ``buf`` from ``peer``."""

    @abstractmethod
    def _barrier(self) -> None:
        """Block until every rank arrives."""

    def _close_backend(self) -> None:  # noqa: B027 (optional hook)
        """Release backend resources (called once by close())."""


def address(arr: Any) -> int:
    """Return the address of a contiguous array's first element (numpy or CuPy).

    For numpy, MPI.Get_address takes 0.2 µs where ``__array_interface__`` (xp.data_ptr) takes
    2 µs, which matters on the small-message path.
    """
    if type(arr) is np.ndarray:
        return MPI.Get_address(arr)
    return data_ptr(arr)


def _same_arrays(out: Any, like: list[Any], is_list: bool) -> bool:
    """Return True if ``out`` is exactly the input arrays (a list in place)."""
    return (is_list and isinstance(out, (list, tuple)) and len(out) == len(like)
            and all(map(operator.is_, out, like)))


def memory_owner(arr: Any) -> Any:
    """Return the object that owns ``arr``'s memory (numpy and CuPy point views at it).

    That may be no array: ``np.frombuffer`` arrays end at the buffer (a bytearray, a memoryview).
    """
    base = getattr(arr, "base", None)
    while base is not None:
        arr, base = base, getattr(base, "base", None)
    return arr


def _flat_pair(send: Any, out: Any) -> tuple[Any, Any]:
    """Return flat views of send and out; the same object when out is send (in place)."""
    flat = flat_view(send)
    return (flat, flat) if out is send else (flat, flat_view(out))


def flat_view(arr: Any) -> Any:
    """Return a 1-D view of a contiguous array (no copy)."""
    return arr if arr.ndim == 1 else arr.reshape(-1)


def unpack(buf: Any, outs: list[Any]) -> None:
    """Copy a flat buffer into contiguous arrays, one after another (numpy or CuPy)."""
    start = 0
    for o in outs:
        stop = start + o.size
        flat_view(o)[...] = buf[start:stop]
        start = stop


def _scatter_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Return the shape of one rank's part of a reduce_scatter of ``shape``."""
    return (shape[0] // size, *shape[1:])


def _gather_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Return the shape of an allgather of ``shape`` from ``size`` ranks."""
    return (shape[0] * size, *shape[1:])
