"""Every collective x dtype x op against a numpy reference built from every rank's input.

Each rank's input is drawn from a generator seeded by (test, rank), so every rank can compute
the reference for all ranks locally, with no extra communication. Integer results and max/min
must match exactly. Floating sums and products may add in another order than the reference
(the library picks the order), so they match within (size) units of rounding of the largest
partial result: rtol = atol = 4 * size * eps(dtype), relative to max |input|**k.
Sizes include odd lengths; the "pairwise" reducer takes the pairwise exchange at every size.
"""

import functools
import time
import warnings

import numpy as np
import pytest
from conftest import same_on_every_rank

from meta_dist import contiguous_arrays, make_communicator

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
try:  # bfloat16 where ml_dtypes supplies it (MPI has none: it travels as raw 16 bits)
    import ml_dtypes

    DTYPES.append("bfloat16")
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    BFLOAT16 = None


def is_float(dtype):
    return np.dtype(dtype).kind == "f" or np.dtype(dtype) == BFLOAT16


def eps(dtype):
    return float(ml_dtypes.finfo(dtype).eps) if np.dtype(dtype) == BFLOAT16 else float(
        np.finfo(dtype).eps)
OPS = ["sum", "avg", "max", "min", "prod"]
LENGTHS = [1, 7, 1001, 70001]


@pytest.fixture(params=["library", "pairwise"])
def reducer(request, connector):
    """The MPI communicator as shipped, and one that takes the pairwise path at every size."""
    force = {"allreduce": 1, "reduce_scatter": 1} if request.param == "pairwise" else None
    communicator = make_communicator("mpi", connector, pairwise_min_bytes=force)
    yield communicator
    communicator.close()


def rank_input(seed, rank, shape, dtype, op="sum"):
    rng = np.random.default_rng([seed, rank])
    dtype = np.dtype(dtype)
    if is_float(dtype):
        low, high = (0.5, 1.5) if op == "prod" else (-1.0, 1.0)
        return rng.uniform(low, high, shape).astype(dtype)
    high = 3 if op == "prod" else 100
    return rng.integers(0, high, shape).astype(dtype)


def reference(inputs, op):
    dtype = inputs[0].dtype
    if op in ("max", "min"):
        return functools.reduce(np.fmax if op == "max" else np.fmin, inputs)  # NaN skipped
    wide = np.float64 if is_float(dtype) else dtype  # ints wrap exactly like the library
    acc = inputs[0].astype(wide)
    for x in inputs[1:]:
        acc = acc * x if op == "prod" else acc + x
    if op == "avg":
        acc = acc / len(inputs)
    return acc.astype(dtype)


def assert_matches(got, ref, size):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if not is_float(got.dtype):
        np.testing.assert_array_equal(got, ref)
        return
    tol = 4 * size * eps(got.dtype)
    np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64),
                               rtol=tol, atol=tol * max(1.0, float(np.abs(
                                   ref.astype(np.float64)).max(initial=0))))


