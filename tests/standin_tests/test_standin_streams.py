"""Streams and events of the CuPy stand-in: real asynchrony, ordering rules, the race detector.

Documents modeled: CUDA runtime API "Stream synchronization behavior"
(https://docs.nvidia.com/cuda/cuda-runtime-api/stream-sync-behavior.html), cudaStreamWaitEvent,
cudaLaunchHostFunc; CuPy's cupy.cuda.Stream / Event / get_current_stream reference pages and
cupy/cuda/stream.pyx; CuPy's ndarray.get / asarray docs on asynchronous copies.
"""

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_standin

STALL_S = 0.25  # a host function that sleeps keeps its stream busy this long


def stall(stream):
    """Keep ``stream`` busy for STALL_S seconds (cudaLaunchHostFunc with a sleeping callback)."""
    stream.launch_host_func(lambda _: time.sleep(STALL_S), None)


def test_work_runs_later_on_the_stream(cupy):
    """CUDA: kernel launches and async copies return before the work is done; Stream.done /
    Event.done query (cudaStreamQuery / cudaEventQuery); synchronize() blocks."""
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        stall(s)
        x = cupy.ones(10)
        done = s.record()
    assert not s.done and not done.done
    s.synchronize()
    assert s.done and done.done
    assert float(x.sum()) == 10  # the host saw s finish: any stream may read x now


def test_forgotten_wait_event_is_a_race(cupy):
    """CUDA: work on different streams is unordered unless an event orders it
    (cudaStreamWaitEvent: "all future work submitted to stream will wait until event
    completes"). The stand-in's race detector raises when the ordering is missing."""
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.ones(100)
        x *= 3
    with s2, pytest.raises(cupy.StandinRaceError, match="unordered access"):
        x + 1  # read after write, no event
    s2.wait_event(s1.record())
    with s2:
        y = x + 1
    with s1, pytest.raises(cupy.StandinRaceError):
        x[...] = 0  # write after s2's read, which s1 never waited for
    s1.wait_event(s2.record())
    with s1:
        x[...] = 0
    s2.synchronize()
    with s2:
        assert float(y.sum()) == 400


def test_forgotten_wait_event_gives_a_wrong_result(cupy, knobs):
    """The same mistake with the detector off: the reader runs before the writer (the writer's
    stream is busy), so it sees the old data, as on a GPU under load."""
    knobs(META_DIST_STANDIN_RACES="off")
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.zeros(100)
    s1.synchronize()
    with s1:
        stall(s1)
        x.fill(1)
    with s2:
        y = x * 2  # no s2.wait_event(s1.record())
    s1.synchronize()
    s2.synchronize()
    with s2:
        assert float(y.sum()) == 0  # not 200: the fill had not run yet


def test_host_read_after_side_stream_needs_an_event(cupy, knobs):
    """gpu_facts.md 5 and cupy.ndarray.get docs: get() copies on (and waits for) the current
    stream only; a result written on a side stream needs current.wait_event(side.record())."""
    side = cupy.cuda.Stream(non_blocking=True)
    current = cupy.cuda.get_current_stream()
    x = cupy.arange(5, dtype=cupy.float64)
    side.wait_event(current.record())
    with side:
        y = x * 10
    with pytest.raises(cupy.StandinRaceError):
        y.get()
    current.wait_event(side.record())
    assert y.get().tolist() == [0, 10, 20, 30, 40]
    knobs(META_DIST_STANDIN_RACES="off")
    side.wait_event(current.record())
    with side:
        stall(side)
        y *= 2
    assert y.get().tolist() == [0, 10, 20, 30, 40]  # stale: the doubling has not run
    current.wait_event(side.record())
    assert y.get().tolist() == [0, 20, 40, 60, 80]


def test_legacy_default_stream_orders_blocking_streams_only(cupy):
    """CUDA "Legacy default stream": it waits for all blocking streams and they wait for it;
    streams created with cudaStreamNonBlocking do not synchronise with it."""
    blocking, nonblocking = cupy.cuda.Stream(), cupy.cuda.Stream(non_blocking=True)
    assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.null
    with blocking:
        stall(blocking)
        a = cupy.ones(8)
    assert float((a + 1).sum()) == 16  # on Stream.null: waited for the blocking stream
    with nonblocking:
        b = cupy.ones(8)
    with pytest.raises(cupy.StandinRaceError):
        b + 1
    c = cupy.zeros(8)  # written on the legacy stream
    with blocking:
        assert float((c + 1).sum()) == 8  # a blocking stream waits for the legacy one
    assert nonblocking.is_non_blocking and not blocking.is_non_blocking


