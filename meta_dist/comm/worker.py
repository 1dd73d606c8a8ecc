"""Where a communicator's operations run: now, or in order on its threads, watched.

Imports the standard library only. Every rank must issue collectives in the same order: one
single-thread executor per communicator runs them first in, first out (a Future carries each
result or exception to its waiter), and a blocking call made while work is queued joins the
queue instead of overtaking it. Sends to each peer and receives from each peer get a thread
of their own, as MPI_Isend/MPI_Irecv would, so two ranks may each start a send to the other
before receiving.
"""

from __future__ import annotations

import functools
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


class CommThreads:
    """A communicator's threads, each started on first use, and the bookkeeping of every call.

    Args:
        watchdog: told when each operation starts and ends (None: nobody watches).
        on_start: run first on every thread (e.g. to make this rank's GPU current, which is
            per thread in CUDA); if it raises, every call queued there fails.
    """

    def __init__(self, watchdog: Any, on_start: Callable[[], None]) -> None:
        self.watchdog, self._on_start = watchdog, on_start
        self.trace: Any = None  # a meta_dist.trace.Trace that records every operation
        # None (the collectives) or (send|recv, peer) -> (executor, its last Future)
        self._queues: dict[Any, tuple[ThreadPoolExecutor, Future | None]] = {}

    def run(self, call: Callable[[], Any], api: str, peer: int | None = None,
            arrays: Any = None) -> Any:
        """Run ``call`` now, or behind the queued work it must not overtake; return its result.

        ``arrays`` are what the watchdog's report names. A ``call.after`` (see Handle) runs in
        this thread once the call has finished.
        """
        queued = self._queues.get(None if peer is None else (api, peer))
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
        key = None if peer is None else (api, peer)
        executor = self._queues[key][0] if key in self._queues else ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="meta_dist-comm", initializer=self._on_start)
        future = executor.submit(functools.partial(self._watched, call, api, peer, arrays))
        self._queues[key] = (executor, future)
        return Handle(future, getattr(call, "after", None))

    def close(self) -> None:
        """Finish the queued work and stop the threads."""
        for executor, _ in self._queues.values():
            executor.shutdown(wait=True)
        self._queues.clear()

    def _watched(self, call: Callable[[], Any], api: str, peer: int | None,
                 arrays: Any) -> Any:
        """Run ``call`` with the watchdog told and the trace recording (when there are any)."""
        watchdog, trace = self.watchdog, self.trace
        if watchdog is None and trace is None:
            return call()
        name = api if peer is None else f"{api} {'to' if api == 'send' else 'from'} rank {peer}"
        start = trace.begin() if trace is not None else 0.0
        if watchdog is not None:
            watchdog.enter(name, arrays, peer is None)
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