def valid(op, dtype):
    return not (op == "avg" and not is_float(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce(reducer, connector, dtype, op):
    comm = reducer
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype (tested in test_errors)")
    for n in LENGTHS:
        inputs = [rank_input(n, r, (n,), dtype, op) for r in range(comm.size)]
        ref = reference(inputs, op)
        mine = inputs[comm.rank].copy()
        assert_matches(comm.allreduce(mine, op), ref, comm.size)
        np.testing.assert_array_equal(mine, inputs[comm.rank])  # out of place: input untouched
        got = comm.allreduce(mine, op, out=mine)
        assert got is mine
        assert_matches(mine, ref, comm.size)
        assert same_on_every_rank(connector, mine)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if is_float(d)])
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_skip_nan_whichever_rank_holds_it(reducer, connector, dtype, op):
    """NaN is skipped, as NCCL does: it stays only where every rank has one (the libraries'
    MPI_MAX kept or dropped it by which rank held it, and MPICH by where it lay)."""
    comm = reducer
    for n in (4, 1001):
        for holder in range(comm.size):
            inputs = [rank_input(n, r, (n,), dtype) for r in range(comm.size)]
            inputs[holder][::2] = np.nan  # one rank's NaN: skipped
            for x in inputs:
                x[::4] = np.nan  # every rank's NaN: kept
            with np.errstate(invalid="ignore"):  # ml_dtypes' bfloat16 fmax warns on NaN
                ref = reference(inputs, op)
            got = comm.allreduce(inputs[comm.rank], op)
            np.testing.assert_array_equal(got.astype(np.float64), ref.astype(np.float64))
            if comm.size > 1:  # the test means something: only the shared NaN are left
                assert np.isnan(got.astype(np.float64)).sum() == len(range(0, n, 4))
            at_root = comm.reduce(inputs[comm.rank], holder, op)
            if comm.rank == holder:
                np.testing.assert_array_equal(at_root.astype(np.float64),
                                              ref.astype(np.float64))
            assert same_on_every_rank(connector, got)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_ties_give_every_rank_the_same_bits(reducer, connector, dtype, op):
    """+0.0 against -0.0, and nan against -nan (0/0 gives -nan on x86), tie in fmax and fmin,
    which return their first argument; MPICH hands a commutative op its operands in either
    order, so one allreduce left +0.0 on some ranks and -0.0 on others."""
    comm = reducer
    for n in (1, 7, 1001):
        i = np.arange(n)
        signs = np.where((i + comm.rank) % 2, -1.0, 1.0)  # each element's sign differs by rank
        mine = np.copysign(np.where(i % 3 == 0, np.nan, 0.0), signs).astype(dtype)
        got = comm.allreduce(mine, op)
        np.testing.assert_array_equal(got.astype(np.float64), np.where(i % 3 == 0, np.nan, 0.0))
        assert same_on_every_rank(connector, got), f"{n} elements: the ranks' bits differ"


@pytest.mark.mpi(min_size=2)
def test_float16_avg_fits_where_the_mean_fits(reducer, connector):
    """avg of float16 values near its largest (65504) is their mean, as ncclAvg gives: the
    sum of the ranks' values overflowed to inf first (fp16 gradients under a loss scale, so
    N ranks skipped steps that one process trained)."""
    comm = reducer
    n = 1001
    inputs = [np.full(n, 40000 + 8 * r, np.float16) for r in range(comm.size)]
    ref = reference(inputs, "avg")
    mine = inputs[comm.rank].copy()
    assert_matches(comm.allreduce(mine, "avg"), ref, comm.size)
    np.testing.assert_array_equal(mine, inputs[comm.rank])  # out of place: input untouched
    assert_matches(comm.allreduce(mine, "avg", out=mine), ref, comm.size)
    rows = np.concatenate([inputs[comm.rank]] * comm.size)
    assert_matches(comm.reduce_scatter(rows, "avg"), ref, comm.size)
    np.testing.assert_array_equal(rows, np.concatenate([inputs[comm.rank]] * comm.size))
    at_root = comm.reduce(inputs[comm.rank], 0, "avg")
    if comm.rank == 0:
        assert_matches(at_root, ref, comm.size)
    assert same_on_every_rank(connector, mine)


def test_many_communicators_take_max_and_min(connector):
    """The NaN-skipping ops are MPI user-defined ops, of which a process may hold 32 (mpi4py):
    made per communicator, the sixth communicator's max failed."""
    comms = [make_communicator("mpi", connector) for _ in range(8)]
    try:
        for comm in comms:
            for dtype in ("float16", "float32", "float64"):
                for op in ("max", "min"):
                    got = comm.allreduce(np.full(3, comm.rank, dtype), op)
                    np.testing.assert_array_equal(got, comm.size - 1 if op == "max" else 0)
    finally:
        for comm in comms:
            comm.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter(reducer, connector, dtype, op):
    comm = reducer
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for m in (1, 5, 40001):
        n = m * comm.size
        inputs = [rank_input(m, r, (n,), dtype, op) for r in range(comm.size)]
        ref = reference(inputs, op)[comm.rank * m:(comm.rank + 1) * m]
        assert_matches(comm.reduce_scatter(inputs[comm.rank], op), ref, comm.size)
        buf = inputs[comm.rank].copy()
        part = buf[comm.rank * m:(comm.rank + 1) * m]
        comm.reduce_scatter(buf, op, out=part)  # in place: my rows of the send buffer
        assert_matches(part, ref, comm.size)
        mine = np.s_[comm.rank * m:(comm.rank + 1) * m]  # the other rows are left as they were
        assert np.delete(buf, mine).tobytes() == np.delete(inputs[comm.rank], mine).tobytes()


