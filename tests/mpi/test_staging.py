"""CuPy arrays through the MPI backend: packed into pinned host buffers, moved, unpacked.

The MPI wheels are not CUDA-aware, so every device array takes the path of a fused list
(``plans.Fusion`` with ``stages``): device-to-host copies fill a host buffer, the numpy
primitive runs on it, and host-to-device copies bring the result back. On the CuPy/NCCL
stand-in (tests/standin_tests/test_standin_gpu_side.py runs this file at 1-4 ranks) a device
array handed to MPI fails, an unfinished copy is read as garbage and a buffer rewritten under a
pending copy is a race: results equal to the numpy backend's, bit for bit, show none happened.
The CUDA-aware opt-in (META_DIST_CUDA_AWARE_MPI) is tested on any machine.
"""

import numpy as np
import pytest
from conftest import same_on_every_rank
from test_collectives import DTYPES, OPS, rank_input, valid
from test_nccl import another_gpu, any_gpu, cp  # noqa: F401 - the GPU tests' collective skips

from meta_dist import make_communicator
from meta_dist.comm.mpi_backend import ENV_CUDA_AWARE, MpiCommunicator, cuda_aware_requested

LENGTHS = [1, 7, 70001]  # 70001 uint8 elements take the pairwise allreduce (numpy reduces them)
DTYPE_OPS = [(d, "sum") for d in DTYPES] + [("float32", op) for op in OPS if op != "sum"]


@pytest.fixture
def scomm(connector, any_gpu):  # noqa: F811
    comm = make_communicator("mpi", connector)
    if comm.cuda_aware:
        comm.close()
        pytest.skip(f"{ENV_CUDA_AWARE} is set: device arrays go to MPI as they are")
    yield comm
    comm.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_allreduce(scomm, comm, any_gpu, dtype, op):  # noqa: F811
    for n in LENGTHS:
        inputs = [rank_input(n, r, (n,), dtype, op) for r in range(comm.size)]
        want = comm.allreduce(inputs[comm.rank], op)
        mine = any_gpu.asarray(inputs[comm.rank])
        np.testing.assert_array_equal(scomm.allreduce(mine, op).get(), want)
        np.testing.assert_array_equal(mine.get(), inputs[comm.rank])  # the input untouched
        out = any_gpu.zeros(n, dtype)
        assert scomm.allreduce(mine, op, out=out) is out
        assert scomm.allreduce(mine, op, out=mine) is mine
        for got in (out, mine):
            np.testing.assert_array_equal(got.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,op", [(d, "sum") for d in DTYPES] + [("float16", "avg")])
def test_reduce_scatter(scomm, comm, any_gpu, dtype, op):  # noqa: F811
    for m in (1, 5, 40001):
        inputs = [rank_input(m, r, (m * comm.size,), dtype, op) for r in range(comm.size)]
        rows = slice(comm.rank * m, (comm.rank + 1) * m)
        want = comm.reduce_scatter(inputs[comm.rank], op)
        np.testing.assert_array_equal(scomm.reduce_scatter(any_gpu.asarray(inputs[comm.rank]),
                                                           op).get(), want)
        buf = any_gpu.asarray(inputs[comm.rank])
        scomm.reduce_scatter(buf, op, out=buf[rows])  # in place: my rows of the input
        host = buf.get()
        np.testing.assert_array_equal(host[rows], want)
        others = np.ones(host.size, bool)
        others[rows] = False
        np.testing.assert_array_equal(host[others], inputs[comm.rank][others])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_and_broadcast(scomm, any_gpu, dtype):  # noqa: F811
    n, rank = scomm.size, scomm.rank
    for m in (1, 20001):
        inputs = [rank_input(m, r, (m, 2), dtype) for r in range(n)]
        want = np.concatenate(inputs)
        np.testing.assert_array_equal(scomm.allgather(any_gpu.asarray(inputs[rank])).get(), want)
        out = any_gpu.zeros((m * n, 2), dtype)
        out[rank * m:(rank + 1) * m] = any_gpu.asarray(inputs[rank])
        scomm.allgather(out[rank * m:(rank + 1) * m], out=out)  # in place
        np.testing.assert_array_equal(out.get(), want)
        for root in range(n):
            buf = any_gpu.asarray(inputs[rank])
            np.testing.assert_array_equal(scomm.broadcast(buf, root).get(), inputs[root])
            assert scomm.broadcast(buf, root, out=buf) is buf
            np.testing.assert_array_equal(buf.get(), inputs[root])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce(scomm, comm, any_gpu, dtype, op):  # noqa: F811
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for root in range(comm.size):
        inputs = [rank_input(root, r, (1001,), dtype, op) for r in range(comm.size)]
        want = comm.reduce(inputs[comm.rank], root, op)
        buf = any_gpu.asarray(inputs[comm.rank])
        got = scomm.reduce(buf, root, op)
        in_place = scomm.reduce(buf, root, op, out=buf)
        if comm.rank != root:
            assert got is None and in_place is None
            continue
        assert in_place is buf
        np.testing.assert_array_equal(got.get(), want)
        np.testing.assert_array_equal(buf.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather",
                                        "broadcast", "reduce"])
