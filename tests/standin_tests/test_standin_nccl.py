"""cupy.cuda.nccl of the stand-in in one process (one-rank communicators).

Documents modeled: CuPy 14's cupy_backends/cuda/libs/nccl.pyx and gpu_facts.md section 1 (API,
constants, bytes unique id, NcclError and its KeyError for 7/8); the NCCL user guide
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/): api/colls.html (arguments),
usage/inplace.html, usage/streams.html, usage/groups.html, usage/p2p.html,
api/comms.html (ncclCommAbort, ncclCommDestroy, ncclCommGetAsyncError), nccl.h.in
(NCCL_VERSION encoding). Multi-rank behaviour is in tests/standin_tests/mpi.
"""

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_standin


@pytest.fixture
def nccl(cupy):
    from cupy.cuda import nccl

    return nccl


@pytest.fixture
def comm(nccl):
    communicator = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    yield communicator
    communicator.abort()


def test_module_surface_and_versions(cupy, nccl, knobs):
    """gpu_facts.md 1: available, get_version() (X*10000+Y*100+Z, or X*1000+Y*100+Z up to
    2.8, nccl.h.in NCCL_VERSION), get_build_version() == 22501, get_unique_id() -> 128 bytes;
    constants as CuPy names them; cupy.cuda.nccl is not imported by ``import cupy``."""
    assert nccl.available is True
    assert nccl.get_version() == 22809 and nccl.get_build_version() == 22501
    knobs(META_DIST_STANDIN_NCCL_VERSION="2.8.4")
    assert nccl.get_version() == 2804
    knobs(META_DIST_STANDIN_NCCL_VERSION="23203")
    assert nccl.get_version() == 23203
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != nccl.get_unique_id()
    assert (nccl.NCCL_INT8, nccl.NCCL_UINT8, nccl.NCCL_INT32, nccl.NCCL_UINT32,
            nccl.NCCL_INT64, nccl.NCCL_UINT64, nccl.NCCL_FLOAT16, nccl.NCCL_FLOAT32,
            nccl.NCCL_FLOAT64, nccl.NCCL_BFLOAT16) == tuple(range(10))
    assert (nccl.NCCL_SUM, nccl.NCCL_PROD, nccl.NCCL_MAX, nccl.NCCL_MIN,
            nccl.NCCL_AVG) == tuple(range(5))
    assert nccl.NCCL_FLOAT == nccl.NCCL_FLOAT32 and nccl.NCCL_HALF == nccl.NCCL_FLOAT16


def test_nccl_error_and_cupy_keyerror_bug(nccl):
    """gpu_facts.md 1 "Errors": NcclError(RuntimeError) has .status and reads "NAME: text";
    CuPy's table stops at 6, so NcclError(7) and NcclError(8) raise KeyError(7) / KeyError(8)
    inside the constructor."""
    error = nccl.NcclError(5)
    assert isinstance(error, RuntimeError) and error.status == 5
    assert str(error) == ("NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN "
                          "for details)")
    assert str(nccl.NcclError(6)).startswith("NCCL_ERROR_REMOTE_ERROR: remote process exited")
    for status in (7, 8):
        with pytest.raises(KeyError) as info:
            nccl.NcclError(status)
        assert info.value.args == (status,)
    with pytest.raises(nccl.NcclError):
        nccl.check_status(4)


def test_init_arguments(cupy, nccl, knobs):
    """CuPy 14: commId must be bytes (a CuPy 13 tuple is a TypeError) of length 128
    (ValueError); ncclCommInitRank: 0 <= rank < nranks (invalid argument, 4); the
    communicator lives on the current device (comms.html, ncclCommCuDevice)."""
    uid = nccl.get_unique_id()
    with pytest.raises(TypeError, match="expected bytes"):
        nccl.NcclCommunicator(1, tuple(uid), 0)
    with pytest.raises(ValueError, match="commId length"):
        nccl.NcclCommunicator(1, uid[:64], 0)
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(1, uid, 1)
    assert info.value.status == 4
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(1, bytes(128), 0)
    assert info.value.status == 2
    knobs(META_DIST_STANDIN_DEVICES=2)
    with cupy.cuda.Device(1):
        on_one = nccl.NcclCommunicator(1, uid, 0)
    assert on_one.device_id() == 1 and on_one.rank_id() == 0 and on_one.size() == 1
    assert on_one.comm != 0
    on_one.destroy()
    assert on_one.comm == 0
    with pytest.raises(NotImplementedError):
        nccl.NcclCommunicator.initAll(2)


def _bufs(cupy, n=8, dtype="float32"):
    x = cupy.arange(n, dtype=dtype)
    return x, cupy.zeros(n, dtype)


