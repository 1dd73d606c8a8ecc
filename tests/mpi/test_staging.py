"""Host staging of meta_dist.comm.staging, on numpy arrays through real MPI.

``HostStaging(force=True)`` stages numpy arrays exactly as it stages CuPy arrays (separate host
buffers, aliasing by identity), so the logic runs here without a GPU; ``cuda_aware=True`` hands
the arrays to the primitive as they are (what a CUDA-aware MPI gets). Either way the results
must be bit-identical to the unstaged MPI backend: the same numpy primitive runs on copies.
"""

import numpy as np
import pytest
from conftest import same_on_every_rank
from test_collectives import DTYPES, OPS, check_allgather, rank_input

from meta_dist.comm.mpi_backend import MpiCommunicator
from meta_dist.comm.staging import ENV_CUDA_AWARE, HostStaging, cuda_aware_requested

LENGTHS = [1, 7, 70001]  # 70001 float32/float64 elements take the pairwise path when staged
MODES = ["staged", "direct"]
# every dtype with sum (uint8 sums wrap: numpy reduces them), every op on one
DTYPE_OPS = [(d, "sum") for d in DTYPES] + [("float32", op) for op in OPS if op != "sum"]


def staged_communicator(connector, **staging):
    """Return an MPI communicator whose primitives go through HostStaging(**staging)."""
    comm = MpiCommunicator(connector)
    comm.staging = HostStaging(**staging)
    return comm


@pytest.fixture(params=MODES)
def scomm(request, connector):
    comm = staged_communicator(connector, force=True, cuda_aware=request.param == "direct")
    yield comm
    comm.close()


@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_allreduce(scomm, comm, connector, dtype, op):
    for n in LENGTHS:
        inputs = [rank_input(n, r, (n,), dtype, op) for r in range(comm.size)]
        mine = inputs[comm.rank].copy()
        unstaged = comm.allreduce(mine, op)
        np.testing.assert_array_equal(scomm.allreduce(mine, op), unstaged)
        np.testing.assert_array_equal(mine, inputs[comm.rank])  # out of place: input untouched
        assert scomm.allreduce(mine, op, out=mine) is mine
        np.testing.assert_array_equal(mine, unstaged)
        assert same_on_every_rank(connector, mine)


