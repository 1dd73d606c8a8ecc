"""Devices, the memory pool and pinned memory of the CuPy stand-in.

Documents modeled: CUDA's CUDA_VISIBLE_DEVICES and cudaGetDeviceCount / cudaSetDevice (per
host thread, cudaErrorNoDevice / cudaErrorInvalidDevice); CuPy's cupy.cuda.Device and
cupy.cuda.runtime reference pages (cupy/cuda/device.pyx); cupy.cuda.MemoryPool
(https://docs.cupy.dev/en/stable/user_guide/memory.html and cupy/cuda/memory.pyx: 512-byte
rounding, per-stream free lists, free_all_blocks, set_limit, OutOfMemoryError);
cupyx.empty_pinned and friends.
"""

import threading

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_standin


def test_device_count_and_visible_devices(cupy, knobs):
    """cudaGetDeviceCount counts the devices CUDA_VISIBLE_DEVICES leaves visible, renumbered
    from 0 in the listed order; none visible is cudaErrorNoDevice (100)."""
    runtime = cupy.cuda.runtime
    assert runtime.getDeviceCount() == 1
    knobs(META_DIST_STANDIN_DEVICES=3)
    assert runtime.getDeviceCount() == 3
    buses = [cupy.cuda.Device(i).pci_bus_id for i in range(3)]
    assert len(set(buses)) == 3 and all(b.startswith("0000:") for b in buses)
    knobs(CUDA_VISIBLE_DEVICES="2,0")
    assert runtime.getDeviceCount() == 2
    assert cupy.cuda.Device(0).pci_bus_id == buses[2]
    knobs(CUDA_VISIBLE_DEVICES="")
    with pytest.raises(runtime.CUDARuntimeError) as info:
        runtime.getDeviceCount()
    assert info.value.status == 100
    assert not cupy.is_available()


def test_version_and_property_queries(cupy, knobs):
    """cudaDriverGetVersion / cudaRuntimeGetVersion encode 1000*major + 10*minor (12080 is
    12.8); CuPy's getDeviceProperties returns a dict whose ``name`` is bytes and whose
    ``totalGlobalMem`` is the device's memory; a device that is not visible is
    cudaErrorInvalidDevice (101)."""
    runtime = cupy.cuda.runtime
    knobs(META_DIST_STANDIN_DEVICES=2)
    for version in (runtime.driverGetVersion(), runtime.runtimeGetVersion()):
        assert isinstance(version, int) and version // 1000 >= 11 and version % 10 == 0
    props = runtime.getDeviceProperties(1)
    assert isinstance(props["name"], bytes)
    with cupy.cuda.Device(1):
        assert props["totalGlobalMem"] == runtime.memGetInfo()[1]
    with pytest.raises(runtime.CUDARuntimeError) as info:
        runtime.getDeviceProperties(2)
    assert info.value.status == 101


def test_device_selection_is_per_thread(cupy, knobs):
    """cudaSetDevice sets the current device of the calling host thread only; CuPy's Device
    context manager restores the previous device; an index past the count is
    cudaErrorInvalidDevice (101) when used (Device() itself does not check)."""
    knobs(META_DIST_STANDIN_DEVICES=2)
    runtime = cupy.cuda.runtime
    seen = []
    cupy.cuda.Device(1).use()
    try:
        assert runtime.getDevice() == 1 and cupy.cuda.Device().id == 1
        worker = threading.Thread(target=lambda: seen.append(runtime.getDevice()))
        worker.start()
        worker.join()
        with cupy.cuda.Device(0):
            assert runtime.getDevice() == 0
        assert runtime.getDevice() == 1
    finally:
        cupy.cuda.Device(0).use()
    assert seen == [0]
    ghost = cupy.cuda.Device(7)
    with pytest.raises(runtime.CUDARuntimeError) as info:
        ghost.use()
    assert info.value.status == 101
    assert cupy.cuda.Device(1) == cupy.cuda.Device(1) and repr(ghost) == "<CUDA Device 7>"


def test_primary_contexts_follow_each_threads_device(cupy, knobs):
    """A thread with no device set that makes a CUDA call (an event query) gets device 0's
    primary context; cudaSetDevice makes the chosen device's current (and initializes it)
    ("Interactions with the CUDA Driver API", CUDA runtime API; cudaSetDevice's notes)."""
    knobs(META_DIST_STANDIN_DEVICES=2)
    with cupy.cuda.Device(1):
        event = cupy.cuda.Stream(non_blocking=True).record(cupy.cuda.Event())

    def unset() -> None:
        event.done  # noqa: B018 (cudaEventQuery)

    def chosen() -> None:
        cupy.cuda.Device(1).use()
        event.done  # noqa: B018

    for name, target in (("standin-unset", unset), ("standin-chosen", chosen)):
        worker = threading.Thread(target=target, name=name)
        worker.start()
        worker.join()
    made = cupy._engine.contexts()
    assert "standin-unset: a CUDA call with no device set" in made[0]
    assert "standin-chosen: cudaSetDevice" in made[1]
    assert not any(t.startswith("standin-chosen") for t in made[0])
    assert not any(t.startswith("standin-unset") for t in made[1])