def test_argument_checks(cupy, nccl, comm, knobs):
    """NCCL ArgsCheck (api/colls.html arguments; status 4, invalid argument): datatype and op
    must exist in the modeled version (bfloat16 and avg since 2.10), root in range, buffers
    live device memory of the communicator's GPU and large enough; an unknown stream is a
    CUDA error (1); Cython refuses non-integers (TypeError) and negative counts."""
    x, y = _bufs(cupy)
    s = cupy.cuda.get_current_stream().ptr
    bad_calls = {
        "datatype": lambda: comm.allReduce(x.data.ptr, y.data.ptr, 8, 12, 0, s),
        "op": lambda: comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 5, s),
        "root": lambda: comm.broadcast(x.data.ptr, y.data.ptr, 8, 7, 1, s),
        "host pointer": lambda: comm.allReduce(np.zeros(8).ctypes.data, y.data.ptr, 8, 7, 0, s),
        "too large": lambda: comm.allReduce(x.data.ptr, y.data.ptr, 9, 7, 0, s),
        "overlap": lambda: comm.allReduce(x.data.ptr, x.data.ptr + 4, 4, 7, 0, s),
    }
    for what, call in bad_calls.items():
        with pytest.raises(nccl.NcclError) as info:
            call()
        assert info.value.status == 4, what
    gone = cupy.zeros(8, cupy.float32)
    stale = gone.data.ptr
    del gone
    with pytest.raises(nccl.NcclError) as info:
        comm.allReduce(x.data.ptr, stale, 8, 7, 0, s)
    assert info.value.status == 4
    with pytest.raises(nccl.NcclError) as info:
        comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, 0x1234)
    assert info.value.status == 1
    with pytest.raises(TypeError):
        comm.allReduce(float(x.data.ptr), y.data.ptr, 8, 7, 0, s)
    with pytest.raises(OverflowError):
        comm.allReduce(x.data.ptr, y.data.ptr, -1, 7, 0, s)
    comm.allReduce(x.data.ptr, y.data.ptr, 0, 7, 0, s)  # count 0: pointers are not used
    knobs(META_DIST_STANDIN_NCCL_VERSION="2.9.9")
    for datatype, op in ((nccl.NCCL_BFLOAT16, nccl.NCCL_SUM), (nccl.NCCL_FLOAT32, nccl.NCCL_AVG)):
        with pytest.raises(nccl.NcclError) as info:
            comm.allReduce(x.data.ptr, y.data.ptr, 4, datatype, op, s)
        assert info.value.status == 4


def test_in_place_rules(cupy, nccl, comm):
    """usage/inplace.html: in place is sendbuff == recvbuff (allreduce, broadcast, reduce),
    recvbuff == sendbuff + rank*recvcount (reduce-scatter), sendbuff == recvbuff +
    rank*sendcount (all-gather); at rank 0 of 1 the offset is 0."""
    x = cupy.arange(6, dtype=cupy.float64)
    s = cupy.cuda.get_current_stream()
    comm.allReduce(x.data.ptr, x.data.ptr, 6, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
    comm.reduceScatter(x.data.ptr, x.data.ptr, 6, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s.ptr)
    comm.allGather(x.data.ptr, x.data.ptr, 6, nccl.NCCL_FLOAT64, s.ptr)
    comm.bcast(x.data.ptr, 6, nccl.NCCL_FLOAT64, 0, s.ptr)
    comm.reduce(x.data.ptr, x.data.ptr, 6, nccl.NCCL_FLOAT64, nccl.NCCL_MAX, 0, s.ptr)
    assert x.get().tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(nccl.NcclError):  # shifted by one element: overlapping, not in place
        comm.allGather(x.data.ptr + 8, x.data.ptr, 5, nccl.NCCL_FLOAT64, s.ptr)


@pytest.mark.parametrize("datatype", range(12))
def test_one_rank_collectives_are_copies(cupy, nccl, comm, datatype):
    """gpu_facts.md 2: a world-size-1 communicator always works; every reduction of one rank
    is its input (avg included), every gather/broadcast a copy, for every NCCL datatype (fp8
    10/11 exist from NCCL 2.24, CuPy has no names for them)."""
    ml_dtypes = pytest.importorskip("ml_dtypes") if datatype >= 9 else None
    storage = {9: np.uint16, 10: ml_dtypes and ml_dtypes.float8_e4m3fn,
               11: ml_dtypes and ml_dtypes.float8_e5m2}.get(datatype)
    names = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
             "float64"]
    dtype = np.dtype(storage or names[datatype])
    host = np.arange(1, 7).astype(np.float32)
    if datatype == 9:
        host = host.astype(ml_dtypes.bfloat16).view(np.uint16)
    host = host.astype(dtype)
    x = cupy.asarray(host)
    s = cupy.cuda.get_current_stream().ptr
    for op in range(5):
        y = cupy.zeros_like(x)
        comm.allReduce(x.data.ptr, y.data.ptr, 6, datatype, op, s)
        np.testing.assert_array_equal(y.get(), host)
    for call in (lambda y: comm.allGather(x.data.ptr, y.data.ptr, 6, datatype, s),
                 lambda y: comm.reduceScatter(x.data.ptr, y.data.ptr, 6, datatype, 0, s),
                 lambda y: comm.broadcast(x.data.ptr, y.data.ptr, 6, datatype, 0, s),
                 lambda y: comm.reduce(x.data.ptr, y.data.ptr, 6, datatype, 3, 0, s)):
        y = cupy.zeros_like(x)
        call(y)
        np.testing.assert_array_equal(y.get(), host)


