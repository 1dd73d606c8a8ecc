"""cupy.cuda.stream of the stand-in: Stream, Event, get_current_stream, get_elapsed_time.

Imports the stand-in's _engine, _knobs and _errors. Modeled on CuPy's cupy/cuda/stream.pyx
(https://docs.cupy.dev/en/stable/reference/generated/cupy.cuda.Stream.html and
cupy.cuda.Event.html): the current stream is per host thread and per device; ``Stream.null``
(ptr 0) is the legacy default stream of whichever device is current, ``Stream.ptds`` (ptr 2) the
calling thread's per-thread default stream; a created stream belongs to the device current at
creation, and ``with stream`` / ``use()`` raise RuntimeError on another device. Every Stream
and Event operation really is asynchronous: see ``cupy._engine``.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .. import _engine
from .._errors import INVALID_HANDLE, NOT_READY, cuda_error

STREAM_LEGACY = 1  # cudaStreamLegacy
STREAM_PER_THREAD = 2  # cudaStreamPerThread
_PTDS_DEFAULT = os.environ.get("CUPY_CUDA_PER_THREAD_DEFAULT_STREAM", "") == "1"
_STREAM_HANDLES = itertools.count(0x5A00_0000, 0x100)
_EVENT_HANDLES = itertools.count(0x3E00_0000, 0x40)
_STREAMS: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()
_TLS = threading.local()


class _ThreadStreams:
    """CuPy's per-thread bookkeeping: the current stream and a with-stack per device."""

    def __init__(self) -> None:
        self.current: dict[int, _BaseStream] = {}
        self.stacks: dict[int, list[_BaseStream]] = {}
        self.entered: list[int] = []

    @staticmethod
    def get() -> _ThreadStreams:
        found = getattr(_TLS, "streams", None)
        if found is None:
            found = _TLS.streams = _ThreadStreams()
        return found

    def current_of(self, device_id: int) -> _BaseStream:
        return self.current.get(device_id) or _default_stream()


def _default_stream() -> _BaseStream:
    return Stream.ptds if _PTDS_DEFAULT else Stream.null


def get_current_stream(device_id: int = -1) -> _BaseStream:
    """Return this thread's current stream on ``device_id`` (default: the current device)."""
    if device_id == -1:
        device_id = _engine.current_device_id()
    return _ThreadStreams.get().current_of(device_id)


def current_queue() -> _engine.Queue:
    """Return the queue kernels go to now: the current device's current stream."""
    return get_current_stream()._queue()


def queue_of_handle(ptr: int, device_id: int) -> _engine.Queue | None:
    """Return the queue of a raw stream handle used on ``device_id``, or None if not one."""
    state = _engine.device(device_id)
    if ptr in (0, STREAM_LEGACY):
        return state.legacy
    if ptr == STREAM_PER_THREAD:
        return _engine.ptds_queue(state)
    stream = _STREAMS.get(ptr)
    if stream is None or stream._own is None or stream._own.device is not state:
        return None
    return stream._own


def _check_device(device_id: int) -> int:
    current = _engine.current_device_id()
    if device_id == -1:
        return current
    if device_id != current:
        raise RuntimeError(f"The device that the stream is created on ({device_id}) does not "
                           f"match with the current device ({current})")
    return device_id


