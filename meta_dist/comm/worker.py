"""The communication thread behind the ``*_async`` operations, and their Handle.

Imports the standard library only. Every rank must issue collectives in the same order: one
single-thread executor per communicator runs them first in, first out (a Future carries each
result or exception to its waiter), and a blocking call made while work is queued joins the
queue instead of overtaking it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


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


class OrderedWorker:
    """Run callables in submission order on one thread, started on first use.

    Args:
        on_start: called first on the thread (e.g. to make this rank's GPU current, which is
            per thread in CUDA); if it raises, every submitted call fails with BrokenThreadPool.
    """

    def __init__(self, on_start: Callable[[], None] | None = None) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meta_dist-comm",
                                            initializer=on_start)
        self._last: Future | None = None

    def submit(self, run: Callable[[], Any], after: Callable[[], None] | None = None) -> Handle:
        """Queue ``run`` and return its Handle (``after``: see Handle)."""
        self._last = self._executor.submit(run)
        return Handle(self._last, after)

    def idle(self) -> bool:
        """Return True when nothing is queued or running (a blocking call may run at once)."""
        last = self._last
        return last is None or last.done()

    def close(self) -> None:
        """Finish the queued work and stop the thread."""
        self._executor.shutdown(wait=True)


class CommThreads:
    """Where a communicator's operations run: now, or in order on its threads, watched.

    Collectives share one thread, so they run in the order every rank issued them; sends to
    each peer and receives from each peer get a thread of their own, as MPI_Isend/MPI_Irecv
    would, so two ranks may each start a send to the other before receiving.

    Args:
        watchdog: told when each operation starts and ends (None: nobody watches).
        on_start: run first on every thread (see ``OrderedWorker``).
    """

    def __init__(self, watchdog: Any, on_start: Callable[[], None]) -> None:
        self.watchdog, self._on_start = watchdog, on_start
        self.trace: Any = None  # a meta_dist.trace.Trace that records every operation
        self._collectives = OrderedWorker(on_start)
        self._p2p: dict[tuple[str, int], OrderedWorker] = {}  # (send|recv, peer) -> thread

    def run(self, call: Callable[[], Any], api: str, peer: int | None = None,
            arrays: Any = None) -> Any:
        """Run ``call`` now, or behind the queued work it must not overtake; return its result.

        ``arrays`` are what the watchdog's report names. A ``call.after`` (see Handle) runs in
        this thread once the call has finished.
        """
        after = getattr(call, "after", None)
        worker = self._collectives if peer is None else self._p2p.get((api, peer))
        if worker is not None and not worker.idle():
            return worker.submit(self._watched(call, api, peer, arrays), after).wait()
        watchdog, trace = self.watchdog, self.trace
        start = trace.begin() if trace is not None else 0.0
        if watchdog is not None:  # as _watched does, without a closure: every blocking call
            watchdog.enter(_named(api, peer), arrays, peer is None)
        try:
            result = call()
        finally:
            if watchdog is not None:
                watchdog.leave()
            if trace is not None:
                trace.end(_named(api, peer), "comm", start, bytes=_nbytes(arrays))
        if after is not None:
            after()
        return result

    def start(self, call: Callable[[], Any], api: str, peer: int | None = None,
              arrays: Any = None) -> Handle:
        """Queue ``call`` on the collectives' thread (or the peer's) and return its Handle."""
        after = getattr(call, "after", None)
        if peer is None:
            return self._collectives.submit(self._watched(call, api, peer, arrays), after)
        key = (api, peer)
        if key not in self._p2p:
            self._p2p[key] = OrderedWorker(self._on_start)
        return self._p2p[key].submit(self._watched(call, api, peer, arrays), after)

    def close(self) -> None:
        """Finish the queued work and stop the threads."""
        self._collectives.close()
        for worker in self._p2p.values():
            worker.close()

    def _watched(self, call: Callable[[], Any], api: str, peer: int | None,
                 arrays: Any) -> Callable[[], Any]:
        watchdog, trace = self.watchdog, self.trace
        if watchdog is None and trace is None:
            return call

        def watched() -> Any:
            start = trace.begin() if trace is not None else 0.0
            if watchdog is not None:
                watchdog.enter(_named(api, peer), arrays, peer is None)
            try:
                return call()
            finally:
                if watchdog is not None:
                    watchdog.leave()
                if trace is not None:
                    trace.end(_named(api, peer), "comm", start, bytes=_nbytes(arrays))

        return watched


def _named(api: str, peer: int | None) -> str:
    """Name an operation for the watchdog: a point-to-point one with its peer."""
    return api if peer is None else f"{api} {'to' if api == 'send' else 'from'} rank {peer}"


def _nbytes(arrays: Any) -> int:
    """Bytes of one array or of a list of them (0 for none)."""
    if arrays is None:
        return 0
    if isinstance(arrays, (list, tuple)):
        return sum(int(getattr(a, "nbytes", 0)) for a in arrays)
    return int(getattr(arrays, "nbytes", 0))

