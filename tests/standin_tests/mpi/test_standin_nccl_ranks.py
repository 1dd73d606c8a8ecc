"""cupy.cuda.nccl of the stand-in across ranks (run under mpirun at 1-4 ranks).

Documents modeled: NCCL user guide (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/)
usage/operations.html (what each collective computes; "Failure to do so will result in other
ranks waiting indefinitely"), api/colls.html, usage/inplace.html, usage/p2p.html,
usage/streams.html, usage/communicators.html ("Using the same CUDA device multiple times as
different ranks of the same NCCL communicator is not supported"), api/comms.html
(ncclCommAbort, ncclCommSplit); gpu_facts.md sections 2 (two ranks on one GPU: status 5 before
NCCL 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1 from 2.30), 5 (stream recipe) and 7 (element-type
intermediates). Inputs are rank-deterministic; expected values are computed locally.
"""

import time

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_standin

COUNT = 6  # elements per rank block
NAMES = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64"]


def storage_dtype(datatype):
    """The numpy dtype a test keeps NCCL datatype ``datatype`` in (bf16 as raw uint16)."""
    if datatype < 9:
        return np.dtype(NAMES[datatype])
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return np.dtype({9: np.uint16, 10: ml_dtypes.float8_e4m3fn,
                     11: ml_dtypes.float8_e5m2}[datatype])