def test_stream_handles_and_per_thread_default_stream(cupy):
    """CuPy: Stream.null.ptr == 0, Stream.ptds.ptr == cudaStreamPerThread (2), device_id -1;
    the per-thread default stream is a different stream in each host thread."""
    assert cupy.cuda.Stream.null.ptr == 0 and cupy.cuda.Stream.null.device_id == -1
    assert cupy.cuda.Stream.ptds.ptr == 2
    s = cupy.cuda.Stream()
    assert s.ptr not in (0, 1, 2) and s.device_id == 0 and s == s and s != cupy.cuda.Stream()
    with cupy.cuda.Stream.ptds:
        x = cupy.ones(4)
    errors = []

    def other_thread():
        with cupy.cuda.Stream.ptds:
            try:
                x + 1  # another thread's per-thread stream: unordered with ours
            except cupy.StandinRaceError as error:
                errors.append(error)

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert len(errors) == 1


def test_ptds_environment_variable(cupy):
    """CuPy: CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1 makes Stream.ptds the default stream."""
    from standin_install import standin_env

    env = standin_env()
    env["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    code = ("import cupy; s = cupy.cuda.get_current_stream(); "
            "assert s is cupy.cuda.Stream.ptds and s.ptr == 2, s; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_current_stream_is_per_thread_and_per_device(cupy, knobs):
    """CuPy stream.pyx: the current stream is thread-local and kept per device; ``with
    stream`` / ``use()`` on another device raise RuntimeError."""
    knobs(META_DIST_STANDIN_DEVICES=2)
    s = cupy.cuda.Stream()
    seen = []
    with s:
        assert cupy.cuda.get_current_stream() is s
        thread = threading.Thread(target=lambda: seen.append(cupy.cuda.get_current_stream()))
        thread.start()
        thread.join()
        with cupy.cuda.Device(1):
            assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.null
            with pytest.raises(RuntimeError, match="does not match"):
                s.use()
    assert seen == [cupy.cuda.Stream.null]
    assert cupy.cuda.get_current_stream() == cupy.cuda.Stream.null
    s.use()
    assert cupy.cuda.get_current_stream(0) is s
    cupy.cuda.Stream.null.use()


def test_events(cupy, knobs):
    """cudaEventQuery/cudaEventSynchronize on a never-recorded event succeed; waiting on it is
    a no-op; cudaEventElapsedTime: cudaErrorNotReady until both finished,
    cudaErrorInvalidResourceHandle with timing disabled; CuPy: interprocess needs
    disable_timing; recording on another device's stream fails."""
    CUDARuntimeError = cupy.cuda.runtime.CUDARuntimeError  # noqa: N806
    fresh = cupy.cuda.Event()
    assert fresh.done
    fresh.synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(fresh)
    start = s.record()
    stall(s)
    end = s.record()
    with pytest.raises(CUDARuntimeError) as info:
        cupy.cuda.get_elapsed_time(start, end)
    assert info.value.status == 600
    end.synchronize()
    assert cupy.cuda.get_elapsed_time(start, end) >= STALL_S * 1000 * 0.9
    untimed = cupy.cuda.Event(disable_timing=True)
    s.record(untimed)
    untimed.synchronize()
    with pytest.raises(CUDARuntimeError) as info:
        cupy.cuda.get_elapsed_time(start, untimed)
    assert info.value.status == 400
    with pytest.raises(ValueError, match="Timing must be disabled"):
        cupy.cuda.Event(interprocess=True)
    knobs(META_DIST_STANDIN_DEVICES=2)
    with cupy.cuda.Device(1):
        other = cupy.cuda.Stream()
    with pytest.raises(CUDARuntimeError):
        other.record(cupy.cuda.Event())


def test_host_function_may_not_call_cuda(cupy):
    """cudaLaunchHostFunc: "The host function must not make any CUDA API calls"."""
    statuses = []

    def callback(_):
        try:
            cupy.zeros(1)
        except cupy.cuda.runtime.CUDARuntimeError as error:
            statuses.append(error.status)

    s = cupy.cuda.Stream()
    s.launch_host_func(callback, None)
    calls = []
    s.add_callback(lambda stream, status, arg: calls.append((stream, status, arg)), "x")
    s.synchronize()
    assert statuses == [800] and calls == [(s, 0, "x")]


def test_freeing_an_array_another_stream_uses(cupy):
    """CuPy's memory pool keeps per-stream free lists (cupy/cuda/memory.pyx, _Arena): a block
    freed while another stream may still use it can be handed out again at once on the
    allocating stream (gpu_facts.md 5). The stand-in reports it at the next CUDA call."""
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.ones(64)
    s2.wait_event(s1.record())
    with s2:
        y = x * 2
    del x  # s1 never waited for s2's read
    with pytest.raises(cupy.StandinRaceError, match="freed"):
        cupy.zeros(1)
    with s1:
        z = cupy.ones(64)
    s2.wait_event(s1.record())
    with s2:
        y = z * 2
    s1.wait_event(s2.record())
    del z
    cupy.zeros(1)  # no error: s1 waited for s2 first
    s2.synchronize()
    assert y.shape == (64,)


def test_pinned_and_pageable_copies(cupy):
    """cupy.ndarray.get docs: with blocking=False the copy runs later on the stream ("users
    are responsible for ensuring the stream order"); set()/asarray read page-locked memory
    (cupyx.empty_pinned) when the copy runs, while pageable memory is staged at the call."""
    import cupyx

    s = cupy.cuda.Stream(non_blocking=True)
    device = cupy.zeros(4)
    s.wait_event(cupy.cuda.get_current_stream().record())
    pinned = cupyx.empty_pinned(4)
    pinned[...] = 1
    pageable = np.ones(4)
    with s:
        stall(s)
        device.set(pinned)
        other = cupy.asarray(pageable)
        pinned[...] = 5  # too early: the copy has not run
        pageable[...] = 5  # fine: it was staged
        out = cupyx.zeros_pinned(4)
        device.get(out=out, blocking=False)
        assert out.tolist() == [0, 0, 0, 0]  # nothing copied yet
        s.synchronize()
        assert out.tolist() == [5, 5, 5, 5]
        assert other.get().tolist() == [1, 1, 1, 1]


def test_freeing_pinned_memory_an_async_copy_uses(cupy):
    """ndarray.set and get(blocking=False) hand cudaMemcpyAsync the page-locked array's address
    only (cupy/_core/core.pyx: ``ptr = arr.ctypes.data``; copy_from_host_async); dropping the
    last reference returns the block to CuPy's pinned memory pool, whose free blocks "are reused
    for further memory allocations of the same size" (cupy.cuda.PinnedMemoryPool). A copy that
    runs after its pinned array was freed is reported at the next CUDA call; one whose array
    is kept (a view of it suffices) is not."""
    import cupyx

    s = cupy.cuda.Stream(non_blocking=True)
    device = cupy.zeros(4)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with s:
        stall(s)
        pinned = cupyx.empty_pinned(8)
        pinned[...] = 3
        device.set(pinned[2:6])  # a temporary view: the buffer itself stays
        s.synchronize()
        assert device.get().tolist() == [3, 3, 3, 3]
        stall(s)
        device.set(pinned[:4])
        del pinned  # freed while the copy waits behind the stall
        with pytest.raises(cupy.StandinRaceError, match="pinned host memory"):
            s.synchronize()
        stall(s)
        out = cupyx.empty_pinned(4)
        device.get(out=out, blocking=False)
        del out
        with pytest.raises(cupy.StandinRaceError, match="pinned host memory"):
            s.synchronize()


def test_blocking_get_waits_for_its_stream_only(cupy):
    """gpu_facts.md 5: get()/asnumpy synchronise the stream they copy on, not the device."""
    busy = cupy.cuda.Stream(non_blocking=True)
    stall(busy)
    assert cupy.arange(3).get().tolist() == [0, 1, 2]
    assert not busy.done
    cupy.cuda.Device().synchronize()  # cudaDeviceSynchronize: every stream
    assert busy.done


def test_dropping_an_array_never_takes_the_lock(cupy):
    """Python runs finalizers in whatever thread triggers garbage collection, even one that
    holds a lock (https://docs.python.org/3/library/weakref.html#weakref.finalize); the
    stand-in's free path therefore only queues work, so dropping an array cannot deadlock
    while another thread (a stream worker starting, say) holds the engine lock."""
    from cupy import _engine

    held, release = threading.Event(), threading.Event()

    def hold_lock():
        with _engine.LOCK:
            held.set()
            release.wait(5)

    a = cupy.zeros(1024)
    holder = threading.Thread(target=hold_lock)
    holder.start()
    held.wait(5)
    start = time.monotonic()
    del a  # must not wait for the lock
    elapsed = time.monotonic() - start
    release.set()
    holder.join()
    assert elapsed < 0.5


def test_freeing_is_ordered_by_the_legacy_stream_rule(cupy):
    """CUDA "Legacy default stream": the legacy stream's next work waits for blocking streams,
    so a block allocated on Stream.null, used on a blocking stream and freed is safe to reuse
    on Stream.null; the stand-in does not report it."""
    blocking = cupy.cuda.Stream()
    x = cupy.ones(64)  # allocated on the legacy stream
    with blocking:
        y = x * 2
    del x
    cupy.zeros(1)  # no StandinRaceError
    assert float(y.sum()) == 128