class _BaseStream:
    """A CUDA stream; ``ptr`` is its raw handle and ``device_id`` its device (-1: any)."""

    def __init__(self, ptr: int, device_id: int, own: _engine.Queue | None) -> None:
        self.ptr = ptr
        self.device_id = device_id
        self._own = own

    def _queue(self) -> _engine.Queue:
        if self._own is not None:
            return self._own
        state = _engine.current_device()
        return state.legacy if self.ptr == 0 else _engine.ptds_queue(state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _BaseStream) and self.ptr == other.ptr

    def __hash__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ptr} (device {self.device_id})>"

    def __enter__(self) -> _BaseStream:
        device_id = _check_device(self.device_id)
        tls = _ThreadStreams.get()
        tls.stacks.setdefault(device_id, [tls.current_of(device_id)]).append(self)
        tls.entered.append(device_id)
        tls.current[device_id] = self
        return self

    def __exit__(self, *args: object) -> None:
        tls = _ThreadStreams.get()
        device_id = tls.entered.pop()
        stack = tls.stacks[device_id]
        stack.pop()
        tls.current[device_id] = stack[-1]

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self.ptr

    def use(self) -> _BaseStream:
        """Make this stream current on its device (use ``with`` to switch temporarily)."""
        device_id = _check_device(self.device_id)
        _ThreadStreams.get().current[device_id] = self
        return self

    @property
    def done(self) -> bool:
        """True if all work queued on this stream has finished (cudaStreamQuery)."""
        q = self._queue()
        seq, clock = _engine.snapshot(q)
        return _engine.finished(q, seq, clock)

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream has finished."""
        q = self._queue()
        seq, clock = _engine.snapshot(q)
        _engine.wait(q, seq, clock)

    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) on this stream and return it."""
        if event is None:
            event = Event()
        event._record_on(self._queue())
        return event

    def wait_event(self, event: Event) -> None:
        """Make work queued on this stream from now on wait for ``event`` (cudaStreamWaitEvent)."""
        if not isinstance(event, Event):
            raise TypeError(f"wait_event: expected a cupy.cuda.Event; got {type(event).__name__}")
        q = self._queue()
        recorded = event._recorded
        after = None if recorded is None else (recorded[0], recorded[1], recorded[2])
        _engine.enqueue(q, None, f"wait_event({event.ptr:#x})", after=after)

    def add_callback(self, callback: Callable[[Any, int, Any], None], arg: Any) -> None:
        """Call ``callback(stream, status, arg)`` on a host thread after the queued work."""
        self.launch_host_func(lambda a: callback(self, 0, a), arg)

    def launch_host_func(self, callback: Callable[[Any], None], arg: Any) -> None:
        """Call ``callback(arg)`` on a host thread after the queued work (cudaLaunchHostFunc)."""
        _engine.enqueue(self._queue(), _engine.run_host_func(lambda: callback(arg)),
                        "host function")

    @property
    def is_non_blocking(self) -> bool:
        """True if the stream does not synchronise with the legacy default stream."""
        return not self._queue().blocking

    @property
    def priority(self) -> int:
        """The stream's priority (always 0 here)."""
        return 0


class Stream(_BaseStream):
    """CUDA stream (see the module docstring)."""

    null: Stream
    ptds: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False,
                 priority: int | None = None) -> None:
        if null:
            super().__init__(0, -1, None)
        elif ptds:
            super().__init__(STREAM_PER_THREAD, -1, None)
        else:
            _engine.check_api_allowed()
            state = _engine.current_device()
            ptr = next(_STREAM_HANDLES)
            kind = "nonblocking" if non_blocking else "blocking"
            label = f"stream {ptr:#x} ({'non-blocking' if non_blocking else 'blocking'})"
            super().__init__(ptr, state.index, _engine.Queue(state, kind, label))
            _STREAMS[ptr] = self

    def __del__(self) -> None:
        own = getattr(self, "_own", None)
        if own is not None:
            own.close()  # cudaStreamDestroy: queued work still runs


Stream.null = Stream(null=True)
Stream.ptds = Stream(ptds=True)


class Event:
    """CUDA event, a point in a stream's work that other streams and the host can wait for."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        _engine.check_api_allowed()
        self.ptr = next(_EVENT_HANDLES)
        self.block, self.disable_timing = block, disable_timing
        self._device = _engine.current_device().index
        self._recorded: tuple[_engine.Queue, int, dict[int, int], _engine.Op] | None = None

    def _record_on(self, q: _engine.Queue) -> None:
        if q.device.index != self._device:
            raise cuda_error(INVALID_HANDLE, f"event {self.ptr:#x} was created on device "
                                             f"{self._device} but recorded on a stream of "
                                             f"device {q.device.index}")
        op = _engine.enqueue(q, None, f"record event {self.ptr:#x}")
        self._recorded = (q, op.seq, op.clock, op)

    def record(self, stream: _BaseStream | None = None) -> None:
        """Record the event on ``stream`` (default: the current stream)."""
        (stream or get_current_stream()).record(self)

    @property
    def done(self) -> bool:
        """True if the recorded work has finished, or the event was never recorded."""
        if self._recorded is None:
            return True
        q, seq, clock, _ = self._recorded
        return _engine.finished(q, seq, clock)

    def synchronize(self) -> None:
        """Block the host until the recorded work has finished (cudaEventSynchronize)."""
        if self._recorded is not None:
            q, seq, clock, _ = self._recorded
            _engine.wait(q, seq, clock)


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Return the milliseconds between two finished events (cudaEventElapsedTime)."""
    for event in (start_event, end_event):
        if event.disable_timing or event._recorded is None:
            raise cuda_error(INVALID_HANDLE, "elapsed time needs two recorded events with "
                                             "timing enabled")
        if not event.done:
            raise cuda_error(NOT_READY, "an event has not finished yet")
    return (end_event._recorded[3].finished_at - start_event._recorded[3].finished_at) * 1e3