def test_reduce_scatter_rows(comm):
    inputs = [rank_input(3, r, (comm.size * 2, 3, 2), "float64") for r in range(comm.size)]
    got = comm.reduce_scatter(inputs[comm.rank])
    assert got.shape == (2, 3, 2)
    assert_matches(got, reference(inputs, "sum")[comm.rank * 2:comm.rank * 2 + 2], comm.size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm, dtype):
    check_allgather(comm, dtype)


def check_allgather(comm, dtype):
    """Out of place and in place (send = out[rank*m:(rank+1)*m]) against np.concatenate."""
    for m in (1, 3, 20001):
        inputs = [rank_input(m, r, (m, 2), dtype) for r in range(comm.size)]
        np.testing.assert_array_equal(comm.allgather(inputs[comm.rank]), np.concatenate(inputs))
        out = np.zeros((m * comm.size, 2), dtype)
        out[comm.rank * m:(comm.rank + 1) * m] = inputs[comm.rank]
        comm.allgather(out[comm.rank * m:(comm.rank + 1) * m], out=out)  # in place
        np.testing.assert_array_equal(out, np.concatenate(inputs))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(comm, dtype):
    for root in range(comm.size):
        for n in (1, 1001, 70001):
            inputs = [rank_input(n + root, r, (n,), dtype) for r in range(comm.size)]
            np.testing.assert_array_equal(comm.broadcast(inputs[comm.rank], root), inputs[root])
            buf = inputs[comm.rank].copy()
            assert comm.broadcast(buf, root, out=buf) is buf
            np.testing.assert_array_equal(buf, inputs[root])


def test_a_numpy_integer_is_a_root(comm):
    """np.argmax gives np.int64: it used to overflow (a RuntimeWarning) in the cross-rank
    fingerprint, which fails the call on any rank that treats warnings as errors."""
    root = np.argmax(np.arange(comm.size))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = comm.broadcast(np.full(3, float(comm.rank)), root)
        total = comm.reduce(np.ones(3), root)
    np.testing.assert_array_equal(got, np.full(3, comm.size - 1.0))
    if comm.rank == root:
        np.testing.assert_array_equal(total, np.full(3, comm.size))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduce(comm, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for root in range(comm.size):
        inputs = [rank_input(root, r, (1001,), dtype, op) for r in range(comm.size)]
        got = comm.reduce(inputs[comm.rank], root, op)
        if comm.rank == root:
            assert_matches(got, reference(inputs, op), comm.size)
        else:
            assert got is None


@pytest.mark.parametrize("kind", [list, tuple])
def test_a_given_out_list_is_what_comes_back(comm, kind):
    """``out`` given as a list (or tuple) is returned itself, as the docstrings say, blocking
    and async, in place and not; out=None gives a list."""
    n, m = comm.size, 3
    sends = [rank_input(i, comm.rank, (n * m,), "float64") for i in range(2)]
    parts = kind(np.empty(m) for _ in sends)
    whole = kind(np.empty(n * m) for _ in sends)
    mine = kind(s[comm.rank * m:(comm.rank + 1) * m] for s in sends)
    assert comm.allreduce(sends, out=whole) is whole
    assert comm.reduce_scatter(sends, out=parts) is parts
    assert comm.allgather(mine, out=whole) is whole
    assert comm.broadcast(sends, out=whole) is whole
    assert comm.allreduce_async(sends, out=whole).wait() is whole
    inplace = kind(sends)
    assert comm.allreduce(inplace, out=inplace) is inplace
    assert comm.broadcast(inplace, out=inplace) is inplace
    assert comm.reduce(inplace, 0, out=inplace) is (inplace if comm.rank == 0 else None)
    assert comm.reduce(sends, 0, out=whole) is (whole if comm.rank == 0 else None)
    assert comm.reduce_scatter_async(sends, out=parts).wait() is parts
    assert comm.allgather_async(mine, out=whole).wait() is whole
    if comm.size > 1 and comm.rank < 2:
        if comm.rank == 0:
            comm.send(kind([np.full(n * m, 7.0), np.full(n * m, 8.0)]), 1)
        else:
            assert comm.recv(whole, 0) is whole
            np.testing.assert_array_equal(np.stack(whole), [[7.0] * n * m, [8.0] * n * m])
    assert type(comm.allreduce(inplace)) is list


def test_memmaps_are_numpy_arrays_here(comm, tmp_path):
    """np.memmap (an ndarray subclass) is taken as out and in a list beside plain arrays (it
    was refused as 'another kind of array', told to move to the host or GPU)."""
    mapped = np.memmap(tmp_path / f"out-{comm.rank}.bin", np.float32, "w+", shape=(6,))
    x = np.arange(6, dtype=np.float32) + comm.rank
    ref = comm.size * np.arange(6) + comm.size * (comm.size - 1) / 2
    assert comm.allreduce(x, out=mapped) is mapped
    np.testing.assert_array_equal(mapped, ref)
    got = comm.allreduce([x, mapped])
    np.testing.assert_array_equal(got[1], comm.size * ref)
    plain = x.copy()
    assert comm.allreduce([plain, mapped], out=[plain, mapped])[1] is mapped
    np.testing.assert_array_equal(plain, ref)
    mapped[...], plain[...] = x, x
    comm.allreduce([mapped, plain], out=[mapped, plain])  # a memmap first: unpacked by copies
    np.testing.assert_array_equal(mapped, ref)
    np.testing.assert_array_equal(plain, ref)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather",
                                        "broadcast", "reduce"])