@pytest.mark.parametrize(("dtype", "count", "unwritten"), [
    ("float32", 70001, 17), ("float16", 40001, 1), ("float64", 40001, 1),
    ("float16", 70001, 0), ("float32", 4000, 0)])
def test_one_rank_float_avg_drops_the_tail_before_2_29_7(cupy, nccl, comm, knobs, dtype,
                                                        count, unwritten):
    """NVIDIA/nccl#1950 (fixed in v2.29.7-1): one rank reduces ncclAvg of floats with
    oneRankReduce (src/device/onerank.cu), min(32, ceil(bytes / 16 KiB)) blocks of
    alignUp(count // blocks, 16 / itemsize) elements, which can miss the last elements: they
    keep what the output held. Counts from a real H200 with NCCL 2.28.3 (float32 70001: 17
    unwritten; float16 and float64 40001: 1; float16 70001: none). Sums, integers, and NCCL
    2.29.7 write everything."""
    host = (np.arange(count) % 1000 + 1).astype(dtype)
    x, s = cupy.asarray(host), cupy.cuda.get_current_stream().ptr
    datatype = {"float16": nccl.NCCL_FLOAT16, "float32": nccl.NCCL_FLOAT32,
                "float64": nccl.NCCL_FLOAT64}[dtype]
    for version, op, missing in (("2.28.9", nccl.NCCL_AVG, unwritten),
                                 ("2.28.9", nccl.NCCL_SUM, 0), ("2.29.7", nccl.NCCL_AVG, 0)):
        knobs(META_DIST_STANDIN_NCCL_VERSION=version)
        for name in ("allReduce", "reduceScatter", "reduce"):
            y = cupy.full(count, -1, dtype)
            root = (0,) if name == "reduce" else ()
            getattr(comm, name)(x.data.ptr, y.data.ptr, count, datatype, op, *root, s)
            got = y.get()
            np.testing.assert_array_equal(got[:count - missing], host[:count - missing])
            np.testing.assert_array_equal(got[count - missing:], -1)
    ints = cupy.arange(count, dtype=cupy.int32)
    y = cupy.full(count, -1, cupy.int32)
    knobs(META_DIST_STANDIN_NCCL_VERSION="2.28.9")
    comm.allReduce(ints.data.ptr, y.data.ptr, count, nccl.NCCL_INT32, nccl.NCCL_AVG, s)
    np.testing.assert_array_equal(y.get(), np.arange(count))  # integers: a copy, all written


def test_groups_and_point_to_point(cupy, nccl, comm):
    """usage/groups.html: inside ncclGroupStart/End calls "can return without having enqueued
    the operation on the stream"; they run at the outer groupEnd. usage/p2p.html: send/recv
    are fused in a group (the stand-in refuses them outside one, status 5); groupEnd without
    groupStart is invalid usage."""
    x, y = _bufs(cupy)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    with pytest.raises(nccl.NcclError) as info:
        comm.send(x.data.ptr, 8, nccl.NCCL_FLOAT32, 0, s.ptr)
    assert info.value.status == 5
    s.synchronize()
    nccl.groupStart()
    try:
        nccl.groupStart()
        comm.send(x.data.ptr, 8, nccl.NCCL_FLOAT32, 0, s.ptr)
        comm.recv(y.data.ptr, 8, nccl.NCCL_FLOAT32, 0, s.ptr)
        nccl.groupEnd()
        enqueued = not s.done
    finally:
        nccl.groupEnd()
    assert not enqueued  # nothing was enqueued before the outermost groupEnd
    s.synchronize()
    assert y.get().tolist() == list(range(8))
    with pytest.raises(nccl.NcclError) as info:
        nccl.groupEnd()
    assert info.value.status == 5


