"""The distributed context: ``dist.get_context()``, init/shutdown, and collectives on it.

Imports meta_dist.connector, meta_dist.comm, meta_dist.gpus and meta_dist.xp, the first three
only when the context starts: importing this module starts no MPI. This is the Meta design's
``from meta_dist import distributed as dist; dctx = dist.get_context()``: the first call starts
the MPI connector; the module-level collectives (re-exported as ``meta_dist.allreduce`` etc.) run
on the context's communicator for the array's kind (numpy: MPI; CuPy: NCCL when usable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meta_dist.config import ZERO_LEVELS
from meta_dist.xp import is_cupy_array

if TYPE_CHECKING:
    from meta_dist.comm import Communicator, Handle
    from meta_dist.connector import MPIConnector

BACKEND_CHOICES = ("auto", "mpi", "nccl")


class DistContext:
    """Where this process stands in the job, and the switches of distributed training.

    Attributes mirror the Meta design: ``root_rank``, ``size``, ``rank``, ``local_rank``,
    ``local_size``; ``enable_data_parallel`` and ``zero_opt_level`` are checked on assignment.
    """

    def __init__(self, connector: MPIConnector, backend: str = "auto") -> None:
        self.connector = connector
        self._backend = _check_backend(backend)
        self._enable_data_parallel = False
        self._zero_opt_level = 0
        # Made now, on every rank: creating a communicator is collective, so making one lazily
        # inside send/recv (which only two ranks call) would hang the job.
        from meta_dist.comm import make_communicator

        self._communicators: dict[str, Communicator] = {"mpi": make_communicator("mpi", connector)}
        # why CuPy arrays go through MPI (None: they use NCCL); "auto" picks NCCL only where it
        # can run on every rank: each rank its own GPU, or GPUs NCCL lets ranks share
        self.nccl_problem: str | None = "backend: mpi was asked for"
        if backend == "auto":
            self.nccl_problem = _nccl_problem(connector)
        if backend == "nccl" or (backend == "auto" and self.nccl_problem is None):
            self._communicators["nccl"] = make_communicator("nccl", connector)
            self.nccl_problem = None

    root_rank = property(lambda self: self.connector.root_rank, doc="The root rank (0).")
    size = property(lambda self: self.connector.size, doc="The number of ranks.")
    rank = property(lambda self: self.connector.rank, doc="This rank, 0 to size - 1.")
    local_rank = property(lambda self: self.connector.local_rank, doc="Rank on this node.")
    local_size = property(lambda self: self.connector.local_size, doc="Ranks on this node.")

    @property
    def enable_data_parallel(self) -> bool:
        """Split the batch across ranks and average gradients."""
        return self._enable_data_parallel

    @enable_data_parallel.setter
    def enable_data_parallel(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"enable_data_parallel must be a bool; got {value!r}")
        self._enable_data_parallel = value

    @property
    def zero_opt_level(self) -> int:
        """ZeRO level: 0 (data parallel), 1 (optimizer state), 2 (+ gradients), 3 (+ params)."""
        return self._zero_opt_level

    @zero_opt_level.setter
    def zero_opt_level(self, value: int) -> None:
        if isinstance(value, bool) or value not in ZERO_LEVELS:
            raise ValueError(f"zero_opt_level must be one of "
                             f"{', '.join(map(str, ZERO_LEVELS))}; got {value!r}")
        self._zero_opt_level = value

    @property
    def backend(self) -> str:
        """The backend preference: "auto", "mpi" or "nccl"."""
        return self._backend

    def communicator(self, backend: str = "mpi") -> Communicator:
        """Return the context's communicator of a backend ("mpi", or "nccl" where usable)."""
        if self.connector.closed:
            raise RuntimeError("communicator requested after shutdown(); call init() first")
        if backend not in self._communicators:
            raise RuntimeError(
                f"communicator: backend {backend!r} is not active in this context; got "
                f"backend={self._backend!r} at init; call meta_dist.shutdown(), then "
                f"meta_dist.init(backend={backend!r}) (it says what is missing if it cannot "
                "run here)"
            )
        return self._communicators[backend]

    def communicator_for(self, array: Any) -> Communicator:
        """Return the communicator that moves this kind of array under the backend preference.

        numpy arrays always use MPI. CuPy arrays use NCCL when it is active (backend "nccl",
        or "auto" with NCCL usable on every rank); otherwise MPI, CUDA-aware or staged through
        the host. Needs no communication, so point-to-point calls are safe.
        """
        item = array[0] if isinstance(array, (list, tuple)) and array else array
        if (self._backend != "mpi" and is_cupy_array(item)
                and "nccl" in self._communicators):
            return self._communicators["nccl"]
        return self.communicator("mpi")

    def device_route(self, comm: Communicator) -> str:
        """Say how ``comm`` moves CuPy arrays, and why not NCCL (one line for a log)."""
        if comm.backend_name == "nccl":
            return "GPU collectives: NCCL"
        how = "CUDA-aware" if comm.cuda_aware else "staged through host memory"
        return f"GPU collectives: MPI, {how} ({self.nccl_problem})"

    def set_stall_timeout(self, seconds: float | None) -> None:
        """Set every communicator's stall timeout (None or 0: no limit; see meta_dist.watchdog).

        META_DIST_STALL_TIMEOUT, where set, wins over ``seconds``.
        """
        for comm in self._communicators.values():
            if not comm.closed:  # one the program closed itself says so when next used
                comm.set_stall_timeout(seconds)

    def close(self) -> None:
        """Close every communicator and the connector. Collective."""
        try:
            for comm in self._communicators.values():
                try:
                    comm.close()
                except Exception:  # close the rest, then report the first failure
                    self.connector.close()
                    raise
        finally:
            self._communicators.clear()
            self.connector.close()