def test_fused_lists_equal_the_host_result(scomm, comm, any_gpu, collective):  # noqa: F811
    shapes = [(comm.size * 3,), (comm.size, 5), (comm.size * 2, 2, 2), (comm.size,)]
    arrays = [rank_input(i, comm.rank, s, "float64") for i, s in enumerate(shapes)]
    run = {"allreduce": lambda c, a: c.allreduce(a),
           "reduce_scatter": lambda c, a: c.reduce_scatter(a),
           "allgather": lambda c, a: c.allgather(a),
           "broadcast": lambda c, a: c.broadcast(a, root=comm.size - 1),
           "reduce": lambda c, a: c.reduce(a, root=0)}[collective]
    want = run(comm, arrays)
    got = run(scomm, [any_gpu.asarray(a) for a in arrays])
    if want is None:
        assert got is None
        return
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.get(), w)
    in_place = [any_gpu.asarray(a) for a in arrays]
    if collective == "allreduce":
        assert scomm.allreduce(in_place, out=in_place)[0] is in_place[0]
        for g, w in zip(in_place, want, strict=True):
            np.testing.assert_array_equal(g.get(), w)
            assert same_on_every_rank(comm.connector, g.get())


@pytest.mark.gpu
def test_zero_d_arrays_take_their_result(scomm, any_gpu):  # noqa: F811
    """A 0-d device array given as out (or in place, or to recv) takes its value from the host
    buffer: np.ascontiguousarray made the 0-d host part 1-d, and cupy's set refused it."""
    n, rank = scomm.size, scomm.rank
    total = n * (n + 1) / 2
    x = any_gpu.full((), rank + 1.0)
    assert scomm.allreduce(x, out=x) is x
    np.testing.assert_array_equal(x.get(), total)
    pair = [any_gpu.full((), rank + 1.0), any_gpu.full(2, rank + 1.0)]
    out = [any_gpu.zeros(()), any_gpu.zeros(2)]
    assert scomm.allreduce(pair, out=out) is out
    np.testing.assert_array_equal(out[0].get(), total)
    scomm.broadcast(pair, root=n - 1, out=pair)
    np.testing.assert_array_equal(pair[0].get(), float(n))
    y = any_gpu.full((), rank + 1.0)
    assert scomm.reduce(y, root=n - 1, out=y) is (y if rank == n - 1 else None)
    np.testing.assert_array_equal(y.get(), total if rank == n - 1 else rank + 1.0)
    if n > 1 and rank < 2:
        if rank == 0:
            scomm.send(any_gpu.full((), 7.0), peer=1)
        else:
            got = any_gpu.zeros(())
            assert scomm.recv(got, peer=0) is got
            np.testing.assert_array_equal(got.get(), 7.0)


@pytest.mark.gpu
def test_calls_back_to_back_never_overwrite_a_pending_copy(scomm, any_gpu):  # noqa: F811
    """Off the root a broadcast's host buffer is written by MPI, not packed: it must wait for
    the previous call's copy back to the device. The caller's stream is kept busy before each
    call, so on the stand-in that copy is still pending when the next one starts."""
    n = scomm.size
    for root in range(n):
        inputs = [rank_input(k + 10 * root, root, (3001,), "float32") for k in range(6)]
        results = []
        for x in inputs:
            if scomm.rank != root:
                busy = any_gpu.ones(4)
                for _ in range(60):
                    busy += 1
            mine = any_gpu.asarray(x) if scomm.rank == root else any_gpu.zeros(3001, "float32")
            results.append(scomm.broadcast(mine, root))
        for got, want in zip(results, inputs, strict=True):
            np.testing.assert_array_equal(got.get(), want)