def test_fused_list_equals_one_call_per_array(comm, collective):
    """A list is fused into one buffer; the result equals one call per array."""
    shapes = [(comm.size * 3,), (comm.size, 5), (comm.size * 2, 2, 2), (comm.size,)]
    arrays = [rank_input(i, comm.rank, s, "float64") for i, s in enumerate(shapes)]
    run = {"allreduce": lambda a: comm.allreduce(a),
           "reduce_scatter": lambda a: comm.reduce_scatter(a),
           "allgather": lambda a: comm.allgather(a),
           "broadcast": lambda a: comm.broadcast(a, root=comm.size - 1),
           "reduce": lambda a: comm.reduce(a, root=0)}[collective]
    fused = run(arrays)
    one_by_one = [run(a) for a in arrays]
    if fused is None:
        assert all(x is None for x in one_by_one)
        return
    assert isinstance(fused, list) and len(fused) == len(arrays)
    for f, o in zip(fused, one_by_one, strict=True):
        np.testing.assert_array_equal(f, o)


def test_fused_list_in_place(comm):
    arrays = [np.full(n, comm.rank + 1.0) for n in (3, 1, 4)]
    result = comm.allreduce(arrays, out=arrays)
    total = comm.size * (comm.size + 1) / 2
    assert all(r is a for r, a in zip(result, arrays, strict=True))
    assert all(np.all(a == total) for a in arrays)


def test_non_contiguous_input_is_copied(comm):
    x = np.arange(20.0).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(comm.allreduce(x), x * comm.size)


