"""Where a call on CuPy arrays runs among the caller's GPU work: one Ticket per call.

Leaf module: imports nothing of meta_dist; cupy only through the arrays' module. CuPy's current
stream is per host thread, and an asynchronous collective runs on the communication thread,
whose current stream is not the caller's. So the caller's stream is captured when the call is
made (with an event marking what the call's inputs wait for), the call's device work runs after
that event on the backend's stream, and the caller's stream waits for the work's last event
when the caller takes the result (``Handle.wait`` or the blocking call's return): later kernels
on the caller's stream see the result, and earlier ones are never waited for by the host.
"""

from __future__ import annotations

from typing import Any


class Ticket:
    """One call's place on the caller's stream.

    Args:
        cupy: the cupy module of the call's arrays.

    Attributes:
        device: the caller's current device (an int).
        stream: the caller's current stream when the call was made. It may be a handle that
            means "this thread's default stream" (CUDA's per-thread default stream), so only
            the caller's thread may use it: the call's work runs on the backend's own stream.
        ready: an event on it: everything the caller enqueued before the call.
        done: an event after the call's device work (None: nothing ran on a device).
    """

    def __init__(self, cupy: Any) -> None:
        self.device = cupy.cuda.Device().id
        self.stream = cupy.cuda.get_current_stream()
        self.ready = self.stream.record()
        self.done: Any = None

    def after(self) -> None:
        """Make the caller's stream wait for the call's device work (in the caller's thread)."""
        if self.done is not None:
            self.stream.wait_event(self.done)
