"""Bad input: every rank passes the same bad argument and all raise (meeting in the cross-rank
check first, where there is one), and the cross-rank mismatch, which every rank detects together.
A bad argument on some ranks only makes every rank raise: the others learn of it in the check."""

import re

import numpy as np
import pytest

from meta_dist import make_communicator


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_on_every_rank_naming_ranks(comm):
    x = np.ones(3 + comm.rank, np.float32)
    with pytest.raises(ValueError) as err:
        comm.allreduce(x)
    for r in range(comm.size):
        assert f"rank {r}: allreduce of float32 ({3 + r},)" in str(err.value)
    comm.barrier()
    np.testing.assert_array_equal(comm.allreduce(np.ones(2)), np.full(2, comm.size))  # usable


@pytest.mark.mpi(min_size=2)
def test_mismatched_dtype_and_collective(comm):
    x = np.ones(4, np.float32 if comm.rank == 0 else np.float64)
    with pytest.raises(ValueError, match="rank 0: allreduce of float32 .*rank 1: allreduce of "
                                         "float64"):
        comm.allreduce(x)
    with pytest.raises(ValueError, match="called different collectives"):
        if comm.rank == 0:
            comm.allreduce(np.ones(4))
        else:
            comm.broadcast(np.ones(4), root=0)


@pytest.mark.mpi(min_size=2)
def test_mismatch_is_caught_in_place_and_with_out(comm):
    """One numpy array in place or with out=: the check runs before anything moves."""
    r, n = comm.rank, comm.size
    x = np.arange(3.0 + r)
    with pytest.raises(ValueError, match=r"rank 0: allreduce of float64 \(3,\)"):
        comm.allreduce(x, out=x)
    np.testing.assert_array_equal(x, np.arange(3.0 + r))  # nothing moved
    send = np.ones(n * (2 + r))
    with pytest.raises(ValueError, match="rank 1: reduce_scatter of float64"):
        comm.reduce_scatter(send, out=np.empty(2 + r))
    with pytest.raises(ValueError, match="rank 1: allgather of float64"):
        comm.allgather(send[: 2 + r], out=np.empty(n * (2 + r)))
    y = np.full(4, float(r))
    with pytest.raises(ValueError, match="called different collectives"):
        comm.broadcast(y, root=r % 2, out=y)  # rank 0 says root 0, rank 1 root 1
    np.testing.assert_array_equal(y, np.full(4, float(r)))
    np.testing.assert_array_equal(comm.allreduce(y, out=y), np.full(4, n * (n - 1) / 2))


@pytest.mark.mpi(min_size=2)
def test_settings_that_shape_the_calls_must_agree(connector):
    """check, and the MPI backend's thresholds, decide which MPI calls a collective makes: a rank
    that differs would hang its peers, so every rank refuses the communicator at construction."""
    with pytest.raises(ValueError, match=r"settings differ across ranks.*check"):
        make_communicator("mpi", connector, check=connector.rank == 0)
    with pytest.raises(ValueError, match=r"settings differ across ranks.*segment_bytes"):
        make_communicator("mpi", connector, segment_bytes=4096 * (1 + connector.rank))
    agreed = make_communicator("mpi", connector, check=False, segment_bytes=8192)
    np.testing.assert_array_equal(agreed.allreduce(np.ones(3)), np.full(3, connector.size))
    agreed.close()


@pytest.mark.mpi(min_size=2)
def test_bad_argument_on_one_rank_raises_on_every_rank(comm):
    """Rank 1 alone passes a bad argument and catches its error: the others raise at once,
    naming the refusal, instead of waiting for rank 1 until the stall watchdog. On the general
    path, the single-array fast paths, and an async call; the communicator stays usable."""
    n, x = comm.size, np.ones(4 * comm.size)
    frozen = np.zeros_like(x)
    frozen.flags.writeable = False
    send = np.ones(4 * n)
    overlap = send[1:5] if comm.rank == 1 else send[4 * comm.rank:4 * (comm.rank + 1)]
    one = comm.rank == 1
    calls = [
        ("allreduce", lambda: comm.allreduce(x, out=frozen if one else None)),
        ("reduce_scatter", lambda: comm.reduce_scatter(send, out=overlap)),
        ("broadcast", lambda: comm.broadcast(x, root=n if one else 0, out=x)),
        ("allgather", lambda: comm.allgather(x[:4], out=np.empty(4 * n + one))),
        ("reduce", lambda: comm.reduce([x, x], op="mean" if one else "max")),
        ("allreduce", lambda: comm.allreduce([x, x], out=[None, None] if one else None)),
        ("allreduce", lambda: comm.allreduce(x, op=["sum"] if one else "sum", out=x)),
        ("allreduce", lambda: comm.allreduce_async(
            x, out=frozen if one else np.empty_like(x)).wait()),
    ]
    for api, call in calls:
        with pytest.raises((ValueError, TypeError)) as err:
            call()
        if one:
            assert "refused its arguments" not in str(err.value)  # its own, first-hand error
        else:
            assert re.search(rf"{api}: rank 1 refused its arguments.*rank 1: refused {api} "
                             r"\((ValueError|TypeError): ", str(err.value)), err.value
    np.testing.assert_array_equal(comm.allreduce(np.ones(3)), np.full(3, n))  # still usable