def test_traffic_counts_bus_bytes(comm):
    """``comm.traffic``: each call's bytes per rank of the bandwidth-optimal algorithm."""
    n = comm.size
    comm.traffic.reset()
    x = np.ones(4 * n, np.float32)  # 16n bytes
    comm.allreduce(x)
    comm.reduce_scatter([x, x])
    comm.allgather(x[:4])
    comm.broadcast(x)
    comm.reduce(x, root=0)
    assert comm.traffic.calls == dict.fromkeys(
        ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"], 1)
    assert comm.traffic.bytes == {"allreduce": 2 * (n - 1) / n * 16 * n,
                                  "reduce_scatter": (n - 1) / n * 32 * n,
                                  "allgather": (n - 1) / n * 16 * n,
                                  "broadcast": 16 * n, "reduce": 16 * n}
    comm.traffic.reset()
    assert comm.traffic.total() == 0


def test_async_variants_return_handles(comm):
    a = np.full(100, comm.rank, np.float64)
    handles = [comm.allreduce_async(a), comm.allgather_async(a[:2]),
               comm.broadcast_async(a, root=0), comm.reduce_scatter_async(
                   np.ones(comm.size * 4)), comm.reduce_async(a, root=0)]
    total = comm.size * (comm.size - 1) / 2
    np.testing.assert_array_equal(handles[0].wait(), np.full(100, total))
    assert handles[1].wait().shape == (2 * comm.size,)
    np.testing.assert_array_equal(handles[2].wait(), np.zeros(100))
    np.testing.assert_array_equal(handles[3].wait(), np.full(4, float(comm.size)))
    result = handles[4].wait()
    assert (result is None) == (comm.rank != 0)
    # a blocking call after pending async work runs after it, in order on every rank
    h = comm.allreduce_async(np.ones(10))
    np.testing.assert_array_equal(comm.allreduce(np.ones(3)), np.full(3, comm.size))
    assert h.done()  # the blocking call queued behind it, so it has finished
    np.testing.assert_array_equal(h.wait(), np.full(10, comm.size))


@pytest.mark.mpi(min_size=2)
def test_send_recv_ping_pong_exact(comm):
    x = np.random.default_rng(7).standard_normal(2048).astype(np.float16)
    got = np.empty_like(x)
    if comm.rank == 0:
        comm.send(x, peer=1)
        comm.recv(got, peer=1)
        assert np.abs(got.astype(np.float64) - x).max() == 0
    elif comm.rank == 1:
        comm.recv(got, peer=0)
        comm.send(got, peer=0)


@pytest.mark.mpi(min_size=2)
def test_send_recv_fused_list(comm):
    if comm.rank == 0:
        comm.send([np.arange(3.0), np.ones((2, 2))], peer=comm.size - 1)
    elif comm.rank == comm.size - 1:
        a, b = comm.recv([np.empty(3), np.empty((2, 2))], peer=0)
        np.testing.assert_array_equal(a, np.arange(3.0))
        np.testing.assert_array_equal(b, np.ones((2, 2)))


def left_before_the_last_arrived(barrier, rank, size, allgather) -> list[int]:
    """Call ``barrier`` with the last rank 0.3 s late; return the ranks that left it before the
    last rank entered (one host: one clock)."""
    if rank == size - 1:
        time.sleep(0.3)
    entered = time.time()
    barrier()
    left = time.time()
    last_entered = allgather(entered)[-1]
    return [r for r, t in enumerate(allgather(left)) if t < last_entered]


@pytest.mark.mpi(min_size=2)
def test_barrier(comm, connector):
    """No rank leaves the barrier before the last one has entered it (a planted delay)."""
    early = left_before_the_last_arrived(comm.barrier, comm.rank, comm.size, connector.allgather)
    assert early == [], f"ranks {early} left the barrier before the last rank entered"


@pytest.mark.mpi(min_size=2)
def test_async_send_recv_exchange_does_not_deadlock(comm):
    """Both ranks start a large send to the other, then receive: MPI_Isend semantics."""
    if comm.rank > 1:
        return
    peer = 1 - comm.rank
    mine = np.full(1 << 20, comm.rank, np.float64)  # 8 MiB: beyond any eager limit
    got = np.empty_like(mine)
    sent = comm.send_async(mine, peer)
    received = comm.recv_async(got, peer)
    assert received.wait() is got
    assert sent.wait() is None
    np.testing.assert_array_equal(got, np.full(1 << 20, peer, np.float64))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "uint8"])
@pytest.mark.parametrize("op", ["sum", "max", "prod"])
def test_large_fused_list_in_place(reducer, connector, dtype, op):
    """A large list of separate arrays reduced in place (packed, one call, unpacked).

    Through the library and the pairwise exchange: odd lengths make the pairwise chunks uneven
    and cut arrays in the middle; new arrays each round, some at recycled ids, must never see
    another round's values.
    """
    comm = reducer
    sizes = [7, 40001, 1, 30011, 5, 20017, 3]
    for round_ in range(3):
        inputs = [[rank_input(round_ * 10 + i, r, (n,), dtype, op) for i, n in enumerate(sizes)]
                  for r in range(comm.size)]
        mine = [a.copy() for a in inputs[comm.rank]]
        result = comm.allreduce(mine, op, out=mine)
        assert all(r is m for r, m in zip(result, mine, strict=True))
        for i, got in enumerate(mine):
            assert_matches(got, reference([inputs[r][i] for r in range(comm.size)], op),
                           comm.size)
            assert same_on_every_rank(connector, got)
        again = [a.copy() for a in inputs[comm.rank]]  # new objects, maybe at recycled ids
        comm.allreduce(again, op, out=again)
        for a, b in zip(again, mine, strict=True):
            np.testing.assert_array_equal(a, b)


