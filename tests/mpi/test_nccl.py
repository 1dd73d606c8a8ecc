"""NCCL backend: bootstrap and failure on any machine; every collective on CuPy arrays on a GPU.

Every skip is decided collectively (``connector.allgather``), so all ranks skip or none does.
Without cupy only the failure tests run; with cupy but no GPU the unique id and version tests run
too; the ``gpu`` tests need a GPU per rank, or NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 to
share one; the ``any_gpu`` ones (CuPy arrays through MPI, which needs no NCCL) a GPU visible to
every rank, shared or not. GPU inputs are the numpy inputs of test_collectives, moved to the
device.
"""

import os
import threading
import time
import weakref

import numpy as np
import pytest
from conftest import same_on_every_rank
from test_collectives import DTYPES, LENGTHS, OPS, assert_matches, rank_input, reference, valid

from meta_dist import gpus, make_communicator
from meta_dist.comm.nccl_backend import broadcast_unique_id
from meta_dist.errors import UsageError
from meta_dist.gpus import (
    MULTI_RANK_GPU_VERSION,
    decode_nccl_version,
    nccl_unavailable_reason,
    nccl_version,
)
from meta_dist.xp import cupy_or_none, gpu_count


def collective_skip(connector, problem, what):
    """Skip on every rank if any rank has a problem; the reason names those ranks."""
    problems = connector.allgather(problem)
    bad = [r for r, p in enumerate(problems) if p]
    if bad:
        first = next(p for p in problems if p)
        pytest.skip(f"{what}: rank(s) {', '.join(map(str, bad))}: {first}")


@pytest.fixture(scope="module")
def cp(connector):
    """The cupy module on every rank, or a collective skip."""
    problem = None if cupy_or_none() is not None else (
        "cupy does not import; pip install 'meta_dist[gpu]'")
    collective_skip(connector, problem, "needs cupy")
    return cupy_or_none()


def skip_unless_nccl_per_rank(connector):
    """Skip on every rank unless NCCL runs on a GPU per rank (or on a shareable one)."""
    collective_skip(connector, nccl_unavailable_reason(), "needs NCCL and a GPU")
    shareable = (os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
                 and (nccl_version() or (0, 0, 0)) >= MULTI_RANK_GPU_VERSION)
    shortfall = gpu_count() < connector.local_size and not shareable
    collective_skip(connector, shortfall and (
        f"{connector.local_size} ranks on this node, {gpu_count()} GPU(s); NCCL needs one GPU "
        "per rank unless NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1"), "needs a GPU per rank")


@pytest.fixture(scope="module")
def gpu(connector, cp):
    """A GPU per rank with NCCL (or a shareable one), or a collective skip."""
    skip_unless_nccl_per_rank(connector)
    return cp


@pytest.fixture(scope="module")
def any_gpu(connector, cp):
    """A GPU visible to every rank, shared or not, or a collective skip. Enough for CuPy arrays
    through the MPI backend (staged through host memory): that path needs no NCCL, so it runs
    where several ranks share one GPU, as on a one-GPU machine."""
    collective_skip(connector, None if gpu_count() > 0 else "no CUDA device is visible",
                    "needs a GPU")
    return cp


def another_gpu(connector, own):
    """Return a GPU other than ``own`` (visible on every rank), or skip on every rank."""
    others = [d for d in range(gpu_count()) if d != own]
    collective_skip(connector, None if others else "one GPU: no other device to make current",
                    "needs a second GPU")
    return others[0]


def in_thread(call):
    """Run ``call`` on a new thread; return its result or raise its exception here."""
    box = {}

    def run():
        try:
            box["result"] = call()
        except BaseException as error:  # carried to the test's thread
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.fixture(scope="module")
def ncomm(connector, gpu):
    comm = make_communicator("nccl", connector)
    yield comm
    comm.close()


# ---------------------------------------------------------------- no GPU needed