@pytest.mark.mpi(min_size=2)
def test_recv_of_wrong_shape_raises_and_drains(comm):
    if comm.rank == 0:
        comm.send(np.ones(8, np.float32), peer=1)
        comm.send(np.full(2, 5.0), peer=1)
    elif comm.rank == 1:
        with pytest.raises(ValueError, match="rank 0 sent 8 elements of float32 with other "
                                             "shapes; this rank"):
            comm.recv(np.empty(4, np.float16), peer=0)
        np.testing.assert_array_equal(comm.recv(np.empty(2), peer=0), [5.0, 5.0])


@pytest.mark.mpi(min_size=2)
def test_recv_names_only_what_differs_and_refuses_an_out_it_cannot_fill(comm):
    """A sender of the same shapes in another dtype is not said to send other shapes; a
    strided out is refused before anything is received (it used to receive into a copy and
    leave out unwritten), and the message then waits for a right one."""
    if comm.rank == 0:
        comm.send(np.ones(4, np.float32), peer=1)
        comm.send(np.arange(4.0), peer=1)
    elif comm.rank == 1:
        with pytest.raises(ValueError) as err:
            comm.recv(np.empty(4), peer=0)
        assert "rank 0 sent 4 elements of float32; this rank (1) expected 4 elements of " \
               "float64" in str(err.value)
        with pytest.raises(ValueError, match="recv: output buffer is not contiguous"):
            comm.recv(np.zeros((4, 2))[:, 0], peer=0)
        frozen = np.zeros(4)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="recv: output buffer is read-only"):
            comm.recv(frozen, peer=0)
        np.testing.assert_array_equal(comm.recv(np.empty(4), peer=0), np.arange(4.0))


@pytest.mark.mpi(min_size=2)
def test_a_barrier_meets_the_check_like_any_collective(comm):
    """A barrier where the others call allreduce used to hang until the stall watchdog (the
    barrier was not compared); now every rank raises at once, and a refusal on one rank while
    the others wait in a barrier reaches them too."""
    first = comm.rank == 0
    with pytest.raises(ValueError, match=r"calls differ in collective \(collective: rank 0 "
                                         r"'barrier', rank 1 'allreduce'.*rank 0: barrier; rank 1: "
                                         r"allreduce of float64 \(4,\)"):
        comm.barrier() if first else comm.allreduce(np.ones(4))
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only" if first else "barrier: rank 0 refused its "
                                                                    "arguments"):
        comm.allreduce(np.ones(4), out=frozen) if first else comm.barrier()
    comm.barrier()
    np.testing.assert_array_equal(comm.allreduce(np.ones(3)), np.full(3, comm.size))  # usable