LAYOUT_SHAPES = {
    # one flat allreduce, packed or (adjacent) straight on the buffer: through the library
    "small": [(5,), (0,), (300,), (10, 7), (1,)],
    # through the pairwise exchange (forced at every size, in 800-byte segments), which cuts
    # arrays at the edges of the ranks' chunks and of the segments
    "pairwise": [(5,), (0,), (2000,), (10, 70), (301,), (1,), (30,)],
}
PAIRWISE = {"pairwise_min_bytes": {"allreduce": 1, "reduce_scatter": 1}, "segment_bytes": 800}


@pytest.fixture(params=["small", "pairwise"])
def list_case(request, connector):
    """(communicator, shapes of a list): the library's path, or the pairwise exchange's."""
    communicator = make_communicator(
        "mpi", connector, **(PAIRWISE if request.param == "pairwise" else {}))
    yield communicator, LAYOUT_SHAPES[request.param]
    communicator.close()


def _laid_out(layout, shapes, dtype):
    if layout == "adjacent":
        return contiguous_arrays(shapes, dtype)
    if layout == "reversed":  # adjacent in memory, but in the opposite order to the list
        return contiguous_arrays(shapes[::-1], dtype)[::-1]
    return [np.zeros(shape, dtype) for shape in shapes]


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("layouts", ["adjacent", "separate", "reversed", "by rank"])
def test_list_layouts_reduce_alike(list_case, connector, layouts, op):
    """In-place lists reduce right whatever their memory layout, even when the ranks' layouts
    differ ("by rank": even ranks adjacent, odd ranks separate), which must not change the MPI
    calls a rank makes; twice, so cached plans are reused."""
    comm, shapes = list_case
    layout = layouts if layouts != "by rank" else ("adjacent", "separate")[comm.rank % 2]
    mine = _laid_out(layout, shapes, np.float64)
    for round_ in range(2):
        inputs = [[rank_input(round_ * 10 + i, r, shape, np.float64, op)
                   for i, shape in enumerate(shapes)] for r in range(comm.size)]
        for a, x in zip(mine, inputs[comm.rank], strict=True):
            a[...] = x
        result = comm.allreduce(mine, op, out=mine)
        assert all(r is m for r, m in zip(result, mine, strict=True))
        for i, got in enumerate(mine):
            assert_matches(got, reference([inputs[r][i] for r in range(comm.size)], op),
                           comm.size)
            assert same_on_every_rank(connector, got)


@pytest.mark.mpi(min_size=2)
def test_list_in_place_on_some_ranks_only(list_case, connector):
    """Whether a rank reduces a list in place is its own choice, not part of the check: ranks
    that differ in it must still make the same MPI calls."""
    comm, shapes = list_case
    inputs = [[rank_input(i, r, shape, np.float64) for i, shape in enumerate(shapes)]
              for r in range(comm.size)]
    mine = [a.copy() for a in inputs[comm.rank]]
    got = comm.allreduce(mine, out=mine) if comm.rank % 2 == 0 else comm.allreduce(mine)
    for i, g in enumerate(got):
        assert_matches(g, reference([inputs[r][i] for r in range(comm.size)], "sum"), comm.size)
        assert same_on_every_rank(connector, g)
    if comm.rank % 2:
        for a, x in zip(mine, inputs[comm.rank], strict=True):
            np.testing.assert_array_equal(a, x)  # out of place: the inputs are untouched


@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
@pytest.mark.parametrize("layout", ["separate", "adjacent"])
def test_large_list_out_of_place(reducer, connector, dtype, op, layout):
    """Out of place, a large list is read from the inputs and written to new arrays (out=None)
    or to given ones; the inputs stay as they were. Through the pairwise exchange, odd sizes
    cut arrays at the chunk edges, 2-D arrays too."""
    comm = reducer
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    shapes = [(7,), (301, 13), (1,), (60001,), (5003,), (0,), (9, 1001)]
    mine = _laid_out(layout, shapes, dtype)
    for round_ in range(2):
        inputs = [[rank_input(round_ * 10 + i, r, shape, dtype, op)
                   for i, shape in enumerate(shapes)] for r in range(comm.size)]
        for a, x in zip(mine, inputs[comm.rank], strict=True):
            a[...] = x
        given = [np.full(shape, 99, dtype) for shape in shapes]
        for got in (comm.allreduce(mine, op), comm.allreduce(mine, op, out=given)):
            for i, g in enumerate(got):
                assert_matches(g, reference([inputs[r][i] for r in range(comm.size)], op),
                               comm.size)
                assert same_on_every_rank(connector, g)
        assert all(g is o for g, o in zip(got, given, strict=True))
        for a, x in zip(mine, inputs[comm.rank], strict=True):
            np.testing.assert_array_equal(a, x)