def test_arrays_live_on_the_current_device(cupy, knobs):
    """CuPy allocates on the current device; a kernel with an array on another device and no
    peer access raises ValueError (_check_peer_access); cupy.copy / cupy.asarray copy across
    devices (cupy.copy docs), with cudaMemcpyPeerAsync, which is "asynchronous with respect
    to ... all work on other devices": the writer on device 0 must be ordered by an event."""
    knobs(META_DIST_STANDIN_DEVICES=2)
    a = cupy.arange(4)
    written = cupy.cuda.get_current_stream().record()
    with cupy.cuda.Device(1):
        b = cupy.ones(4, dtype=a.dtype)
        assert b.device.id == 1 and a.device.id == 0
        with pytest.raises(ValueError, match="Peer access is unavailable"):
            a + b
        with pytest.raises(cupy.StandinRaceError):
            cupy.asarray(a)  # device 1's stream never waited for device 0's arange
        cupy.cuda.get_current_stream().wait_event(written)
        moved = cupy.asarray(a)
        assert moved.device.id == 1
        assert (moved + b).get().tolist() == [1, 2, 3, 4]
    cupy.cuda.Device(1).synchronize()


def test_memory_pool_accounting(cupy):
    """cupy.cuda.MemoryPool: used_bytes/total_bytes/free_bytes, sizes rounded up to 512
    bytes, freed blocks cached for reuse (n_free_blocks) until free_all_blocks; zero-byte
    arrays take no block. CuPy's pool has no peak counter."""
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    used, total = pool.used_bytes(), pool.total_bytes()
    a = cupy.empty(100, cupy.uint8)
    assert pool.used_bytes() == used + 512
    b = cupy.empty(513, cupy.uint8)
    assert pool.used_bytes() == used + 512 + 1024
    cupy.empty(0)
    assert pool.used_bytes() == used + 1536
    del a, b
    assert pool.used_bytes() == used and pool.total_bytes() == total + 1536
    assert pool.free_bytes() == pool.total_bytes() - pool.used_bytes() and pool.n_free_blocks()
    c = cupy.empty(200, cupy.uint8)  # reuses a cached block: no new device memory
    assert pool.total_bytes() == total + 1536
    del c
    pool.free_all_blocks()
    assert pool.total_bytes() == total and pool.n_free_blocks() == 0
    assert not hasattr(pool, "peak_bytes")


def test_every_new_array_comes_from_the_current_allocator(cupy):
    """cupy.cuda.set_allocator / get_allocator / alloc (CuPy docs: an allocator takes a size
    and returns a MemoryPointer; cupy.cuda.alloc calls the current one; the default is the
    default pool's malloc). Stricter: set_allocator(None), CuPy's raw cudaMalloc, is not
    modelled; an allocator returning something else is refused."""
    pool = cupy.get_default_memory_pool()
    default = cupy.cuda.get_allocator()
    asked = []

    def counting(size):
        asked.append(size)
        return pool.malloc(size)

    cupy.cuda.set_allocator(counting)
    try:
        a = cupy.zeros(300, cupy.float32)
        b = a + 1  # a result array: new memory too
        assert asked[:2] == [1200, 1200] and float(b.sum()) == 300.0
        assert isinstance(cupy.cuda.alloc(64), cupy.cuda.MemoryPointer) and asked[-1] == 64
        cupy.cuda.set_allocator(lambda size: 5)
        with pytest.raises(TypeError, match="MemoryPointer"):
            cupy.empty(4)
        with pytest.raises(NotImplementedError, match="raw"):
            cupy.cuda.set_allocator(None)
        with pytest.raises(TypeError, match="callable"):
            cupy.cuda.set_allocator(3)
    finally:
        cupy.cuda.set_allocator(default)
    assert cupy.cuda.get_allocator() == default


def test_memory_limit_and_out_of_memory(cupy, knobs):
    """MemoryPool.set_limit caps total bytes; past it CuPy frees cached blocks, retries, then
    raises OutOfMemoryError ("Out of memory allocating N bytes (allocated so far: ..."); the
    device's own size (a knob here) bounds it too."""
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=pool.total_bytes() + 4096)
    try:
        keep = cupy.empty(4096, cupy.uint8)
        with pytest.raises(cupy.cuda.OutOfMemoryError, match="limit set to"):
            cupy.empty(4096, cupy.uint8)
        del keep
        again = cupy.empty(4096, cupy.uint8)  # the freed block is reused
        assert again.nbytes == 4096
    finally:
        pool.set_limit(size=0)
    assert pool.get_limit() == 0
    knobs(META_DIST_STANDIN_DEVICE_MEMORY=1 << 20)
    with pytest.raises(cupy.cuda.OutOfMemoryError, match="Out of memory allocating"):
        cupy.empty(2 << 20, cupy.uint8)
    free, total = cupy.cuda.Device().mem_info
    assert total == 1 << 20 and free <= total


def test_pinned_host_arrays(cupy):
    """cupyx.empty_pinned / zeros_pinned / *_like_pinned return numpy arrays in page-locked
    memory (cupyx._pinned_array)."""
    import cupyx

    a = cupyx.empty_pinned((2, 3), np.float32)
    z = cupyx.zeros_pinned(4)
    like = cupyx.zeros_like_pinned(cupy.ones((3,), cupy.int32))
    assert type(a) is np.ndarray and a.shape == (2, 3) and a.dtype == np.float32
    assert (z == 0).all() and like.dtype == np.int32 and (like == 0).all()
    assert cupyx.empty_like_pinned(a).shape == (2, 3)
    from cupy import _memory

    assert _memory.is_pinned(a) and _memory.is_pinned(a[1]) and not _memory.is_pinned(
        np.empty(3))