def test_missing_wait_on_compute_stream(cupy, nccl, comm, knobs):
    """usage/streams.html and gpu_facts.md 5: NCCL runs on the stream it is given, ordered only
    after that stream's earlier work; gradients written on the compute stream need
    comm_stream.wait_event(compute.record()). Without it: a race error, or (detector off)
    NCCL reads the old data."""
    compute, side = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        grads = cupy.zeros(8, cupy.float32)
        out = cupy.zeros(8, cupy.float32)
    compute.synchronize()
    with compute:
        grads += 1
    with pytest.raises(cupy.StandinRaceError, match="nccl allReduce"):
        comm.allReduce(grads.data.ptr, out.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       side.ptr)
    side.wait_event(compute.record())
    comm.allReduce(grads.data.ptr, out.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    compute.wait_event(side.record())
    with compute:
        assert float(out.sum()) == 8
    knobs(META_DIST_STANDIN_RACES="off")
    with compute:
        compute.launch_host_func(lambda _: time.sleep(0.25), None)
        grads += 1
    comm.allReduce(grads.data.ptr, out.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    compute.wait_event(side.record())
    with compute:
        assert float(out.sum()) == 8  # not 16: NCCL read grads before the += ran


def test_reading_the_result_needs_the_done_event(cupy, nccl, comm, knobs):
    """gpu_facts.md 5: get() waits for the current stream only; a result NCCL writes on a side
    stream needs current.wait_event(side.record()) first. Without it: a race error, or (detector
    off, NCCL stream busy) the old contents of the buffer."""
    side, current = cupy.cuda.Stream(non_blocking=True), cupy.cuda.get_current_stream()
    x, y = cupy.full(4, 3.0, cupy.float32), cupy.zeros(4, cupy.float32)
    side.wait_event(current.record())
    comm.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    with pytest.raises(cupy.StandinRaceError, match="nccl allReduce"):
        y.get()
    current.wait_event(side.record())
    assert y.get().tolist() == [3.0] * 4
    knobs(META_DIST_STANDIN_RACES="off")
    x.fill(5.0)
    side.wait_event(current.record())
    side.launch_host_func(lambda _: time.sleep(0.25), None)
    comm.allReduce(x.data.ptr, y.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, side.ptr)
    assert y.get().tolist() == [3.0] * 4  # stale: NCCL has not run yet
    side.synchronize()
    assert y.get().tolist() == [5.0] * 4


def test_hang_abort_destroy(cupy, nccl, knobs):
    """usage/operations.html: a call that cannot complete leaves its stream waiting forever;
    ncclCommAbort (api/comms.html) ends it, after which the communicator is NULL and every
    call fails (status 4); destroy() after abort does nothing (CuPy checks the handle)."""
    knobs(META_DIST_STANDIN_NCCL_HANG="0:2")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x, y = _bufs(cupy)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, s.ptr)
    comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, s.ptr)  # the 2nd call hangs
    done = s.record()
    time.sleep(0.3)
    assert not done.done
    comm.check_async_error()  # a hang is not an error
    comm.abort()
    done.synchronize()
    assert comm.comm == 0
    for call in (lambda: comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, s.ptr),
                 comm.check_async_error, comm.rank_id):
        with pytest.raises(nccl.NcclError) as info:
            call()
        assert info.value.status == 4
    comm.destroy()


@pytest.mark.parametrize("status", [6, 7])
def test_injected_async_error(cupy, nccl, knobs, status):
    """ncclCommGetAsyncError (api/comms.html) reports an error of queued work; CuPy raises
    NcclError(status), or KeyError for 7/8 (gpu_facts.md 1)."""
    knobs(META_DIST_STANDIN_NCCL_ASYNC_ERROR=f"0:1:{status}")
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x, y = _bufs(cupy)
    s = cupy.cuda.get_current_stream()
    comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, s.ptr)
    done = s.record()
    deadline = time.monotonic() + 5
    raised = None
    while raised is None and time.monotonic() < deadline:
        try:
            comm.check_async_error()
        except (nccl.NcclError, KeyError) as error:
            raised = error
        time.sleep(0.01)
    assert not done.done
    comm.abort()
    done.synchronize()
    if status == 7:
        assert isinstance(raised, KeyError) and raised.args == (7,)
    else:
        assert isinstance(raised, nccl.NcclError) and raised.status == 6


def test_destroy_waits_for_queued_calls(cupy, nccl):
    """api/comms.html: ncclCommDestroy finalizes (flushes) outstanding work first."""
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x, y = _bufs(cupy)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    s.launch_host_func(lambda _: time.sleep(0.2), None)
    comm.allReduce(x.data.ptr, y.data.ptr, 8, 7, 0, s.ptr)
    comm.destroy()
    assert s.done


def test_comm_split_one_rank(cupy, nccl, comm):
    """ncclCommSplit (NCCL >= 2.18): color -1 gives no communicator; one color keeps rank 0."""
    child = comm.commSplit(0, 0)
    assert child.size() == 1 and child.rank_id() == 0 and child.comm != comm.comm
    assert comm.commSplit(-1, 0) is None
    child.destroy()