def test_large_new_results_are_reused_only_once_dropped(comm, connector):
    """Results of 1 MiB or more made for out=None are recycled (a fresh buffer costs page
    faults), but only once nothing refers to them: a result held whole or through a view keeps
    its values while later calls, on other values, reuse what was dropped."""
    n = 2**17 + 3  # float64: just over 1 MiB

    def inputs(seed):
        return [rank_input(seed, r, (n,), np.float64) for r in range(comm.size)]

    held_inputs, viewed_inputs = inputs(1), inputs(2)
    held = comm.allreduce(held_inputs[comm.rank])
    viewed = comm.allreduce(viewed_inputs[comm.rank])[3:]
    dropped = comm.allreduce(inputs(3)[comm.rank])
    address = dropped.ctypes.data
    del dropped
    for seed in (4, 5, 6):
        later_inputs = inputs(seed)
        later = comm.allreduce(later_inputs[comm.rank])
        assert later.ctypes.data == address  # the dropped result's memory, again
        assert not np.shares_memory(later, held) and not np.shares_memory(later, viewed)
        assert_matches(later, reference(later_inputs, "sum"), comm.size)
        del later
    assert_matches(held, reference(held_inputs, "sum"), comm.size)
    assert_matches(viewed, reference(viewed_inputs, "sum")[3:], comm.size)


def test_arrays_over_foreign_buffers(comm, connector):
    """Arrays whose memory a bytearray owns (np.frombuffer) end their .base chain at no array:
    the out-of-place list and reduce_scatter alias checks must still work on them."""
    shapes = [(40000,), (7,), (3000,)]  # packed, out of place
    inputs = [[rank_input(i, r, shape, np.float64) for i, shape in enumerate(shapes)]
              for r in range(comm.size)]
    mine = [np.frombuffer(bytearray(x.tobytes()), np.float64) for x in inputs[comm.rank]]
    outs = [np.frombuffer(bytearray(x.nbytes), np.float64) for x in mine]
    for i, got in enumerate(comm.allreduce(mine, out=outs)):
        assert_matches(got, reference([inputs[r][i] for r in range(comm.size)], "sum"), comm.size)
    send = np.frombuffer(bytearray(8 * 4 * comm.size), np.float64)
    send[...] = 1.0
    part = comm.reduce_scatter(send, out=np.frombuffer(bytearray(8 * 4), np.float64))
    np.testing.assert_array_equal(part, np.full(4, float(comm.size)))


@pytest.mark.parametrize("size", ["small", "large"])
def test_list_out_is_the_inputs_reordered(comm, connector, size):
    """out may name the input arrays in another order: every input is read before any output
    is written, as if the result went to fresh arrays."""
    shapes = [(4000,), (4000,)] if size == "small" else [(40000,), (40000,)]
    inputs = [[rank_input(i, r, shape, np.float64) for i, shape in enumerate(shapes)]
              for r in range(comm.size)]
    a, b = (x.copy() for x in inputs[comm.rank])
    got = comm.allreduce([a, b], out=[b, a])
    assert got[0] is b and got[1] is a
    for i, g in enumerate(got):
        assert_matches(g, reference([inputs[r][i] for r in range(comm.size)], "sum"), comm.size)
        assert same_on_every_rank(connector, g)


@pytest.mark.parametrize("kib", [1, 512, 20 * 1024])
def test_one_array_or_a_list_of_it_alike(comm, connector, kib):
    """[x] on some ranks and x on others is the same call: the same MPI calls, the same sums."""
    inputs = [rank_input(kib, r, (kib * 128,), np.float64) for r in range(comm.size)]
    mine = inputs[comm.rank].copy()
    if comm.rank % 2:
        got = comm.allreduce([mine], out=[mine])[0]
    else:
        got = comm.allreduce(mine, out=mine)
    assert got is mine
    assert_matches(got, reference(inputs, "sum"), comm.size)
    assert same_on_every_rank(connector, got)