def test_bad_arguments(comm):
    x = np.ones(4 * comm.size, np.float32)
    with pytest.raises(ValueError, match="unknown op; got 'mean', expected one of sum, avg"):
        comm.allreduce(x, op="mean")
    with pytest.raises(ValueError, match="op not supported here; got 'max'"):
        comm.reduce_scatter(x, op="max")
    with pytest.raises(TypeError, match="op 'avg' needs a floating dtype; got int32"):
        comm.allreduce(np.ones(3, np.int32), op="avg")
    with pytest.raises(ValueError, match=f"root out of range; got {comm.size}"):
        comm.broadcast(x, root=comm.size)
    with pytest.raises(ValueError, match="peer out of range; got -1"):
        comm.send(x, peer=-1)
    with pytest.raises(TypeError, match="unsupported dtype; got complex128"):
        comm.allreduce(np.ones(2, np.complex128))
    with pytest.raises(TypeError, match="share one dtype"):
        comm.allreduce([np.ones(2), np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="empty list"):
        comm.allreduce([])
    with pytest.raises(TypeError, match="expected a numpy or cupy array"):
        comm.allreduce([1.0, 2.0])


def test_out_is_send_with_the_wrong_shape(comm):
    """out=send is in place for allreduce, not for allgather or reduce_scatter, whose outputs
    have other shapes: every rank refuses it before communicating."""
    if comm.size == 1:
        pytest.skip("with one rank the shapes agree")
    x = np.ones(2 * comm.size)
    with pytest.raises(ValueError, match=r"out\[0\] has shape"):
        comm.allgather(x, out=x)
    with pytest.raises(ValueError, match=r"out\[0\] has shape"):
        comm.reduce_scatter(x, out=x)
    xs = [np.ones(2 * comm.size), np.ones(comm.size)]
    with pytest.raises(ValueError, match=r"out\[0\] has shape"):
        comm.reduce_scatter(xs, out=xs)
    with pytest.raises(ValueError, match=r"out\[0\] has shape"):
        comm.allgather(xs, out=xs)


def test_bad_output_buffers(comm):
    x = np.ones(4, np.float32)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce(x, out=frozen)
    with pytest.raises(ValueError, match="not contiguous"):
        comm.allreduce(x, out=np.zeros(8, np.float32)[::2])
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(5,\)"):
        comm.allreduce(x, out=np.zeros(5, np.float32))
    y = np.full(2, 7.0, np.float32)
    for out in (x, np.zeros(4, np.float32)):  # one array for a list of two: refused, not half done
        with pytest.raises(ValueError, match="out must match the input: 2 arrays in a list; got "
                                             "ndarray of 1"):
            comm.allreduce([x, y], out=out)
    np.testing.assert_array_equal(y, np.full(2, 7.0))
    rows = [np.ones(2 * comm.size), np.ones(2 * comm.size)]
    with pytest.raises(ValueError, match="out must match the input"):
        comm.reduce_scatter(rows, out=np.zeros(2))
    if comm.size > 1:  # every length divides by 1
        with pytest.raises(ValueError, match=f"7 rows along axis 0 .*size is {comm.size}"):
            comm.reduce_scatter(np.ones(7))


def test_closed_communicator(connector):
    c = make_communicator("mpi", connector)
    c.close()
    with pytest.raises(RuntimeError, match="allreduce called after close"):
        c.allreduce(np.ones(2))
    for name, call in [("barrier", c.barrier), ("verify_calls", c.verify_calls),
                       ("set_stall_timeout", lambda: c.set_stall_timeout(10)),
                       ("send", lambda: c.send(np.ones(2), (c.rank + 1) % c.size)),
                       ("allgather_async", lambda: c.allgather_async(np.ones(2)))]:
        with pytest.raises(RuntimeError, match=f"{name} called after close"):
            call()
    c.close()  # a second close does nothing


def test_unknown_backend(connector):
    with pytest.raises(ValueError, match="unknown backend; got 'gloo', expected one of mpi, nccl"):
        make_communicator("gloo", connector)


def test_backend_array_check_runs_on_every_call(connector):
    """Every call asks the backend about its arrays, outputs included (NCCL refuses host
    arrays there); a backend hook that refuses everything must see every call."""
    from meta_dist.comm.mpi_backend import MpiCommunicator

    class Refusing(MpiCommunicator):
        def _check_arrays(self, api, arrays):
            raise TypeError(f"{api}: refused {len(arrays)} array(s)")

    c = Refusing(connector)
    try:
        with pytest.raises(TypeError, match="allreduce: refused 1 array"):
            c.allreduce(np.ones(4))
        with pytest.raises(TypeError, match="allreduce: refused 3 array"):
            c.allreduce([np.ones(2)] * 3)
        with pytest.raises(TypeError, match="allgather: refused 1 array"):
            c.allgather(np.ones(2, np.float32))
        x = np.ones(2 * c.size)  # in place, or out given
        for call in (lambda: c.allreduce(x, out=x), lambda: c.broadcast(x, out=x),
                     lambda: c.reduce_scatter(x, out=np.empty(2)),
                     lambda: c.allgather(x[:2], out=np.empty(2 * c.size))):
            with pytest.raises(TypeError, match="refused 1 array"):
                call()
    finally:
        c.close()


def test_read_only_array_in_an_in_place_list_is_refused(comm):
    big = [np.ones(40000), np.ones(40000)]
    big[1].flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.allreduce(big, out=big)
    np.testing.assert_array_equal(big[0], np.ones(40000))  # nothing moved before the error


def test_reduce_scatter_refuses_a_partial_overlap(comm):
    if comm.size == 1:
        pytest.skip("with one rank every overlap is the rank's own rows")
    send = np.ones(comm.size * 4)
    wrong = send[(comm.rank + 1) % comm.size * 4:][:4] if comm.rank != comm.size - 1 else send[1:5]
    with pytest.raises(ValueError, match="out overlaps send elsewhere than this rank's rows"):
        comm.reduce_scatter(send, out=wrong)
    comm.reduce_scatter(send, out=send[comm.rank * 4:(comm.rank + 1) * 4])  # in place: fine


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field", ["op", "root", "dtype", "size"])
def test_mismatch_names_the_field_and_each_ranks_value(comm, field):
    """A call that differs only in op, root, dtype or size says which, with every rank's value
    (before, both ranks' calls were printed alike when only the op or root differed)."""
    r = comm.rank
    calls = {"op": (lambda: comm.allreduce(np.ones(4), op="sum" if r == 0 else "max"),
                    "'sum'", "'max'"),
             "root": (lambda: comm.broadcast(np.ones(4), root=0 if r == 0 else 1), "0", "1"),
             "dtype": (lambda: comm.allreduce(np.ones(4, np.float32 if r == 0 else np.float64)),
                       "'float32'", "'float64'"),
             "size": (lambda: comm.allreduce(np.ones(4 + (r > 0))), "4", "5")}
    call, first, other = calls[field]
    with pytest.raises(ValueError) as err:
        call()
    text = str(err.value)
    assert re.search(rf"the ranks' calls differ in [a-z, ]*\b{field}\b", text), text
    assert f"{field}: rank 0 {first}, rank 1 {other}" in text, text
    np.testing.assert_array_equal(comm.allreduce(np.ones(3)), np.full(3, comm.size))  # usable


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differs", ["op", "dtype"])
def test_without_the_per_call_check_a_mismatch_still_surfaces(connector, differs):
    """check=False compares no call before it runs (an op, or a dtype of the same width,
    differs here: MPI computes without complaint), but the next barrier compares the calls
    made since and fails on every rank. (A floating max or min is a user-defined op, for which
    MPICH picks another algorithm: against a sum it fails inside MPICH, as sizes that differ
    do.)"""
    comm = make_communicator("mpi", connector, check=False)
    first = comm.rank == 0
    try:
        if differs == "op":
            comm.allreduce(np.ones(4), op="sum" if first else "prod")
        else:
            comm.allreduce(np.ones(4, np.float32 if first else np.int32))
        with pytest.raises(ValueError, match="calls since the last comparison differed.*run "
                                             "with META_DIST_CHECK=1"):
            comm.barrier()
        comm.allreduce(np.ones(4))
        comm.barrier()  # agreed again: nothing to report
        comm.verify_calls()
    finally:
        comm.close()


@pytest.mark.parametrize(("value", "check"), [("0", False), ("off", False), ("OFF", False),
                                             ("no", False), ("1", True), ("on", True)])
def test_meta_dist_check_takes_the_words_that_turn_it_off(connector, monkeypatch, value, check):
    """META_DIST_CHECK=off left the per-call check on (only 0, false and no turned it off),
    where META_DIST_CUDA_AWARE_MPI=off is off."""
    monkeypatch.setenv("META_DIST_CHECK", value)
    comm = make_communicator("mpi", connector)
    try:
        assert comm.check is check
    finally:
        comm.close()


def test_mpi_errors_without_the_check_say_how_to_see_which_ranks_differ():
    from mpi4py import MPI

    from meta_dist.comm.consistency import advised

    def truncated():
        raise MPI.Exception(MPI.ERR_TRUNCATE)

    with pytest.raises(RuntimeError, match=r"allreduce: the MPI library failed: .*run with "
                                           "META_DIST_CHECK=1 to see which ranks differ"):
        advised(truncated, "allreduce")()