_context: DistContext | None = None
_was_shut_down = False


def init(backend: str = "auto") -> DistContext:
    """Start the distributed context (idempotent) and return it. Collective on first call.

    Args:
        backend: which communicator CuPy arrays use: "auto", "mpi" or "nccl".
    """
    global _context, _was_shut_down
    if _context is None:
        from meta_dist.connector import MPIConnector

        _context = DistContext(MPIConnector(), backend=backend)
        _was_shut_down = False
    elif backend != "auto" and backend != _context.backend:
        raise RuntimeError(
            f"init: the context is already running with backend {_context.backend!r}; got "
            f"backend={backend!r}; call meta_dist.shutdown() first to change it")
    return _context


def get_context() -> DistContext:
    """Return the distributed context, starting it on first use (the Meta design's entry point)."""
    return init()


def is_initialized() -> bool:
    """Return True between init() (or get_context()) and shutdown()."""
    return _context is not None


def shutdown() -> None:
    """Close the context's communicators and connector. Collective; init() may start again."""
    global _context, _was_shut_down
    if _context is not None:
        _context.close()
        _context = None
        _was_shut_down = True


def _live_context(api: str) -> DistContext:
    if _context is None:
        when = "after shutdown()" if _was_shut_down else "before init"
        raise RuntimeError(
            f"meta_dist.{api} called {when}; call meta_dist.init() or "
            "meta_dist.distributed.get_context() first"
        )
    return _context


def _nccl_problem(connector: MPIConnector) -> str | None:
    """Return why NCCL cannot serve every rank (naming the ranks), or None. Collective."""
    from meta_dist.gpus import gpu_survey, ranks_problem  # imports without cupy

    _, problems = gpu_survey(connector)
    return ranks_problem("backend auto", problems)


def _check_backend(backend: str) -> str:
    if backend not in BACKEND_CHOICES:
        raise ValueError(
            f"backend must be one of {', '.join(BACKEND_CHOICES)}; got {backend!r}"
        )
    return backend


def allreduce(send: Any, op: str = "sum", *, out: Any = None) -> Any:
    """See ``Communicator.allreduce``; runs on the default context. Collective."""
    return _live_context("allreduce").communicator_for(send).allreduce(send, op, out=out)


def allreduce_async(send: Any, op: str = "sum", *, out: Any = None) -> Handle:
    """See ``Communicator.allreduce_async``. Collective."""
    return _live_context("allreduce_async").communicator_for(send).allreduce_async(
        send, op, out=out)


def reduce_scatter(send: Any, op: str = "sum", *, out: Any = None) -> Any:
    """See ``Communicator.reduce_scatter``. Collective."""
    return _live_context("reduce_scatter").communicator_for(send).reduce_scatter(send, op, out=out)


def allgather(send: Any, *, out: Any = None) -> Any:
    """See ``Communicator.allgather``. Collective."""
    return _live_context("allgather").communicator_for(send).allgather(send, out=out)


def broadcast(buf: Any, root: int = 0, *, out: Any = None) -> Any:
    """See ``Communicator.broadcast``. Collective."""
    return _live_context("broadcast").communicator_for(buf).broadcast(buf, root, out=out)


def reduce(send: Any, root: int = 0, op: str = "sum", *, out: Any = None) -> Any:
    """See ``Communicator.reduce``. Collective."""
    return _live_context("reduce").communicator_for(send).reduce(send, root, op, out=out)


def reduce_scatter_async(send: Any, op: str = "sum", *, out: Any = None) -> Handle:
    """See ``Communicator.reduce_scatter_async``. Collective."""
    return _live_context("reduce_scatter_async").communicator_for(send).reduce_scatter_async(
        send, op, out=out)


def allgather_async(send: Any, *, out: Any = None) -> Handle:
    """See ``Communicator.allgather_async``. Collective."""
    return _live_context("allgather_async").communicator_for(send).allgather_async(send, out=out)


def broadcast_async(buf: Any, root: int = 0, *, out: Any = None) -> Handle:
    """See ``Communicator.broadcast_async``. Collective."""
    return _live_context("broadcast_async").communicator_for(buf).broadcast_async(
        buf, root, out=out)


def reduce_async(send: Any, root: int = 0, op: str = "sum", *, out: Any = None) -> Handle:
    """See ``Communicator.reduce_async``. Collective."""
    return _live_context("reduce_async").communicator_for(send).reduce_async(
        send, root, op, out=out)


def send(array: Any, peer: int) -> None:
    """See ``Communicator.send``."""
    _live_context("send").communicator_for(array).send(array, peer)


def recv(out: Any, peer: int) -> Any:
    """See ``Communicator.recv``."""
    return _live_context("recv").communicator_for(out).recv(out, peer)


def send_async(array: Any, peer: int) -> Handle:
    """See ``Communicator.send_async``."""
    return _live_context("send_async").communicator_for(array).send_async(array, peer)


def recv_async(out: Any, peer: int) -> Handle:
    """See ``Communicator.recv_async``."""
    return _live_context("recv_async").communicator_for(out).recv_async(out, peer)


def barrier() -> None:
    """Wait for every rank. Collective."""
    _live_context("barrier").communicator("mpi").barrier()