def test_unique_id_is_identical_on_every_rank(connector, cp):
    from cupy.cuda import nccl

    collective_skip(connector, None if nccl.available else "libnccl does not load", "needs NCCL")
    uid = broadcast_unique_id(connector)
    raw = bytes(uid) if isinstance(uid, bytes) else bytes(b & 0xFF for b in uid)  # CuPy 13: ints
    assert len(raw) == 128
    assert all(other == raw for other in connector.allgather(raw))
    assert isinstance(uid, (bytes, tuple))  # passed through as CuPy made it (14: bytes; 13: tuple)


def test_nccl_version_decodes(connector, cp):
    from cupy.cuda import nccl

    collective_skip(connector, None if nccl.available else "libnccl does not load", "needs NCCL")
    version = nccl_version()
    assert version == decode_nccl_version(nccl.get_version())
    assert version[0] == 2 and version >= (2, 9, 0)
    assert decode_nccl_version(23203) == (2, 32, 3) and decode_nccl_version(2804) == (2, 8, 4)


def test_make_communicator_fails_on_every_rank_without_nccl(connector):
    reasons = connector.allgather(nccl_unavailable_reason())
    if not any(reasons):
        pytest.skip("every rank can run NCCL here")
    with pytest.raises(UsageError) as err:
        make_communicator("nccl", connector)
    message = str(err.value)
    missing = sum(r is not None for r in reasons)
    assert f"NCCL cannot run on {missing} of {connector.size} ranks" in message
    assert "backend: mpi" in message and "meta_dist[gpu]" in message
    for reason in reasons:
        assert reason is None or reason in message
    assert connector.allgather("alive") == ["alive"] * connector.size  # nobody is stuck


@pytest.mark.mpi(min_size=2)
def test_one_rank_without_nccl_fails_every_rank(connector, monkeypatch):
    last = connector.size - 1
    if connector.rank == last:
        monkeypatch.setattr(gpus, "nccl_unavailable_reason",
                            lambda: "simulated: no GPU on this rank")
    with pytest.raises(UsageError, match=f"rank {last}: simulated: no GPU on this rank"):
        make_communicator("nccl", connector)
    assert connector.allgather("alive") == ["alive"] * connector.size