@pytest.mark.parametrize("dtype,op", [(d, "sum") for d in DTYPES] + [("float16", "avg")])
def test_reduce_scatter(scomm, comm, dtype, op):
    for m in (1, 5, 40001):
        inputs = [rank_input(m, r, (m * comm.size,), dtype, op) for r in range(comm.size)]
        rows = slice(comm.rank * m, (comm.rank + 1) * m)
        unstaged = comm.reduce_scatter(inputs[comm.rank], op)
        got = scomm.reduce_scatter(inputs[comm.rank], op)
        np.testing.assert_array_equal(got, unstaged)
        buf = inputs[comm.rank].copy()
        scomm.reduce_scatter(buf, op, out=buf[rows])  # in place: recv = send + rank*m
        np.testing.assert_array_equal(buf[rows], got)
        others = np.ones(buf.size, bool)
        others[rows] = False
        np.testing.assert_array_equal(buf[others], inputs[comm.rank][others])


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(scomm, dtype):
    check_allgather(scomm, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(scomm, dtype):
    for root in range(scomm.size):
        for n in (1, 70001):
            inputs = [rank_input(n + root, r, (n,), dtype) for r in range(scomm.size)]
            np.testing.assert_array_equal(scomm.broadcast(inputs[scomm.rank], root),
                                          inputs[root])
            buf = inputs[scomm.rank].copy()
            assert scomm.broadcast(buf, root, out=buf) is buf
            np.testing.assert_array_equal(buf, inputs[root])


@pytest.mark.parametrize("dtype,op", DTYPE_OPS)
def test_reduce(scomm, comm, dtype, op):
    for root in range(comm.size):
        inputs = [rank_input(root, r, (1001,), dtype, op) for r in range(comm.size)]
        unstaged = comm.reduce(inputs[comm.rank], root, op)
        got = scomm.reduce(inputs[comm.rank], root, op)
        buf = inputs[comm.rank].copy()
        in_place = scomm.reduce(buf, root, op, out=buf)
        if comm.rank != root:
            assert got is None and in_place is None
            continue
        np.testing.assert_array_equal(got, unstaged)
        assert in_place is buf
        np.testing.assert_array_equal(buf, unstaged)


def test_fused_lists(scomm):
    arrays = [rank_input(i, scomm.rank, (scomm.size * (i + 1),), "float64") for i in range(3)]
    total = [sum(rank_input(i, r, a.shape, "float64") for r in range(scomm.size))
             for i, a in enumerate(arrays)]
    for got, want in zip(scomm.allreduce(arrays), total, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)
    gathered = scomm.allgather(arrays)
    for i, g in enumerate(gathered):
        want = np.concatenate([rank_input(i, r, arrays[i].shape, "float64")
                               for r in range(scomm.size)])
        np.testing.assert_array_equal(g, want)


@pytest.mark.mpi(min_size=2)
def test_send_recv(scomm):
    x = rank_input(5, 0, (2048,), "float16")
    got = np.empty_like(x)
    if scomm.rank == 0:
        scomm.send(x, peer=1)
        scomm.recv(got, peer=1)
        np.testing.assert_array_equal(got, x)
    elif scomm.rank == 1:
        scomm.recv(got, peer=0)
        scomm.send(got, peer=0)


def test_aliasing_follows_identity_and_buffers_are_reused():
    staging = HostStaging(force=True)
    seen = []

    def fn(send, recv, op):
        seen.append((send is recv, send.ctypes.data, recv.ctypes.data))
        recv[...] = send[: recv.size] * 2

    a = np.arange(6.0)
    staging.run(fn, (a, a, "sum"), reads=(0,), writes=(1,))  # recv is send: one buffer
    np.testing.assert_array_equal(a, np.arange(6.0) * 2)
    assert seen[-1][0] and seen[-1][1] != a.ctypes.data  # a host copy, shared by both roles

    flat = np.arange(8.0)
    part = flat[2:4]  # overlaps send by pointer only: separate buffers, out-of-place result
    staging.run(fn, (flat, part, "sum"), reads=(0,), writes=(1,))
    assert not seen[-1][0] and seen[-1][1] != seen[-1][2]
    np.testing.assert_array_equal(flat, [0, 1, 0, 2, 4, 5, 6, 7])

    first = seen[-1][1:]
    staging.run(fn, (np.ones(8), np.empty(2), "sum"), reads=(0,), writes=(1,))
    assert seen[-1][1:] == first  # the same host memory, no new allocation
    staging.run(fn, (np.ones(100), np.empty(100), "sum"), reads=(0,), writes=(1,))
    assert seen[-1][1] != first[0]  # grown for a larger call
    staging.clear()


def test_nothing_wanted_without_force_or_device_arrays():
    staging = HostStaging()
    assert not staging.wanted((np.ones(3), np.ones(3), "sum"))
    assert HostStaging(force=True).wanted((np.ones(3), None, "sum", 0))


def test_cuda_aware_is_an_explicit_opt_in(monkeypatch, connector):
    """No probing of the library: staging unless META_DIST_CUDA_AWARE_MPI says otherwise, and
    the setting is one every rank must share (it decides which calls a collective makes)."""
    monkeypatch.delenv(ENV_CUDA_AWARE, raising=False)
    assert cuda_aware_requested() is False
    comm = MpiCommunicator(connector)
    assert comm.staging.cuda_aware is False
    comm.close()
    for value, expected in (("1", True), ("yes", True), ("0", False), ("off", False)):
        monkeypatch.setenv(ENV_CUDA_AWARE, value)
        assert cuda_aware_requested() is expected
    monkeypatch.setenv(ENV_CUDA_AWARE, "1")
    comm = MpiCommunicator(connector)
    assert comm.staging.cuda_aware is True
    comm.close()


@pytest.mark.mpi(min_size=2)
def test_cuda_aware_setting_must_agree(monkeypatch, connector):
    monkeypatch.setenv(ENV_CUDA_AWARE, "1" if connector.rank == 0 else "0")
    with pytest.raises(ValueError, match=r"settings differ across ranks.*cuda_aware_mpi"):
        MpiCommunicator(connector)