def encode(values, datatype):
    """Return float values as the storage of ``datatype`` (ml_dtypes does the bf16 rounding)."""
    if datatype == 9:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.asarray(values, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.asarray(values).astype(storage_dtype(datatype))


def decode(stored, datatype):
    """Return the storage of ``datatype`` as float64 values."""
    if datatype == 9:
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return stored.view(ml_dtypes.bfloat16).astype(np.float64)
    return stored.astype(np.float64)


def rank_values(rank, op, datatype, n=COUNT):
    """Small non-negative values whose partial results are exact in every datatype."""
    i = np.arange(n)
    if datatype in (10, 11):
        return ((i + rank) % 2).astype(np.float64)
    if op == 1:  # prod: products of 1s and 2s stay <= 16
        return (1 + (i + rank) % 2).astype(np.float64)
    return ((i % 3) + rank).astype(np.float64)


def reference(op, blocks, n):
    """The reduction NCCL defines (usage/operations.html), exact in float64."""
    stacked = np.stack(blocks)
    if op == 0:
        return stacked.sum(0)
    if op == 1:
        return stacked.prod(0)
    if op == 2:
        return stacked.max(0)
    if op == 3:
        return stacked.min(0)
    return stacked.sum(0) / n


def check(got, want, datatype, op):
    if op == 4:  # avg: inputs premultiplied by 1/n in the element type (src/enqueue.cc)
        if datatype in range(6):
            want = np.trunc(want)
        tolerance = {6: 1e-3, 7: 1e-7, 8: 1e-15, 9: 8e-3, 10: 0.07, 11: 0.13}.get(datatype, 0)
        np.testing.assert_allclose(decode(got, datatype), want, rtol=tolerance)
    else:
        np.testing.assert_array_equal(decode(got, datatype), want)


@pytest.mark.parametrize("datatype", range(12))
def test_collectives_match_numpy(cupy, nccl, world, my_gpu, unique_id, datatype):
    """Every collective, every reduction op, every root, for one NCCL datatype, against numpy
    (usage/operations.html; api/colls.html: reduce-scatter's recvcount is per rank,
    all-gather's count is per rank, rank order)."""
    n, me = world.size, world.rank
    comm = nccl.NcclCommunicator(n, unique_id(), me)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    checks = []
    with s:
        for op in range(5):
            mine = cupy.asarray(encode(rank_values(me, op, datatype, COUNT * n), datatype))
            blocks = [rank_values(r, op, datatype, COUNT * n) for r in range(n)]
            full = reference(op, blocks, n)
            out = cupy.zeros_like(mine)
            comm.allReduce(mine.data.ptr, out.data.ptr, COUNT * n, datatype, op, s.ptr)
            checks.append((out, full, op))
            part = cupy.zeros(COUNT, mine.dtype)
            comm.reduceScatter(mine.data.ptr, part.data.ptr, COUNT, datatype, op, s.ptr)
            checks.append((part, full[me * COUNT:(me + 1) * COUNT], op))
            for root in range(n):
                got = cupy.zeros_like(mine)
                comm.reduce(mine.data.ptr, got.data.ptr, COUNT * n, datatype, op, root, s.ptr)
                if me == root:
                    checks.append((got, full, op))
        mine = cupy.asarray(encode(rank_values(me, 0, datatype), datatype))
        gathered = cupy.zeros(COUNT * n, mine.dtype)
        comm.allGather(mine.data.ptr, gathered.data.ptr, COUNT, datatype, s.ptr)
        checks.append((gathered, np.concatenate([rank_values(r, 0, datatype)
                                                 for r in range(n)]), 0))
        for root in range(n):
            got = cupy.zeros_like(mine)
            comm.broadcast(mine.data.ptr, got.data.ptr, COUNT, datatype, root, s.ptr)
            checks.append((got, rank_values(root, 0, datatype), 0))
            inplace = cupy.asarray(encode(rank_values(me, 0, datatype), datatype))
            comm.bcast(inplace.data.ptr, COUNT, datatype, root, s.ptr)
            checks.append((inplace, rank_values(root, 0, datatype), 0))
    s.synchronize()
    with s:
        for got, want, op in checks:
            check(got.get(), want, datatype, op)
    comm.destroy()


def test_in_place_reduce_scatter_and_all_gather(cupy, nccl, world, my_gpu, unique_id):
    """usage/inplace.html: ncclReduceScatter(data, data + rank*recvcount, ...) and
    ncclAllGather(data + rank*sendcount, data, ...) are in place (the ZeRO flat buffer)."""
    n, me = world.size, world.rank
    comm = nccl.NcclCommunicator(n, unique_id(), me)
    flat = cupy.asarray(np.arange(COUNT * n, dtype=np.float32) + me)
    stream = cupy.cuda.get_current_stream()
    shard = flat[me * COUNT:(me + 1) * COUNT]
    comm.reduceScatter(flat.data.ptr, shard.data.ptr, COUNT, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       stream.ptr)
    expected = n * np.arange(COUNT * n, dtype=np.float32) + sum(range(n))
    np.testing.assert_array_equal(shard.get(), expected[me * COUNT:(me + 1) * COUNT])
    shard *= 2
    comm.allGather(shard.data.ptr, flat.data.ptr, COUNT, nccl.NCCL_FLOAT32, stream.ptr)
    np.testing.assert_array_equal(flat.get(), 2 * expected)
    comm.destroy()


def test_send_recv_in_a_group(cupy, nccl, world, my_gpu, unique_id):
    """usage/p2p.html "Sendrecv": send to the next rank and receive from the previous one in one
    group (each alone would block); sends to oneself are allowed."""
    n, me = world.size, world.rank
    comm = nccl.NcclCommunicator(n, unique_id(), me)
    stream = cupy.cuda.get_current_stream().ptr
    mine = cupy.full(COUNT, me, cupy.int64)
    left, own = cupy.zeros(COUNT, cupy.int64), cupy.zeros(COUNT, cupy.int64)
    nccl.groupStart()
    comm.send(mine.data.ptr, COUNT, nccl.NCCL_INT64, (me + 1) % n, stream)
    comm.recv(left.data.ptr, COUNT, nccl.NCCL_INT64, (me - 1) % n, stream)
    comm.send(mine.data.ptr, COUNT, nccl.NCCL_INT64, me, stream)
    comm.recv(own.data.ptr, COUNT, nccl.NCCL_INT64, me, stream)
    nccl.groupEnd()
    assert left.get().tolist() == [(me - 1) % n] * COUNT
    assert own.get().tolist() == [me] * COUNT
    comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_a_send_waits_for_its_receive(cupy, nccl, world, my_gpu, unique_id):
    """api/p2p.html, ncclSend: "This operation is blocking for the GPU. If multiple ncclSend()
    and ncclRecv() operations need to progress concurrently to complete, they must be fused
    within a ncclGroupStart()/ncclGroupEnd() section": rank 0's send stays unfinished on its
    stream until rank 1 receives, however small (two ranks each sending before receiving, in
    groups of their own, deadlock on a GPU)."""
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    stream = cupy.cuda.get_current_stream()
    if world.rank == 0:
        x = cupy.full(COUNT, 7, cupy.int64)
        nccl.groupStart()
        comm.send(x.data.ptr, COUNT, nccl.NCCL_INT64, 1, stream.ptr)
        nccl.groupEnd()
        done = stream.record()
        time.sleep(0.3)
        unfinished = not done.done
        world.Barrier()  # rank 1 receives only now
        done.synchronize()
        assert unfinished, "the send finished before its receive was posted"
    elif world.rank == 1:
        got = cupy.zeros(COUNT, cupy.int64)
        world.Barrier()
        nccl.groupStart()
        comm.recv(got.data.ptr, COUNT, nccl.NCCL_INT64, 0, stream.ptr)
        nccl.groupEnd()
        assert got.get().tolist() == [7] * COUNT
    else:
        world.Barrier()
    comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_two_ranks_on_one_gpu(cupy, nccl, world, unique_id, knobs):
    """gpu_facts.md 2: NCCL 2.5-2.29 refuse two ranks of one communicator on one GPU with
    ncclInvalidUsage (5); from 2.30 NCCL_MULTI_RANK_GPU_ENABLE=1 allows it; 2.30 without the
    variable still refuses."""
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(world.size, unique_id(), world.rank)  # every rank on device 0
    assert info.value.status == 5
    knobs(META_DIST_STANDIN_NCCL_VERSION="2.32.3")
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    assert info.value.status == 5
    knobs(NCCL_MULTI_RANK_GPU_ENABLE="1")
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    x = cupy.ones(4, cupy.float32)
    comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                   cupy.cuda.get_current_stream().ptr)
    assert x.get().tolist() == [world.size] * 4
    comm.destroy()


