"""Where a communicator's operations run: now, or in order on its threads, watched.

Imports mpi4py (the thread level) and meta_dist.watchdog. Every rank must issue collectives in
the same order: one single-thread executor per communicator runs them first in, first out (a
Future carries each result or exception to its waiter), and a blocking call made while work is
queued joins the queue instead of overtaking it. Where the library allows it (MPI), sends to
each peer and receives from each peer get a thread of their own, as MPI_Isend/MPI_Irecv would,
so two ranks may each start a send to the other before receiving; elsewhere (NCCL: one
communicator, one thread at a time) they join the collectives' queue.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import meta_dist.failfast as failfast
from meta_dist.lazy_mpi import MPI
from meta_dist.watchdog import StallWatchdog, resolve_stall_timeout

THREAD_LEVELS = {"THREAD_SINGLE": "single", "THREAD_FUNNELED": "funneled",
                 "THREAD_SERIALIZED": "serialized", "THREAD_MULTIPLE": "multiple"}


class Handle:
    """A pending asynchronous operation; ``wait()`` returns its result (or raises its error).

    Args:
        future: the operation's Future.
        after: run in the waiting thread once the operation has finished (device work: the
            caller's stream then waits for the communicator's; see ``comm.streams``).
    """

    def __init__(self, future: Future, after: Callable[[], None] | None = None) -> None:
        self._future, self._after = future, after

    def done(self) -> bool:
        """Return True when the operation has finished (successfully or not)."""
        return self._future.done()

    def wait(self) -> Any:
        """Block until the operation has finished and return its result."""
        result = self._future.result()
        if self._after is not None:
            self._after()
        return result


class CommThreads:
    """A communicator's threads, each started on first use, and the bookkeeping of every call.

    Args:
        connector: the MPI world (the watchdog's side channel is a Dup of it). Collective.
        thread_level: MPI's thread level; work on a thread of its own needs "multiple".
        stall_timeout: seconds before the watchdog ends a stalled job (None: no watchdog).
        on_start: run first on every thread (e.g. to make this rank's GPU current, which is
            per thread in CUDA); if it raises, every call queued there fails.
        p2p_apart: sends and receives run beside the collectives, on threads of their own
            (else in the collectives' order: a blocking one never overtakes a queued one).
    """

    def __init__(self, connector: Any, thread_level: int, stall_timeout: float | None,
                 on_start: Callable[[], None], p2p_apart: bool = True) -> None:
        self.thread_level, self._on_start, self.p2p_apart = thread_level, on_start, p2p_apart
        self.watchdog: StallWatchdog | None = None  # told when each operation starts and ends
        if stall_timeout is not None:  # the side channel: MPI calls from the watchdog thread
            side = (connector.comm.Dup() if connector.size > 1
                    and thread_level >= MPI.THREAD_MULTIPLE else None)
            self.watchdog = StallWatchdog(connector.rank, connector.size, stall_timeout, side)
        self.trace: Any = None  # a meta_dist.trace.Trace that records every operation
        # None (the collectives) or (send|recv, peer) -> (executor, its last Future)
        self._queues: dict[Any, tuple[ThreadPoolExecutor, Future | None]] = {}
        failfast.track_threads(self)  # a rank leaving must not finalize MPI under them

    def run(self, call: Callable[[], Any], api: str, peer: int | None = None,
            arrays: Any = None) -> Any:
        """Run ``call`` now, or behind the queued work it must not overtake; return its result.

        ``arrays`` are what the watchdog's report names. A ``call.after`` (see Handle) runs in
        this thread once the call has finished.
        """
        failfast.note_progress()
        queued = self._queues.get(self._key(api, peer))
        if queued is not None and queued[1] is not None and not queued[1].done():
            return self.start(call, api, peer, arrays).wait()
        result = self._watched(call, api, peer, arrays)
        after = getattr(call, "after", None)
        if after is not None:
            after()
        return result

    def start(self, call: Callable[[], Any], api: str, peer: int | None = None,
              arrays: Any = None) -> Handle:
        """Queue ``call`` on the collectives' thread (or the peer's) and return its Handle."""
        failfast.note_progress()
        key = self._key(api, peer)
        executor = self._queues[key][0] if key in self._queues else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="meta_dist-comm", initializer=self._on_start)
        future = executor.submit(functools.partial(self._watched, call, api, peer, arrays))
        self._queues[key] = (executor, future)
        return Handle(future, getattr(call, "after", None))

    def busy(self) -> bool:
        """Return True while a queued call has not finished (its thread may be inside MPI)."""
        return any(last is not None and not last.done() for _, last in self._queues.values())

    def _key(self, api: str, peer: int | None) -> Any:
        """The queue a call joins: None (the collectives') or (send|recv, peer)."""
        return None if peer is None or not self.p2p_apart else (api, peer)

    def check_async(self, api: str) -> None:
        """Refuse work on a thread of its own unless MPI allows calls from any thread."""
        if self.thread_level < MPI.THREAD_MULTIPLE:
            level = next((word for name, word in THREAD_LEVELS.items()
                          if getattr(MPI, name) == self.thread_level), self.thread_level)
            raise RuntimeError(
                f"{api}_async: MPI was initialised with thread level {level!r}, and the async "
                "collectives (and the trainer's overlap_comm) call MPI from a communication "
                "thread, which needs 'multiple'; leave mpi4py.rc.thread_level at its default "
                "('multiple') before MPI starts, or call the blocking collective (overlap_comm: "
                "false in meta_dist_config)")

    def set_stall_timeout(self, seconds: float | None) -> float | None:
        """Change the stall timeout and return it (the environment still wins; see Communicator).

        Raises:
            RuntimeError: a limit for threads made without a watchdog.
        """
        seconds = resolve_stall_timeout(seconds)
        if self.watchdog is None and seconds:
            raise RuntimeError(
                f"stall_timeout {seconds:g}: this communicator was made without a stall "
                "watchdog (stall_timeout None or META_DIST_STALL_TIMEOUT=0); make it with a "
                "timeout")
        if self.watchdog is not None:
            self.watchdog.set_timeout(seconds)
        return seconds

    def close(self) -> None:
        """Finish the queued work and stop the threads."""
        for executor, _ in self._queues.values():
            executor.shutdown(wait=True)
        self._queues.clear()

    def stop_watching(self) -> None:
        """Stop the watchdog and free its side channel (the communicator is closing)."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def _watched(self, call: Callable[[], Any], api: str, peer: int | None,
                 arrays: Any) -> Any:
        """Run ``call`` with the watchdog told and the trace recording (when there are any)."""
        watchdog, trace = self.watchdog, self.trace
        if watchdog is None and trace is None:
            return call()
        name = api if peer is None else f"{api} {'to' if api == 'send' else 'from'} rank {peer}"
        start = trace.begin() if trace is not None else 0.0
        if watchdog is not None:
            watchdog.enter(name, arrays, peer is None, peer)
        try:
            return call()
        finally:
            if watchdog is not None:
                watchdog.leave()
            if trace is not None:
                trace.end(name, "comm", start, bytes=_nbytes(arrays))


def _nbytes(arrays: Any) -> int:
    """Bytes of one array or of a list of them (0 for none)."""
    if arrays is None:
        return 0
    if isinstance(arrays, (list, tuple)):
        return sum(int(getattr(a, "nbytes", 0)) for a in arrays)
    return int(getattr(arrays, "nbytes", 0))