@pytest.mark.gpu
def test_a_grown_buffer_outlives_the_copy_back_from_it(scomm, any_gpu, monkeypatch):  # noqa: F811
    """ndarray.set hands cudaMemcpyAsync the pinned buffer's address only (cupy/_core/core.pyx),
    and a freed pinned block goes back to CuPy's pinned memory pool for the next allocation of
    its size (cupy.cuda.PinnedMemoryPool): when a call needs a larger host buffer, the smaller
    one must stay referenced until the previous call's copy back from it has run. On the
    stand-in every stream operation here waits 20 ms, so that copy is still pending."""
    monkeypatch.setenv("META_DIST_STANDIN_DELAY_US", "20000:20000")
    small = scomm.allreduce(any_gpu.ones(10, "float32"))
    large = scomm.allreduce(any_gpu.ones(1000, "float32"))
    np.testing.assert_array_equal(small.get(), np.full(10, scomm.size, np.float32))
    np.testing.assert_array_equal(large.get(), np.full(1000, scomm.size, np.float32))


@pytest.mark.gpu
def test_async_collectives_and_a_blocking_one_behind_them(scomm, any_gpu):  # noqa: F811
    n = scomm.size
    a = any_gpu.full(100, float(scomm.rank))
    handles = [scomm.allreduce_async(a), scomm.reduce_scatter_async(any_gpu.ones(4 * n))]
    np.testing.assert_array_equal(scomm.allgather(any_gpu.ones(2)).get(), np.ones(2 * n))
    np.testing.assert_array_equal(handles[0].wait().get(), np.full(100, n * (n - 1) / 2))
    np.testing.assert_array_equal(handles[1].wait().get(), np.full(4, float(n)))


@pytest.mark.gpu
def test_staged_calls_run_on_the_arrays_gpu(scomm, connector, any_gpu):  # noqa: F811
    """A staged call made while another GPU is current runs on its arrays' GPU, and so do the
    calls after it: the communicator's stream was made on the device current at its first
    call, and every later call on another device failed. Arrays on the other GPU get that
    device's stream."""
    own = any_gpu.cuda.Device().id
    other = another_gpu(connector, own)
    x = any_gpu.full(100, float(scomm.rank + 1), any_gpu.float32)
    total = np.full(100, scomm.size * (scomm.size + 1) / 2, np.float32)
    with any_gpu.cuda.Device(other):
        got = scomm.allreduce(x)
    assert got.device.id == own
    np.testing.assert_array_equal(got.get(), total)
    np.testing.assert_array_equal(scomm.allreduce(x).get(), total)
    with any_gpu.cuda.Device(other):
        there = any_gpu.full(100, float(scomm.rank + 1), any_gpu.float32)
        result = scomm.allreduce(there)
        assert result.device.id == other
        np.testing.assert_array_equal(result.get(), total)


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_send_recv(scomm, any_gpu):  # noqa: F811
    x = any_gpu.asarray(rank_input(5, 0, (2048,), "float16"))
    parts = [any_gpu.arange(3.0), any_gpu.ones((2, 2))]
    if scomm.rank == 0:
        scomm.send(x, peer=1)
        got = scomm.recv(any_gpu.empty_like(x), peer=1)
        np.testing.assert_array_equal(got.get(), x.get())
        scomm.send(parts, peer=1)
    elif scomm.rank == 1:
        got = scomm.recv(any_gpu.empty_like(x), peer=0)
        scomm.send(got, peer=0)
        a, b = scomm.recv([any_gpu.empty(3), any_gpu.empty((2, 2))], peer=0)
        np.testing.assert_array_equal(a.get(), np.arange(3.0))
        np.testing.assert_array_equal(b.get(), np.ones((2, 2)))


def test_cuda_aware_is_an_explicit_opt_in(monkeypatch, connector):
    """No probing of the library: staging unless META_DIST_CUDA_AWARE_MPI says otherwise, and
    the setting is one every rank must share (it decides which calls a collective makes)."""
    monkeypatch.delenv(ENV_CUDA_AWARE, raising=False)
    assert cuda_aware_requested() is False
    comm = MpiCommunicator(connector)
    assert comm.cuda_aware is False and comm.fusion.stages is True
    comm.close()
    for value, expected in (("1", True), ("yes", True), ("0", False), ("off", False)):
        monkeypatch.setenv(ENV_CUDA_AWARE, value)
        assert cuda_aware_requested() is expected
    monkeypatch.setenv(ENV_CUDA_AWARE, "1")
    comm = MpiCommunicator(connector)
    assert comm.cuda_aware is True and comm.fusion.stages is False
    comm.close()


@pytest.mark.mpi(min_size=2)
def test_cuda_aware_setting_must_agree(monkeypatch, connector):
    monkeypatch.setenv(ENV_CUDA_AWARE, "1" if connector.rank == 0 else "0")
    with pytest.raises(ValueError, match=r"settings differ across ranks.*cuda_aware_mpi"):
        MpiCommunicator(connector)