@pytest.mark.mpi(min_size=3)
def test_communicator_of_some_ranks_only(cupy, nccl, world, my_gpu):
    """NCCL init involves only the ranks of the communicator (usage/communicators.html): ranks
    0 and 1 build one, in reversed rank order, while the other ranks do nothing."""
    uid = world.bcast(nccl.get_unique_id() if world.rank == 0 else None)
    if world.rank < 2:
        comm = nccl.NcclCommunicator(2, uid, 1 - world.rank)
        x = cupy.full(3, 10 * world.rank + 1, cupy.int32)
        out = cupy.zeros(6, cupy.int32)
        comm.allGather(x.data.ptr, out.data.ptr, 3, nccl.NCCL_INT32,
                       cupy.cuda.get_current_stream().ptr)
        assert out.get().tolist() == [11] * 3 + [1] * 3  # NCCL rank 0 is world rank 1
        comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_missing_peer_hangs_until_abort(cupy, nccl, world, my_gpu, unique_id):
    """usage/operations.html: a collective some rank never calls makes the others wait
    indefinitely; there is no timeout. ncclCommAbort (api/comms.html) ends the wait; the
    communicator then fails every call (CuPy passes a NULL comm: invalid argument)."""
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    x = cupy.ones(4, cupy.float32)
    s = cupy.cuda.Stream(non_blocking=True)
    s.wait_event(cupy.cuda.get_current_stream().record())
    if world.rank != world.size - 1:  # the last rank never joins
        comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
        done = s.record()
        time.sleep(0.3)
        assert not done.done
        comm.check_async_error()  # NCCL reports nothing: it just waits
        comm.abort()
        done.synchronize()
        with pytest.raises(nccl.NcclError) as info:
            comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, 0, s.ptr)
        assert info.value.status == 4
    else:
        comm.abort()
    fresh = nccl.NcclCommunicator(world.size, unique_id(), world.rank)  # recovery: a new one
    fresh.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
    s.synchronize()
    fresh.destroy()