def test_auto_uses_mpi_where_ranks_share_a_gpu(connector, cp):
    """Several ranks on one GPU (a laptop, a 1-GPU box): ``backend: auto`` must pick MPI with
    host staging and say why; an explicit ``nccl`` is one clear error on every rank. (It used
    to pick NCCL whenever every rank saw a GPU, failing inside get_context() everywhere.)"""
    from meta_dist import MPIConnector
    from meta_dist.distributed import DistContext

    shareable = (os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
                 and (nccl_version() or (0, 0, 0)) >= MULTI_RANK_GPU_VERSION)
    sharing = (nccl_unavailable_reason() is None and not shareable
               and gpu_count() < connector.local_size)
    collective_skip(connector, None if sharing else "no rank shares a GPU here",
                    "needs ranks sharing a GPU")
    world = DistContext(MPIConnector(abort_on_exception=False), backend="auto")
    try:
        assert "share GPU" in world.nccl_problem and "backend: mpi" in world.nccl_problem
        x = cp.full(10, float(world.rank))
        comm = world.communicator_for(x)
        assert comm.backend_name == "mpi"
        np.testing.assert_array_equal(comm.allreduce(x).get(), np.full(10, sum(
            range(world.size)), np.float64))
        assert world.device_route(comm).startswith(
            "GPU collectives: MPI, staged through host memory (backend auto: NCCL cannot run")
        with pytest.raises(UsageError, match="share GPU .* start one rank per GPU"):
            make_communicator("nccl", connector)
    finally:
        world.close()


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_float16_avg_does_not_overflow(ncomm, gpu):
    """avg is NCCL's own (>= 2.10: inputs times 1/size, then summed): 40000 on every rank
    averages to about 40000 in float16, where summing first would give inf."""
    x = gpu.full(64, 40000, gpu.float16)
    got = ncomm.allreduce(x, "avg").get().astype(np.float64)
    assert np.isfinite(got).all() and np.abs(got - 40000).max() <= 40000 * 2e-3
    assert np.isinf(ncomm.allreduce(x, "sum").get()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce(ncomm, connector, gpu, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for n in LENGTHS:
        inputs = [rank_input(n, r, (n,), dtype, op) for r in range(ncomm.size)]
        ref = reference(inputs, op)
        mine = gpu.asarray(inputs[ncomm.rank])
        assert_matches(ncomm.allreduce(mine, op).get(), ref, ncomm.size)
        np.testing.assert_array_equal(mine.get(), inputs[ncomm.rank])
        assert ncomm.allreduce(mine, op, out=mine) is mine
        assert_matches(mine.get(), ref, ncomm.size)
        assert same_on_every_rank(connector, mine.get())


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["max", "min"])
def test_max_and_min_skip_nan_as_the_mpi_backend_does(ncomm, connector, gpu, op):
    """NCCL reduces floats with fmaxf/fminf: a NaN stays only where every rank has one, the
    rule the MPI backend follows too (test_collectives)."""
    n = 1001
    for holder in range(ncomm.size):
        inputs = [rank_input(n, r, (n,), "float32") for r in range(ncomm.size)]
        inputs[holder][::2] = np.nan
        for x in inputs:
            x[::4] = np.nan
        got = ncomm.allreduce(gpu.asarray(inputs[ncomm.rank]), op).get()
        np.testing.assert_array_equal(got, reference(inputs, op))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter(ncomm, gpu, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for m in (1, 5, 40001):
        inputs = [rank_input(m, r, (m * ncomm.size,), dtype, op) for r in range(ncomm.size)]
        rows = slice(ncomm.rank * m, (ncomm.rank + 1) * m)
        ref = reference(inputs, op)[rows]
        assert_matches(ncomm.reduce_scatter(gpu.asarray(inputs[ncomm.rank]), op).get(), ref,
                       ncomm.size)
        buf = gpu.asarray(inputs[ncomm.rank])
        ncomm.reduce_scatter(buf, op, out=buf[rows])  # in place: recv = send + rank*m
        assert_matches(buf[rows].get(), ref, ncomm.size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(ncomm, gpu, dtype):
    for m in (1, 3, 20001):
        inputs = [rank_input(m, r, (m, 2), dtype) for r in range(ncomm.size)]
        got = ncomm.allgather(gpu.asarray(inputs[ncomm.rank]))
        np.testing.assert_array_equal(got.get(), np.concatenate(inputs))
        out = gpu.zeros((m * ncomm.size, 2), dtype)
        rows = slice(ncomm.rank * m, (ncomm.rank + 1) * m)
        out[rows] = gpu.asarray(inputs[ncomm.rank])
        ncomm.allgather(out[rows], out=out)  # in place: send = recv + rank*m
        np.testing.assert_array_equal(out.get(), np.concatenate(inputs))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast(ncomm, gpu, dtype):
    for root in range(ncomm.size):
        for n in (1, 70001):
            inputs = [rank_input(n + root, r, (n,), dtype) for r in range(ncomm.size)]
            got = ncomm.broadcast(gpu.asarray(inputs[ncomm.rank]), root)
            np.testing.assert_array_equal(got.get(), inputs[root])
            buf = gpu.asarray(inputs[ncomm.rank])
            assert ncomm.broadcast(buf, root, out=buf) is buf
            np.testing.assert_array_equal(buf.get(), inputs[root])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_reduce(ncomm, gpu, dtype, op):
    if not valid(op, dtype):
        pytest.skip("avg needs a floating dtype")
    for root in range(ncomm.size):
        inputs = [rank_input(root, r, (1001,), dtype, op) for r in range(ncomm.size)]
        got = ncomm.reduce(gpu.asarray(inputs[ncomm.rank]), root, op)
        buf = gpu.asarray(inputs[ncomm.rank])
        in_place = ncomm.reduce(buf, root, op, out=buf)
        if ncomm.rank != root:
            assert got is None and in_place is None
            continue
        assert_matches(got.get(), reference(inputs, op), ncomm.size)
        assert in_place is buf
        assert_matches(buf.get(), reference(inputs, op), ncomm.size)


@pytest.mark.gpu
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather",
                                        "broadcast", "reduce"])
def test_fused_lists(ncomm, gpu, collective):
    shapes = [(ncomm.size * 3,), (ncomm.size, 5), (ncomm.size * 2, 2, 2)]
    arrays = [gpu.asarray(rank_input(i, ncomm.rank, s, "float64")) for i, s in enumerate(shapes)]
    run = {"allreduce": lambda a: ncomm.allreduce(a),
           "reduce_scatter": lambda a: ncomm.reduce_scatter(a),
           "allgather": lambda a: ncomm.allgather(a),
           "broadcast": lambda a: ncomm.broadcast(a, root=ncomm.size - 1),
           "reduce": lambda a: ncomm.reduce(a, root=0)}[collective]
    fused, one_by_one = run(arrays), [run(a) for a in arrays]
    if fused is None:  # reduce off the root; the in-place call below is every rank's
        assert all(x is None for x in one_by_one)
    else:
        for f, o in zip(fused, one_by_one, strict=True):
            np.testing.assert_array_equal(f.get(), o.get())
    in_place = [gpu.full(n, ncomm.rank + 1.0) for n in (3, 1, 4)]
    result = ncomm.allreduce(in_place, out=in_place)
    assert all(r is a for r, a in zip(result, in_place, strict=True))
    assert all(bool((a == ncomm.size * (ncomm.size + 1) / 2).all()) for a in in_place)


@pytest.mark.gpu
def test_async_list_keeps_its_contiguous_copies_until_read(ncomm, gpu, monkeypatch):
    """A strided array in a fused list is copied when the call is made, on the caller's stream,
    and read by the packing on the communicator's stream after the call has been handed over.
    CuPy's pool gives a freed block to the next allocation on the stream it was allocated on
    (per-stream arenas, cupy/cuda/memory.pyx), so the copy must stay referenced until the
    caller's stream has waited for that read, whatever the caller does before ``wait()``. On
    the stand-in every stream operation here waits 20 ms: the packing is still pending when
    the call's thread has finished with it."""
    monkeypatch.setenv("META_DIST_STANDIN_DELAY_US", "20000:20000")
    strided = gpu.arange(20, dtype=gpu.float32)[::2]
    handle = ncomm.allreduce_async([strided, gpu.ones(3, gpu.float32)])
    while not handle.done():
        time.sleep(0.001)
    scratch = gpu.zeros(10, gpu.float32)  # the caller's next allocation
    got = handle.wait()
    np.testing.assert_array_equal(got[0].get(), ncomm.size * np.arange(0, 20, 2))
    np.testing.assert_array_equal(got[1].get(), np.full(3, ncomm.size, np.float32))
    assert scratch.shape == (10,)


@pytest.mark.gpu
def test_an_async_nccl_error_ends_a_barrier_without_a_watchdog(connector, gpu, monkeypatch):
    """NCCL user guide, usage/communicators.html, "Asynchronous errors and error handling":
    "Operations experiencing an asynchronous error will usually not progress and never
    complete. [...] When waiting for NCCL operations to complete, applications should call
    ncclCommGetAsyncError and destroy the communicator when an error happens." With no stall
    watchdog to poll it, the host's own waits (barrier) must. Only the stand-in can inject the
    error (every rank's first NCCL call fails with status 3); on a real GPU this skips."""
    if not getattr(gpu, "__standin__", False):
        pytest.skip("an asynchronous NCCL error can be injected only on the stand-in")
    monkeypatch.setenv("META_DIST_STANDIN_NCCL_ASYNC_ERROR", f"{connector.rank}:1:3")
    monkeypatch.delenv("META_DIST_STALL_TIMEOUT", raising=False)
    comm = make_communicator("nccl", connector, stall_timeout=None)
    outcome = []

    def barrier():
        try:
            comm.barrier()
            outcome.append("returned")
        except RuntimeError as error:
            outcome.append(str(error))

    waiter = threading.Thread(target=barrier, daemon=True)
    waiter.start()
    waiter.join(10)
    hung = waiter.is_alive()
    if hung:  # ncclCommAbort ends the wait, so the next tests can run
        comm._abort()
        waiter.join(10)
    # the aborted call ends on the device after ncclCommAbort returns: let it, before close()
    # drops the buffers it used (the stand-in reports a free under unfinished work)
    gpu.cuda.Device(comm.device).synchronize()
    comm.close()
    assert not hung, "barrier waited forever on an NCCL call that had failed asynchronously"
    assert "NCCL reported an error" in outcome[0] and "internal error" in outcome[0], outcome


@pytest.mark.gpu
def test_close_lets_go_of_the_last_calls_arrays(connector, gpu):
    """The comm stream holds each call's arrays until its device work is done; at close it
    waits for that work and lets them go, so a closed communicator that is still referenced
    (a trainer's, say) keeps no GPU memory of its last call alive."""
    comm = make_communicator("nccl", connector)
    x = gpu.ones(4, gpu.float32)
    comm.allreduce([x, gpu.ones(3, gpu.float32)])
    seen = weakref.ref(x)
    comm.close()
    del x
    assert seen() is None


@pytest.mark.gpu
def test_async_barrier_and_host_arrays(ncomm, gpu):
    a = gpu.full(100, float(ncomm.rank))
    handles = [ncomm.allreduce_async(a), ncomm.broadcast_async(a, root=0)]
    np.testing.assert_array_equal(handles[0].wait().get(), ncomm.size * (ncomm.size - 1) / 2)
    np.testing.assert_array_equal(handles[1].wait().get(), np.zeros(100))
    ncomm.barrier()
    with pytest.raises(TypeError, match="nccl backend moves CuPy arrays; got numpy.ndarray"):
        ncomm.allreduce(np.ones(3))


@pytest.mark.gpu
def test_calls_run_on_the_ranks_gpu_whatever_device_is_current(ncomm, connector, gpu):
    """Calls made, and results taken, while another GPU is current (or on a thread whose
    current device is another) run on the rank's GPU, as PyTorch's process groups run on a
    tensor's device: they failed on that rank alone (the communicator's stream belongs to its
    GPU), leaving its peers waiting in the check, and a wait on another device's thread left
    the caller's stream unordered."""
    other = another_gpu(connector, ncomm.device)
    total = np.full(1000, ncomm.size * (ncomm.size + 1) / 2, np.float32)
    with gpu.cuda.Device(ncomm.device):
        x = gpu.full(1000, float(ncomm.rank + 1), gpu.float32)
        y, z = x.copy(), x.copy()
    with gpu.cuda.Device(other):
        got = ncomm.allreduce(x)  # a new result: made on the rank's GPU
        assert ncomm.allreduce(y, out=y) is y
        handle = ncomm.allreduce_async(z, out=z)
        gathered = ncomm.allgather([x[:3], x[3:5]])
        ncomm.barrier()
    in_thread(lambda: (gpu.cuda.Device(other).use(), handle.wait()))
    from_thread = in_thread(lambda: (gpu.cuda.Device(other).use(), ncomm.allreduce(x))[1])
    for result in (got, y, z, from_thread):
        assert result.device.id == ncomm.device
        np.testing.assert_array_equal(result.get(), total)
    assert [g.device.id for g in gathered] == [ncomm.device] * 2
    np.testing.assert_array_equal(gathered[1].get(), np.repeat(np.arange(1, ncomm.size + 1),
                                                               2).astype(np.float32))


@pytest.mark.gpu
def test_close_with_another_gpu_current(connector, gpu):
    """close() waits for the communicator's stream with an event of its own GPU: made on the
    current device instead, recording it failed and close aborted NCCL and raised."""
    comm = make_communicator("nccl", connector)
    other = another_gpu(connector, comm.device)
    with gpu.cuda.Device(comm.device):
        x = gpu.ones(10, gpu.float32)
    comm.allreduce(x, out=x)
    with gpu.cuda.Device(other):
        comm.close()
    assert comm.closed


@pytest.mark.gpu
def test_close_while_the_watchdog_probes_nccl(connector, gpu):
    """The stall watchdog asks NCCL for errors (ncclCommGetAsyncError) from its own thread while
    close() destroys the communicator on the caller's: the probe could query a communicator
    destroyed under it (CuPy then passes NULL; NCCL answers ncclInvalidArgument, or reads freed
    memory mid-destroy), and the watchdog ended a finished job with "NCCL reported an error".
    Seen as a rank of the stand-in GPU job aborting mid-suite. The probe runs here in a loop
    beside each close, as the watchdog's poll would, many times more often."""
    failures = []
    for _ in range(20):
        comm = make_communicator("nccl", connector, stall_timeout=60.0)
        probe = connector.watchdogs[-1].probes[-1]
        stop = threading.Event()

        def poll(probe=probe, stop=stop):
            while not stop.is_set():
                try:
                    probe()
                except Exception as error:  # what the watchdog would end the job with
                    failures.append(f"{type(error).__name__}: {error}")
                    return

        poller = threading.Thread(target=poll)
        poller.start()
        try:
            time.sleep(0.002)
            comm.close()
            time.sleep(0.002)
        finally:
            stop.set()
            poller.join()
    assert not failures, f"rank {connector.rank}: the probe failed beside close: {failures}"


class SlowTeardown:
    """An NCCL communicator whose ncclCommAbort and ncclCommDestroy take a while, as NCCL's do:
    the work stops at once, the freeing goes on, and CuPy zeroes its handle only on return (so
    the other call, made meanwhile, frees the communicator again). Records such overlaps."""

    def __init__(self, comm):
        self.comm, self.busy, self.overlaps = comm, [], []
        self.started, self.stopped = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def abort(self):
        self._free("ncclCommAbort", self.comm.abort)

    def destroy(self):
        self._free("ncclCommDestroy", self.comm.destroy)

    def _free(self, name, call):
        if self.busy:
            self.overlaps.append(f"{name} during {self.busy[0]}")
        self.busy.append(name)
        self.started.set()
        try:
            call()
            self.stopped.set()
            time.sleep(0.2)
        finally:
            self.busy.remove(name)


@pytest.mark.gpu
@pytest.mark.parametrize("when", ["while close waits", "while close destroys"])
def test_the_watchdogs_abort_and_close_never_free_nccl_at_once(connector, gpu, when):
    """The watchdog aborts the communicator (ncclCommAbort, on its hooks' thread) when a stall
    ends the job, and close() may be waiting for the stream or destroying it on the caller's:
    close read "not aborted" before its wait and then destroyed the communicator the abort was
    still freeing, and an abort during destroy went ahead. NCCL frees the communicator twice
    (use after free: a crash instead of the stall report's clean MPI_Abort)."""
    comm = make_communicator("nccl", connector, stall_timeout=60.0)
    abort = connector.watchdogs[-1].before_abort[-1]  # comm's, as the watchdog's hooks run it
    nccl = comm._comm = SlowTeardown(comm._comm)
    if when == "while close waits":
        hook = threading.Thread(target=abort)
        wait = comm._host_wait

        def stalled_wait(done):  # the watchdog's abort stops the work close waits for
            hook.start()
            nccl.stopped.wait(10)
            wait(done)

        comm._host_wait = stalled_wait
    else:
        hook = threading.Thread(target=lambda: nccl.started.wait(10) and abort())
        hook.start()
    comm.close()
    hook.join()
    assert comm.closed
    assert not nccl.overlaps, f"rank {connector.rank} {when}: {nccl.overlaps}"


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_meta_dist_threads_touch_only_the_ranks_gpu(connector, gpu):
    """meta_dist's own threads (communication, watchdog) make CUDA calls on the rank's GPU
    only. A thread that queries an event with no device set gets device 0's primary context
    (CUDA runtime API, "Interactions with the CUDA Driver API"): the watchdog, polling NCCL's
    events, put one of every rank on GPU 0, hundreds of MiB each (torchcomms PR #777 saw 3.7
    GiB on 8 H100s, and rank 0 ran out of memory). Only the stand-in says which thread made
    which context; on a real GPU this skips."""
    if not getattr(gpu, "__standin__", False):
        pytest.skip("which thread made a CUDA context is known only on the stand-in")
    from meta_dist.watchdog import POLL_S

    comm = make_communicator("nccl", connector, stall_timeout=60.0)
    try:
        x = gpu.ones(1000, gpu.float32)
        handle = comm.allreduce_async(x, out=x)
        comm.allreduce(x, out=x)
        handle.wait()
        time.sleep(3 * POLL_S)  # the watchdog polls the last call's event
        comm.barrier()
    finally:
        comm.close()
    foreign = {device: [t for t in threads if t.startswith("meta_dist-")]
               for device, threads in gpu._engine.contexts().items() if device != comm.device}
    assert not any(foreign.values()), (
        f"rank {comm.rank} (GPU {comm.device}): meta_dist threads made CUDA contexts on other "
        f"GPUs: {foreign}")


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_a_blocking_send_runs_after_the_async_collectives_before_it(ncomm, gpu):
    """NCCL takes one thread at a time per communicator and the ranks' calls in one order: a
    blocking send or recv made while an asynchronous collective is queued runs after it. It
    ran at once, beside the queued allreduce, so the ranks enqueued them in different orders
    (a deadlock once the message is too large to be sent eagerly: 32 MiB here)."""
    x = gpu.ones(1024, gpu.float32)
    message = gpu.full(1 << 23, float(ncomm.rank), gpu.float32)
    handle = ncomm.allreduce_async(x, out=x)
    if ncomm.rank == 0:
        ncomm.send(message, peer=1)
    elif ncomm.rank == 1:
        time.sleep(0.3)  # late: rank 0's send is in flight before rank 1's allreduce starts
        ncomm.recv(message, peer=0)
    handle.wait()
    np.testing.assert_array_equal(x.get(), np.full(1024, ncomm.size, np.float32))
    if ncomm.rank == 1:
        assert float(message[0].get()) == 0.0


@pytest.mark.gpu
@pytest.mark.mpi(min_size=2)
def test_send_recv(ncomm, gpu):
    x = gpu.asarray(rank_input(7, 0, (2048,), "float16"))
    got = gpu.empty_like(x)
    if ncomm.rank == 0:
        ncomm.send(x, peer=1)
        ncomm.recv(got, peer=1)
        np.testing.assert_array_equal(got.get(), x.get())
    elif ncomm.rank == 1:
        ncomm.recv(got, peer=0)
        ncomm.send(got, peer=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float64", "avg"), ("uint8", "sum"),
                                      ("int32", "max")])