def test_in_place_through_another_view_of_the_memory(comm, connector):
    """out=x[:] is x's memory under another object: in place, on every library path."""
    inputs = [rank_input(7, r, (3 * comm.size,), np.float64) for r in range(comm.size)]
    x = inputs[comm.rank].copy()
    got = comm.allreduce(x, out=x[:])
    assert_matches(got, reference(inputs, "sum"), comm.size)
    gathered = np.zeros(3 * comm.size * comm.size)
    mine = gathered[comm.rank * x.size : (comm.rank + 1) * x.size]
    mine[...] = x
    comm.allgather(mine[:], out=gathered[:])
    assert same_on_every_rank(connector, gathered)
    np.testing.assert_array_equal(gathered[comm.rank * x.size : (comm.rank + 1) * x.size], x)
    y = inputs[comm.rank].copy()
    total = comm.reduce(y, root=0, out=y[:])
    if comm.rank == 0:
        assert_matches(total, reference(inputs, "sum"), comm.size)


@pytest.mark.mpi(min_size=2)
def test_point_to_point_in_flight_beside_collectives(comm):
    """A send started before a collective must not be taken by the collective's internal
    exchanges (the pairwise reduce_scatter uses Sendrecv)."""
    message = np.full(1000, 7.0, np.float32)
    send = np.ones(comm.size * 65536, np.float32)  # 256 KiB: the pairwise reduce_scatter
    big = [np.ones(70000), np.ones(5), np.ones(30000)]  # a fused list
    if comm.rank == 0:
        sent = comm.send_async(message, peer=1)
        time.sleep(0.1)  # the message is on its way before the collectives start
    part = comm.reduce_scatter(send)
    comm.allreduce(big, out=big)
    if comm.rank == 1:
        np.testing.assert_array_equal(comm.recv(np.empty(1000, np.float32), peer=0), message)
    if comm.rank == 0:
        sent.wait()
    np.testing.assert_array_equal(part, np.full(65536, comm.size, np.float32))
    np.testing.assert_array_equal(big[1], np.full(5, comm.size))


def test_contiguous_arrays_are_views_of_one_buffer():
    arrays = contiguous_arrays([(2, 3), (0,), (4,)], np.float32)
    assert [a.shape for a in arrays] == [(2, 3), (0,), (4,)]
    assert all(a.dtype == np.float32 and a.flags.c_contiguous and not a.any() for a in arrays)
    assert arrays[0].base is arrays[2].base is not None
    assert np.shares_memory(arrays[0].base, arrays[2])
    arrays[2][0] = 5  # the element right after the first array's six
    assert arrays[0].base[6] == 5


@pytest.mark.mpi(min_size=2)
def test_async_sends_to_one_peer_arrive_in_order(comm):
    """Sends to a peer run in order (MPI's non-overtaking rule), headers paired with data."""
    if comm.rank == 0:
        handles = [comm.send_async(np.full(n, float(n)), peer=1) for n in (3, 200000, 5, 1)]
        for h in handles:
            h.wait()
    elif comm.rank == 1:
        outs = [np.empty(n) for n in (3, 200000, 5, 1)]
        received = [comm.recv_async(o, peer=0) for o in outs]
        for h, o in zip(received, outs, strict=True):
            assert h.wait() is o
            np.testing.assert_array_equal(o, np.full(o.size, float(o.size)))


def test_send_to_oneself_is_refused_at_once(comm):
    """MPI's blocking send to oneself waits for a receive the same thread never posts (64 MiB
    deadlocked until the stall timeout); PyTorch refuses it. Here too, before anything moves."""
    for call in (lambda: comm.send(np.ones(4), peer=comm.rank),
                 lambda: comm.recv(np.empty(4), peer=comm.rank),
                 lambda: comm.send_async([np.ones(2), np.ones(3)], peer=comm.rank)):
        with pytest.raises(ValueError, match=f"peer is this rank \\({comm.rank}\\); expected "
                                             "another rank.*copy the array instead"):
            call()
