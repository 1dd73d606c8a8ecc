"""Communicator: the one interface for moving array data, shared by the MPI and NCCL backends.

Imports numpy, mpi4py (the thread level only) and meta_dist.connector / watchdog / xp /
comm.checks / consistency / plans / streams / worker. Every operation takes one path: a plan
(``comm.plans``) checks its arguments on this rank (``comm.checks``: the same messages for both
backends) and returns what to run; the ranks compare their calls (``comm.consistency``); a list
is fused into one flat buffer; and the backend's primitive moves flat, contiguous 1-D buffers.
A backend implements only the primitives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from meta_dist.comm import plans
from meta_dist.comm.checks import DTYPES
from meta_dist.comm.consistency import ConsistencyCheck, advised, agree_settings
from meta_dist.comm.fusion import Fusion
from meta_dist.comm.streams import CommStream
from meta_dist.comm.worker import CommThreads, Handle
from meta_dist.connector import MPIConnector
from meta_dist.env import env_flag
from meta_dist.lazy_mpi import MPI
from meta_dist.watchdog import DEFAULT_STALL_TIMEOUT_S, resolve_stall_timeout
from meta_dist.xp import data_ptr, is_cupy_array


class Communicator(ABC):
    """Collectives on arrays among the ranks of a connector, with one of two backends.

    Every collective takes one array or a list of arrays of one dtype. A list is fused into one
    collective: reduced in place as one buffer when its arrays lie back to back in one
    (``meta_dist.contiguous_arrays``), otherwise packed into a reused buffer and unpacked. With
    ``out=None`` the results are new arrays (a list's are views of one new buffer); ``out`` may
    be the input itself, which makes the operation in place. Inputs may be non-contiguous (they
    are copied); ``out`` must be contiguous and writeable. Dtypes: float16, float32, float64,
    int32, int64, uint8 (and bfloat16 where ml_dtypes is installed). Reduction ops: "sum",
    "avg" (floating dtypes: the sum divided by size once; float16 divides each rank's values
    before the sum, as ncclAvg does, so it overflows only where the mean would), "max", "min"
    (they skip NaN, as NCCL's do and numpy's fmax: NaN only where every rank has NaN), "prod".

    Before each collective the ranks compare a fingerprint of (operation, op, root, dtype,
    shapes) with one small allreduce on the host; a difference raises ValueError on every rank
    naming each rank's arrays, instead of a hang or garbage. Set META_DIST_CHECK=0 or pass
    ``check=False`` to skip it. A watchdog thread ends the job when a collective has waited
    longer than ``stall_timeout`` seconds, naming the ranks that did not arrive and what they
    were doing (``meta_dist.watchdog``; META_DIST_STALL_TIMEOUT overrides the timeout).

    The ``*_async`` variants return a Handle at once; the operations run in order on one
    communication thread. Do not touch their arrays until ``wait()`` returns.

    Args:
        connector: the MPI world these ranks belong to.
        check: compare shapes and dtypes across ranks before each collective.
        stall_timeout: seconds a collective may wait for its peers before the job is aborted
            (None or 0: no watchdog); META_DIST_STALL_TIMEOUT, if set, wins.
    """

    backend_name = "base"
    stages_device_arrays = False  # the library moves host memory only: CuPy goes via the host

    def __init__(self, connector: MPIConnector, *, check: bool | None = None,
                 stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S) -> None:
        self.connector, self.rank, self.size = connector, connector.rank, connector.size
        if check is None:
            check = env_flag("META_DIST_CHECK", default=True)
        self.check = check
        self.stall_timeout = stall_timeout = resolve_stall_timeout(stall_timeout)
        thread_level = MPI.Query_thread()  # async calls need THREAD_MULTIPLE
        agree_settings(connector, type(self).__name__, {
            "check": check, "thread_level": thread_level, "watchdog": stall_timeout is not None,
            **self._call_settings()})
        self._check_comm = connector.comm.Dup()
        self._consistency = ConsistencyCheck(self._check_comm, every_call=check)
        self._threads = CommThreads(connector, thread_level, stall_timeout, self._worker_started,
                                    p2p_apart=self._async_p2p_problem() is None)
        if self._threads.watchdog is not None:  # it watches the connector's collectives too
            connector.watchdogs.append(self._threads.watchdog)
        self.stream = CommStream()  # where calls on CuPy arrays run (see comm.streams)
        self.fusion = Fusion(self._address, self.stages_device_arrays)
        self.traffic = plans.Traffic(self.size)  # bytes each operation moved; see plans.Traffic
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
        return self._run("allreduce", plans.allreduce, send, op, out)

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
        return self._run("reduce_scatter", plans.reduce_scatter, send, op, out)

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
        return self._run("allgather", plans.allgather, send, out)

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
        return self._run("broadcast", plans.broadcast, buf, root, out)

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
        return self._run("reduce", plans.reduce, send, root, op, out)

    def allreduce_async(self, send: Any, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``allreduce`` and return a Handle; see ``allreduce``. Collective."""
        return self._start("allreduce", plans.allreduce, send, op, out)

    def reduce_scatter_async(self, send: Any, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``reduce_scatter`` and return a Handle; see ``reduce_scatter``. Collective."""
        return self._start("reduce_scatter", plans.reduce_scatter, send, op, out)

    def allgather_async(self, send: Any, *, out: Any = None) -> Handle:
        """Start ``allgather`` and return a Handle; see ``allgather``. Collective."""
        return self._start("allgather", plans.allgather, send, out)

    def broadcast_async(self, buf: Any, root: int = 0, *, out: Any = None) -> Handle:
        """Start ``broadcast`` and return a Handle; see ``broadcast``. Collective."""
        return self._start("broadcast", plans.broadcast, buf, root, out)

    def reduce_async(self, send: Any, root: int = 0, op: str = "sum", *, out: Any = None) -> Handle:
        """Start ``reduce`` and return a Handle; see ``reduce``. Collective."""
        return self._start("reduce", plans.reduce, send, root, op, out)

    def send(self, send: Any, peer: int) -> None:
        """Send an array (or a fused list) to rank ``peer``, which must ``recv`` it.

        Point to point: only this rank and ``peer`` take part. With the check on, a small header
        (dtype, sizes, shapes) goes first so that a mismatched ``recv`` fails clearly.
        """
        self._threads.run(self._p2p(plans.send, send, peer), "send", peer, send)

    def recv(self, out: Any, peer: int) -> Any:
        """Receive into ``out`` (an array or list of arrays) what rank ``peer`` sends; return it."""
        return self._threads.run(self._p2p(plans.recv, out, peer), "recv", peer, out)

    def send_async(self, send: Any, peer: int) -> Handle:
        """Start ``send`` and return a Handle at once; see ``send``.

        Sends to each peer run in order beside the collectives, as MPI_Isend would (see
        ``comm.worker``). Do not touch ``send`` until ``wait()`` returns.
        """
        return self._start_p2p("send", plans.send, send, peer)

    def recv_async(self, out: Any, peer: int) -> Handle:
        """Start ``recv`` into ``out`` and return a Handle whose ``wait()`` returns it."""
        return self._start_p2p("recv", plans.recv, out, peer)

    def barrier(self) -> None:
        """Wait until every rank has reached the barrier. Collective.

        With META_DIST_CHECK=0 the ranks' collectives since the last comparison are compared
        here too (see ``verify_calls``).
        """
        plans.check_open(self, "barrier")
        self._threads.run(self._compared_barrier, "barrier")
        self.verify_calls()

    def verify_calls(self) -> None:
        """Raise ValueError on every rank if the ranks' collectives differed since the last call.

        With the per-call check on (the default) every call is compared as it is made, and
        this does nothing. With it off (META_DIST_CHECK=0, ``check=False``) calls are only
        fingerprinted, and compared here: one 16-byte allreduce. ``barrier``, ``close`` and
        the trainer (each epoch) call it. Collective.
        """
        plans.check_open(self, "verify_calls")
        if self.size > 1 and not self.check:
            self._threads.run(self._consistency.settle, "verify_calls")

    def set_trace(self, trace: Any) -> None:
        """Record every operation in ``trace`` (a ``meta_dist.trace.Trace``; None: stop)."""
        self._threads.trace = trace

    def set_stall_timeout(self, seconds: float | None) -> None:
        """Change the stall timeout (None or 0: no limit); META_DIST_STALL_TIMEOUT still wins.

        Raises:
            RuntimeError: a limit for a communicator made without a watchdog; after close().
        """
        plans.check_open(self, "set_stall_timeout")
        self.stall_timeout = self._threads.set_stall_timeout(seconds)

    def close(self) -> None:
        """Finish pending asynchronous work and release buffers; later calls raise RuntimeError."""
        if self.closed:
            return
        self.verify_calls()  # before anything is torn down: a mismatch still names itself
        self._threads.close()
        self.fusion.clear()
        try:
            self._close_backend()  # still watched: it may wait for device work
            self.stream.release()  # the last calls' arrays, held until their device work ends
        finally:  # whatever the backend did, this communicator is done
            if self._threads.watchdog in self.connector.watchdogs:
                self.connector.watchdogs.remove(self._threads.watchdog)
            self._threads.stop_watching()  # frees the watchdog's side channel
            self._consistency.close()
            self._check_comm.Free()
            self.closed = True

    # ---------------------------------------------------------- plans (check now, run later)

    def _run(self, api: str, make: Callable[..., plans.Run], *args: Any) -> Any:
        """Plan a collective and run it now (or behind the queued ones); return its result."""
        return self._threads.run(self._plan(api, make, *args), api, arrays=args[0])

    def _start(self, api: str, make: Callable[..., plans.Run], *args: Any) -> Handle:
        """Plan a collective and queue it on the communication thread; return its Handle."""
        plans.check_open(self, f"{api}_async")
        self._threads.check_async(api)  # before the plan: a refusal here tells no peers
        return self._threads.start(self._plan(api, make, *args), api, arrays=args[0])

    def _plan(self, api: str, make: Callable[..., plans.Run], *args: Any) -> plans.Run:
        """Return ``make(self, *args)``, the call checked; a refusal is told to the peers.

        Arguments are checked on each rank before the cross-rank check; a bad one on some ranks
        only (a read-only ``out`` here, say) would leave the others waiting in the check. Told,
        they raise there at once, naming the refusal (see ``ConsistencyCheck.refuse``).
        """
        try:
            return self._placed(make, args, None if self.check else api)
        except Exception as error:  # anything refused before the check
            if self.size > 1 and self.check and not self.closed:
                reason = f"{type(error).__name__}: {error}"
                self._threads.run(lambda: self._consistency.refuse(api, reason), api)
            raise

    def _p2p(self, make: Callable[..., plans.Run], arrays: Any, peer: int) -> plans.Run:
        """Plan a send or receive. Only two ranks take part: a refusal is this rank's alone."""
        return self._placed(make, (arrays, peer))

    def _start_p2p(self, api: str, make: Callable[..., plans.Run], arrays: Any,
                   peer: int) -> Handle:
        plans.check_open(self, f"{api}_async")
        self._threads.check_async(api)
        run = self._p2p(make, arrays, peer)
        problem = self._async_p2p_problem()
        if problem is not None:
            raise NotImplementedError(f"{api}_async: {problem}; use the blocking {api} (pair "
                                      "sends and receives in the same order on both ranks)")
        return self._threads.start(run, api, peer, arrays)

    # ---------------------------------------------------------------- steps of every plan

    def _compared_barrier(self) -> None:
        """Compare this call like a collective (a peer in allreduce would wait), then wait."""
        self._fingerprint("barrier", [])
        self._barrier()

    def _placed(self, make: Callable[..., plans.Run], args: tuple,
                advise: str | None = None) -> plans.Run:
        """Return ``make(self, *args)`` (``advised`` for ``advise``), placed on its arrays' GPU.

        A call on CuPy arrays is planned, and later run (``comm.streams``), on the arrays' GPU,
        whatever device is current: what the plan makes (new results, copies) lands there.
        """
        arrays = args[0]
        first = arrays[0] if isinstance(arrays, (list, tuple)) and arrays else arrays
        if type(first) is np.ndarray or not is_cupy_array(first):  # numpy: one type test
            run = make(self, *args)
            return run if advise is None else advised(run, advise)
        with first.device:
            run = make(self, *args)
        return self.stream.place(run if advise is None else advised(run, advise), first.device.id)

    def _average(self, flat: Any, op: str) -> None:
        """Divide sums by size for op "avg": the only place gradients get averaged."""
        if op == "avg" and self.size > 1:
            flat /= flat.dtype.type(self.size)

    def _fingerprint(self, api: str, arrays: list[Any], op: str = "", root: int = -1) -> None:
        """Raise ValueError on every rank if the ranks called different collectives or shapes."""
        if self.size > 1:
            self._consistency.verify(api, arrays, DTYPES, op, root)

    def _check_arrays(self, api: str, arrays: list[Any]) -> None:  # noqa: B027 (optional hook)
        """Let a backend refuse arrays it cannot move (e.g. host arrays on NCCL)."""

    @staticmethod
    def _address(arr: Any) -> int:
        """Return the address of an array's data (a backend may know a cheaper way)."""
        return data_ptr(arr)

    # ------------------------------------------------------------ threads and settings

    def _async_p2p_problem(self) -> str | None:
        """Return why this backend cannot run point-to-point asynchronously, or None."""
        return None

    def _worker_started(self) -> None:  # noqa: B027 (optional hook)
        """Called first on each communication thread; backends set per-thread state here."""

    def _call_settings(self) -> dict[str, Any]:
        """Return the backend's settings that decide which library calls a collective makes."""
        return {}

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