def test_cupy_arrays_through_mpi_backend(connector, any_gpu, dtype, op):
    comm = make_communicator("mpi", connector)  # staged, or META_DIST_CUDA_AWARE_MPI=1
    try:
        for n in (7, 70001):
            inputs = [rank_input(n, r, (n * comm.size,), dtype, op) for r in range(comm.size)]
            mine = any_gpu.asarray(inputs[comm.rank])
            assert_matches(comm.allreduce(mine, op).get(), reference(inputs, op), comm.size)
            assert comm.allreduce(mine, op, out=mine) is mine
            assert_matches(mine.get(), reference(inputs, op), comm.size)
            if op in ("sum", "avg"):
                rows = slice(comm.rank * n, (comm.rank + 1) * n)
                buf = any_gpu.asarray(inputs[comm.rank])
                comm.reduce_scatter(buf, op, out=buf[rows])
                assert_matches(buf[rows].get(), reference(inputs, op)[rows], comm.size)
            out = any_gpu.zeros(n * comm.size * comm.size, dtype)
            part = slice(comm.rank * n * comm.size, (comm.rank + 1) * n * comm.size)
            out[part] = any_gpu.asarray(inputs[comm.rank])
            comm.allgather(out[part], out=out)
            np.testing.assert_array_equal(out.get(), np.concatenate(inputs))
            np.testing.assert_array_equal(comm.broadcast(any_gpu.asarray(inputs[comm.rank]),
                                                         root=comm.size - 1).get(), inputs[-1])
    finally:
        comm.close()