@pytest.mark.mpi(min_size=2)
def test_injected_hang_and_mismatch(cupy, nccl, world, my_gpu, unique_id, knobs):
    """Knob META_DIST_STANDIN_NCCL_HANG: rank 1's first call never completes, so nobody's does;
    a peer calling a different collective (here another count) is reported through
    check_async_error (status 5, stricter than NCCL, which would hang or corrupt data)."""
    knobs(META_DIST_STANDIN_NCCL_HANG="1:1")
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    stream = cupy.cuda.get_current_stream()
    x = cupy.ones(8, cupy.float32)
    comm.allReduce(x.data.ptr, x.data.ptr, 8, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    done = stream.record()
    time.sleep(0.3)
    assert not done.done
    comm.abort()
    done.synchronize()
    world.Barrier()
    knobs(META_DIST_STANDIN_NCCL_HANG=None)
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    count = 8 if world.rank == 0 else 4
    comm.allReduce(x.data.ptr, x.data.ptr, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    done = stream.record()
    deadline = time.monotonic() + 10
    status = None
    while status is None and time.monotonic() < deadline:
        try:
            comm.check_async_error()
        except nccl.NcclError as error:
            status = error.status
        time.sleep(0.01)
    assert status == 5 and not done.done
    comm.abort()
    done.synchronize()


def test_nccl_stream_must_wait_for_compute(cupy, nccl, world, my_gpu, unique_id, knobs):
    """usage/streams.html and the overlap recipe of gpu_facts.md 5: the NCCL stream must wait
    for an event recorded on the compute stream after the gradients were written, and the
    compute stream for the NCCL stream's done event before reading the result. Forgetting
    the first is a race error; with the detector off NCCL reads stale gradients."""
    n = world.size
    comm = nccl.NcclCommunicator(n, unique_id(), world.rank)
    compute, side = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with compute:
        grads = cupy.zeros(16, cupy.float32)
    compute.synchronize()
    with compute:
        grads += 1
    with pytest.raises(cupy.StandinRaceError):
        comm.allReduce(grads.data.ptr, grads.data.ptr, 16, 7, 0, side.ptr)
    side.wait_event(compute.record())
    comm.allReduce(grads.data.ptr, grads.data.ptr, 16, 7, 0, side.ptr)
    with compute, pytest.raises(cupy.StandinRaceError):
        grads.get()  # the result, read without compute.wait_event(side.record())
    compute.wait_event(side.record())
    with compute:
        assert grads.get().tolist() == [n] * 16
    knobs(META_DIST_STANDIN_RACES="off")
    with compute:
        compute.launch_host_func(lambda _: time.sleep(0.3), None)
        grads[...] = 1
    comm.allReduce(grads.data.ptr, grads.data.ptr, 16, 7, 0, side.ptr)  # no wait: stale input
    compute.wait_event(side.record())
    with compute:
        assert grads.get().tolist() == [1] * 16  # n*n from the stale n, then overwritten by 1
    side.synchronize()
    comm.destroy()


@pytest.mark.mpi(min_size=3)
def test_bfloat16_partial_sums_are_rounded(cupy, nccl, world, my_gpu, unique_id):
    """gpu_facts.md 7: intermediate results are kept in the element type, so bf16 sums across
    ranks lose precision: 256 + 1 + 1 in rank order stays 256 (exactly: 258)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    value = {0: 256.0}.get(world.rank, 1.0 if world.rank < 3 else 0.0)
    x = cupy.asarray(np.array([value], ml_dtypes.bfloat16))
    comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM,
                   cupy.cuda.get_current_stream().ptr)
    assert float(x.get()[0]) == 256.0
    comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_float16_avg_premultiplies_and_does_not_overflow(cupy, nccl, world, my_gpu, unique_id):
    """ncclAvg on floats is ncclDevPreMulSum with 1/nranks (src/enqueue.cc, hostToDevRedOp):
    40000 on every rank averages to 40000 in float16, where the sum (>= 80000) is inf."""
    n = world.size
    comm = nccl.NcclCommunicator(n, unique_id(), world.rank)
    s = cupy.cuda.Stream(non_blocking=True)
    x = cupy.full(8, 40000, cupy.float16)
    out, total = cupy.zeros_like(x), cupy.zeros_like(x)
    s.wait_event(cupy.cuda.get_current_stream().record())
    comm.allReduce(x.data.ptr, out.data.ptr, 8, nccl.NCCL_FLOAT16, nccl.NCCL_AVG, s.ptr)
    comm.allReduce(x.data.ptr, total.data.ptr, 8, nccl.NCCL_FLOAT16, nccl.NCCL_SUM, s.ptr)
    s.synchronize()
    scale = np.float16(1.0 / n)
    want = np.float16(0)
    for _ in range(n):  # premultiplied in float16, summed in rank order in float16
        want = np.float16(want + np.float16(np.float16(40000) * scale))
    np.testing.assert_array_equal(out.get(), np.full(8, want, np.float16))
    assert abs(float(want) - 40000) < 40 and np.isinf(total.get()).all()
    comm.destroy()


@pytest.mark.mpi(min_size=2)
def test_comm_split(cupy, nccl, world, my_gpu, unique_id):
    """ncclCommSplit (api/comms.html): ranks of one color form a communicator ranked by key."""
    comm = nccl.NcclCommunicator(world.size, unique_id(), world.rank)
    child = comm.commSplit(world.rank % 2, -world.rank)
    members = [r for r in range(world.size) if r % 2 == world.rank % 2]
    assert child.size() == len(members)
    assert child.rank_id() == sorted(members, reverse=True).index(world.rank)
    x = cupy.full(2, world.rank, cupy.int64)
    child.allReduce(x.data.ptr, x.data.ptr, 2, nccl.NCCL_INT64, nccl.NCCL_SUM,
                    cupy.cuda.get_current_stream().ptr)
    assert x.get().tolist() == [sum(members)] * 2
    child.destroy()
    comm.destroy()
