"""Where a call on CuPy arrays runs among the caller's GPU work: one Ticket per call.

Leaf module: imports nothing of meta_dist; cupy only when a call on CuPy arrays is placed.
CuPy's current stream is per host thread, and an asynchronous collective runs on the
communication thread, whose current stream is not the caller's. So the caller's stream is
captured when the call is made (with an event marking what the call's inputs wait for), the
call's device work runs after that event on the communicator's own stream, and the caller's
stream waits for the work's last event when the caller takes the result (``Handle.wait`` or the
blocking call's return): later kernels on the caller's stream see the result, and earlier ones
are never waited for by the host.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


def mark(cupy: Any, stream: Any) -> Any:
    """Record and return a new event on ``stream`` that orders work and is never timed.

    Events made with timing disabled are the cheap kind for cudaStreamWaitEvent and
    cudaEventQuery, which is all these are used for (CUDA Runtime API, cudaEventCreateWithFlags:
    cudaEventDisableTiming; CuPy's ``Stream.record()`` would make a timing one).
    """
    return stream.record(cupy.cuda.Event(disable_timing=True))


class Ticket:
    """One call's place on the caller's stream of the arrays' GPU.

    Everything happens on the arrays' GPU, whichever device is current when the call is made
    or its result taken (as PyTorch's ProcessGroupNCCL does with a tensor's device): a stream
    belongs to one device, an event is recorded only on a stream of its own device, and stream
    handle 0 means the legacy default stream of whichever device is current.

    Attributes:
        device: the arrays' GPU (an int).
        stream: the caller's current stream on that device when the call was made. It may be a
            handle that means "this thread's default stream" (CUDA's per-thread default
            stream), so only the caller's thread may use it: the call's work runs on the
            communicator's stream.
        ready: an event on it: everything the caller enqueued before the call.
        done: an event after the call's device work (None: nothing ran on a device).
    """

    def __init__(self, cupy: Any, device: int) -> None:
        self.device, self._cupy = device, cupy
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.get_current_stream()
            self.ready = mark(cupy, self.stream)
        self.done: Any = None

    def after(self) -> None:
        """Make the caller's stream wait for the call's device work (in the caller's thread)."""
        if self.done is not None:
            with self._cupy.cuda.Device(self.device):
                self.stream.wait_event(self.done)


class CommStream:
    """A communicator's own non-blocking stream on each GPU its arrays use, and calls placed on it.

    Attributes:
        streams: device -> its stream. The NCCL backend puts its own there; others are made
            on a device's first call (under a lock: a collective and a point-to-point thread
            may place their first calls at once, and both must land on the one stream).
    """

    def __init__(self) -> None:
        self.streams: dict[int, Any] = {}
        self._lock = threading.Lock()
        # (done event, call) of each call whose device work may be unfinished, oldest first:
        # the call holds what its work reads (a fused list's arrays and their contiguous
        # copies, made on the caller's stream), and CuPy's pool hands a freed block to the next
        # allocation on the stream it came from at once (per-stream arenas)
        self._held: deque[tuple[Any, Any]] = deque()

    def place(self, run: Callable[[], Any], device: int) -> Callable[[], Any]:
        """Return ``run`` to be run on GPU ``device``'s stream after the caller's work.

        The caller's stream is captured now, in the caller's thread; the returned callable's
        ``after`` makes that stream wait for the call (``CommThreads`` runs it in the thread
        that takes the result). ``run`` may run on any thread.
        """
        import cupy

        ticket = Ticket(cupy, device)

        def on_stream() -> Any:
            with cupy.cuda.Device(device):
                stream = self._stream(cupy, device)
                stream.wait_event(ticket.ready)
                with stream:
                    result = run()
                ticket.done = mark(cupy, stream)
                with self._lock:
                    while self._held and self._held[0][0].done:
                        self._held.popleft()
                    self._held.append((ticket.done, run))
            return result

        on_stream.after = ticket.after  # type: ignore[attr-defined]
        return on_stream

    def release(self) -> None:
        """Wait for the calls' device work, then drop what they held (the communicator closes)."""
        with self._lock:
            held, self._held = self._held, deque()
        for done, _ in held:
            done.synchronize()

    def _stream(self, cupy: Any, device: int) -> Any:
        with self._lock:
            stream = self.streams.get(device)
            if stream is None:  # made while ``device`` is current: it belongs there
                stream = self.streams[device] = cupy.cuda.Stream(non_blocking=True)
            return stream
