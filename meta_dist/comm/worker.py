"""The ordered communication thread behind the ``*_async`` collectives, and their Handle.

Imports nothing of meta_dist. Every rank must issue collectives in the same order; one worker
thread per communicator runs them first in, first out, and a blocking call made while work is
queued joins the queue instead of overtaking it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Handle:
    """A pending asynchronous collective; ``wait()`` returns its result (or raises its error)."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self._run = run
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def _execute(self) -> None:
        try:
            self._result = self._run()
        except BaseException as error:  # handed to the waiting thread, not lost in the worker
            self._error = error
        finally:
            self._event.set()

    def done(self) -> bool:
        """Return True when the collective has finished (successfully or not)."""
        return self._event.is_set()

    def wait(self) -> Any:
        """Block until the collective has finished and return its result."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._result


class OrderedWorker:
    """Run callables in submission order on one lazily started thread.

    Args:
        on_start: called first on the worker thread (e.g. to make this rank's GPU current,
            which is per thread in CUDA).
    """

    def __init__(self, on_start: Callable[[], None] | None = None) -> None:
        self._on_start = on_start
        self._queue: queue.Queue[Handle | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, run: Callable[[], Any]) -> Handle:
        """Queue ``run`` and return its Handle."""
        handle = Handle(run)
        with self._lock:  # one thread only, however many callers submit at once
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="meta_dist-comm",
                                                daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put(handle)
        return handle

    def idle(self) -> bool:
        """Return True when nothing is queued or running (a blocking call may run at once)."""
        return self._pending == 0  # one int read: atomic under the GIL

    def close(self) -> None:
        """Finish the queued work and stop the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        failed: BaseException | None = None
        if self._on_start is not None:
            try:
                self._on_start()
            except BaseException as error:  # every queued handle gets it, none waits forever
                failed = error
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            if failed is None:
                handle._execute()
            else:
                handle._error = failed
                handle._event.set()
            with self._lock:
                self._pending -= 1
