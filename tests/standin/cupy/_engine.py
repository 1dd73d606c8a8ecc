"""Execution engine of the stand-in: devices, stream queues run by worker threads, ordering.

Imports the stand-in's _knobs and _errors only. Every device operation (kernel, copy, event
record, NCCL call) becomes an ``Op`` on a ``Queue`` (one per CUDA stream and device) and runs
on that queue's worker thread after a random delay, in order. Ordering between queues follows
CUDA: explicit event waits, and the legacy default stream's implicit synchronisation with
blocking streams ("Stream synchronization behavior", CUDA runtime API:
https://docs.nvidia.com/cuda/cuda-runtime-api/stream-sync-behavior.html).

``_memory`` registers in DROPPED_HOOKS how arrays dropped since the last call go back to the
pool; that runs at the next stand-in call, never in a finalizer (which may fire in any thread,
even one holding LOCK).

Primary contexts: CUDA makes a device's primary context current to a host thread at
``cudaSetDevice`` (which initializes it), or, for a thread with no context current, at its first
runtime call that needs one: that thread's current device, 0 unless set ("Interactions with
the CUDA Driver API", CUDA runtime API; cudaSetDevice's notes). Each costs hundreds of MiB of
that GPU (torchcomms PR #777: a watchdog thread querying events without cudaSetDevice put a
context of every rank on GPU 0). ``contexts()`` says which threads did so on which device.

Race detector: each queue keeps a vector clock, the highest op of every other queue that is
known to run before its next op (through event waits, the legacy stream's rule, or the host
having seen that op finish: stream/event synchronize, ``done`` returning True). Each device
allocation keeps the recent accesses made to it; an access from another queue that is not
before the new one in that order, and where either writes, overlapping in bytes, is a race.
"""

from __future__ import annotations

import itertools
import queue as queue_module
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import _knobs
from ._errors import (
    INVALID_DEVICE,
    NO_DEVICE,
    NOT_PERMITTED,
    CUDARuntimeError,
    StandinRaceError,
    add_note,
    cuda_error,
)

LOCK = threading.RLock()  # bookkeeping: clocks, access logs, registries (never in finalizers)
_DONE = threading.Condition()  # queue completion; never held while LOCK is wanted
_TLS = threading.local()
_HOST_CLOCK: dict[int, int] = {}  # per queue: highest op the host has seen finish
_HAZARDS: list[str] = []  # frees another stream may still use, raised at the next API call
_QUEUE_IDS = itertools.count(1)
_DEVICES: dict[int, DeviceState] = {}
DROPPED_HOOKS: list[Callable[[], None]] = []  # _memory registers its deferred-free processing
_CONTEXTS: dict[int, list[str]] = {}  # device -> "thread: how" of each thread it became current to


@dataclass(eq=False)
class Op:
    """One operation on a queue: runs after ``deps`` and after the queue's earlier ops."""

    seq: int
    deps: list[tuple[Queue, int]]
    run: Callable[[], None] | None
    label: str
    clock: dict[int, int]
    finished_at: float = 0.0


@dataclass(eq=False)
class Access:
    """A queued read or write of bytes [lo, hi) of one allocation."""

    queue: int
    seq: int
    kind: str
    write: bool
    lo: int
    hi: int
    label: str
    where: str


@dataclass(eq=False)
class Region:
    """Bytes [lo, hi) of an allocation that an operation reads or writes."""

    storage: object  # _memory.Storage (has .accesses, .ptr, .describe())
    lo: int
    hi: int
    write: bool


class Queue:
    """The work of one CUDA stream on one device, run in order by its own worker thread."""

    def __init__(self, device: DeviceState, kind: str, name: str) -> None:
        self.device = device
        self.kind = kind  # "legacy", "ptds", "blocking" or "nonblocking"
        self.name = name
        self.id = next(_QUEUE_IDS)
        self.enqueued = 0
        self.completed = 0
        self.clock: dict[int, int] = dict(_HOST_CLOCK)
        self._items: queue_module.SimpleQueue = queue_module.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._rng = random.Random(f"{_knobs.seed()}:{device.index}:{self.id}")
        with LOCK:
            device.queues.add(self)

    @property
    def blocking(self) -> bool:
        """Return True unless the stream was created with non_blocking=True."""
        return self.kind != "nonblocking"

    def describe(self) -> str:
        """Return e.g. "stream 0x7a000100 (non-blocking, device 0)"."""
        return f"{self.name} (device {self.device.index})"

    def put(self, op: Op) -> None:
        """Hand ``op`` to the worker (starting it on first use)."""
        if self._thread is None:
            self._thread = threading.Thread(target=_work, args=(self,), daemon=True,
                                            name=f"standin-{self.name}")
            self._thread.start()
        self._items.put(op)

    def close(self) -> None:
        """Let the worker finish what is queued, then exit (cudaStreamDestroy semantics)."""
        if self._thread is not None:
            self._items.put(None)

    def delay(self) -> float:
        """Return this op's random delay in seconds."""
        low, high = _knobs.delay_range_s()
        return self._rng.uniform(low, high) if high > 0 else 0.0


class DeviceState:
    """One visible CUDA device: its queues, its legacy default stream and its sticky error."""

    def __init__(self, index: int, physical: int) -> None:
        self.index = index
        self.physical = physical
        self.queues: weakref.WeakSet[Queue] = weakref.WeakSet()
        self.fault: CUDARuntimeError | None = None
        self.legacy = Queue(self, "legacy", "legacy default stream (Stream.null)")

    @property
    def pci_bus_id(self) -> str:
        """Return a PCI bus id unique to the physical device on this host."""
        return f"0000:{self.physical + 1:02x}:00.0"


def device_count() -> int:
    """Return the number of visible devices (0 when CUDA_VISIBLE_DEVICES hides them all)."""
    return len(_knobs.visible_devices())


def device(index: int) -> DeviceState:
    """Return visible device ``index``.

    Raises:
        CUDARuntimeError: cudaErrorNoDevice without devices, cudaErrorInvalidDevice for a
            bad index.
    """
    visible = _knobs.visible_devices()
    if not visible:
        raise cuda_error(NO_DEVICE, "no device is visible (META_DIST_STANDIN_DEVICES, "
                                    "CUDA_VISIBLE_DEVICES)")
    if not isinstance(index, int) or not 0 <= index < len(visible):
        raise cuda_error(INVALID_DEVICE, f"device {index!r} does not exist; got "
                                         f"{len(visible)} visible device(s)")
    with LOCK:
        state = _DEVICES.get(index)
        if state is None or state.physical != visible[index]:  # new layout (knobs reset)
            state = _DEVICES[index] = DeviceState(index, visible[index])
        return state


def current_device_id() -> int:
    """Return this host thread's current device (0 until set, as in CUDA)."""
    return getattr(_TLS, "device", 0)


def set_current_device(index: int) -> None:
    """Make device ``index`` current for this host thread (validates it).

    As cudaSetDevice, it also makes (and initializes) the device's primary context current to
    the thread.
    """
    device(index)
    _TLS.device = index
    _context_current(index, "cudaSetDevice")


def _context_current(index: int, how: str) -> None:
    if getattr(_TLS, "context", None) == index:
        return
    _TLS.context = index
    entry = f"{threading.current_thread().name}: {how}"
    with LOCK:
        threads = _CONTEXTS.setdefault(index, [])
        if entry not in threads:
            threads.append(entry)


def contexts() -> dict[int, list[str]]:
    """Return, per device, the host threads its primary context was made current to, and how.

    Stand-in only: CUDA keeps one primary context per device per process, and a thread that
    makes a runtime call with no device set creates one on device 0.
    """
    with LOCK:
        return {index: list(threads) for index, threads in _CONTEXTS.items()}


def current_device() -> DeviceState:
    """Return this host thread's current device state."""
    return device(current_device_id())


def ptds_queue(state: DeviceState) -> Queue:
    """Return this host thread's per-thread default stream on ``state``."""
    mine = getattr(_TLS, "ptds", None)
    if mine is None:
        mine = _TLS.ptds = {}
    found = mine.get(state.index)
    if found is None:
        found = mine[state.index] = Queue(
            state, "ptds", f"per-thread default stream of {threading.current_thread().name}")
    return found


def check_api_allowed() -> None:
    """Raise if called from a stream callback (CUDA forbids CUDA calls in host functions).

    Every runtime call that needs a context comes here: in a thread with none current, CUDA
    makes the current device's (device 0 unless set) primary context current and initializes it.
    """
    if getattr(_TLS, "in_host_func", False):
        raise cuda_error(NOT_PERMITTED, "a host function launched on a stream called a CUDA "
                                        "API; cudaLaunchHostFunc: 'must not make any CUDA "
                                        "API calls'")
    if getattr(_TLS, "context", None) is None and not in_worker():
        _context_current(current_device_id(), "a CUDA call with no device set")


def raise_pending(state: DeviceState | None = None) -> None:
    """Raise a use-after-free found since the last call, or ``state``'s sticky error."""
    with LOCK:
        for hook in DROPPED_HOOKS:
            hook()
        if _HAZARDS and _knobs.races_raise():
            message = _HAZARDS.pop(0)
            raise StandinRaceError(message)
    if state is not None and state.fault is not None:
        raise state.fault


def clear_fault(state: DeviceState) -> None:
    """Forget ``state``'s sticky error (for the stand-in's own tests; CUDA cannot do this)."""
    state.fault = None


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for key, value in other.items():
        if value > into.get(key, 0):
            into[key] = value


def enqueue(q: Queue, run: Callable[[], None] | None, label: str, *,
            regions: Iterable[Region] = (), after: tuple[Queue, int, dict] | None = None
            ) -> Op:
    """Queue ``run`` on ``q`` and return its Op (the host does not wait).

    Args:
        q: the queue (stream) it runs on.
        run: what the worker runs; None for markers (event records and waits).
        label: what it is, for error messages ("kernel add", "nccl allReduce", ...).
        regions: device bytes it reads and writes, for the race detector.
        after: (queue, seq, clock) of a recorded event it must run after.

    Raises:
        StandinRaceError: an access races with another stream's (with races on).
    """
    check_api_allowed()
    regions = list(regions)
    with LOCK:
        raise_pending(q.device)
        deps = []
        if after is not None and after[1] > 0:
            deps.append((after[0], after[1]))
            _merge(q.clock, after[2])
        if q.kind == "legacy":  # waits for every blocking stream of the device
            for other in list(q.device.queues):
                if other is not q and other.blocking and other.enqueued:
                    deps.append((other, other.enqueued))
                    _merge(q.clock, other.clock)
        elif q.blocking and q.device.legacy.enqueued:  # waits for the legacy stream
            legacy = q.device.legacy
            deps.append((legacy, legacy.enqueued))
            _merge(q.clock, legacy.clock)
        _merge(q.clock, _HOST_CLOCK)
        _check_races(q, regions, label)
        q.enqueued += 1
        q.clock[q.id] = q.enqueued
        op = Op(q.enqueued, deps, run, label, dict(q.clock))
        _record(q, op, regions)
        q.put(op)
    return op


def _check_races(q: Queue, regions: list[Region], label: str) -> None:
    for region in regions:
        storage = region.storage
        # an access the host saw finish is ordered before everything enqueued from now on
        storage.accesses = [a for a in storage.accesses
                            if a.seq > _HOST_CLOCK.get(a.queue, 0)]
        if not _knobs.races_raise():
            continue
        for a in storage.accesses:
            if (a.queue == q.id or not (region.write or a.write) or a.hi <= region.lo
                    or region.hi <= a.lo or a.seq <= q.clock.get(a.queue, 0)):
                continue
            raise StandinRaceError(_race_message(q, label, region, a))


def _race_message(q: Queue, label: str, region: Region, a: Access) -> str:
    mine = "writes" if region.write else "reads"
    theirs = "wrote" if a.write else "read"
    return (f"{label}: unordered access to device memory; {label} on {q.describe()} {mine} "
            f"bytes [{region.lo}, {region.hi}) of {region.storage.describe()}, which {a.label} "
            f"on {a.where} {theirs} (bytes [{a.lo}, {a.hi})) with no event or host "
            f"synchronisation ordering the two; expected the second stream to wait: "
            f"event = first_stream.record(); second_stream.wait_event(event) "
            f"(CUDA stream semantics; NCCL user guide, usage/streams.html)")


def _record(q: Queue, op: Op, regions: list[Region]) -> None:
    for region in regions:
        if region.hi <= region.lo:
            continue
        storage = region.storage
        kept = [a for a in storage.accesses
                if not (a.queue == q.id and region.lo <= a.lo and a.hi <= region.hi
                        and (region.write or not a.write))]  # dominated by the new access
        kept.append(Access(q.id, op.seq, q.kind, region.write, region.lo, region.hi, op.label,
                           q.describe()))
        storage.accesses = kept


def note_hazard(message: str) -> None:
    """Report a misuse a stream worker found; it is raised at the next API call."""
    with LOCK:
        _HAZARDS.append(message)


def note_free(storage: object, alloc_queue: Queue) -> None:
    """Check, as an allocation returns to its stream's pool, that no other stream still uses it.

    CuPy's pool hands a freed block to the next allocation on the stream it was allocated on
    (per-stream arenas), so a use on another stream not ordered before that stream's next work
    can see the memory reused.
    """
    with LOCK:
        for a in storage.accesses:
            known = max(alloc_queue.clock.get(a.queue, 0), _HOST_CLOCK.get(a.queue, 0))
            # the legacy stream and blocking streams order each other's next work implicitly
            implicit = alloc_queue.blocking and a.kind != "nonblocking" and (
                alloc_queue.kind == "legacy" or a.kind == "legacy")
            if a.queue != alloc_queue.id and a.seq > known and not implicit:
                _HAZARDS.append(
                    f"{storage.describe()} was freed (its last reference dropped) while "
                    f"{a.label} on {a.where} may still use it: CuPy's memory pool can hand the "
                    f"block to the next allocation on {alloc_queue.describe()} at once; "
                    f"expected the array kept alive until that stream has waited for the "
                    f"other one (an event), or the host has synchronised")
                break
        storage.accesses = []


def _work(q: Queue) -> None:
    _TLS.worker = q
    while True:
        op = q._items.get()
        if op is None:
            return
        for other, seq in op.deps:
            with _DONE:
                while other.completed < seq:
                    _DONE.wait()
        pause = q.delay()
        if pause:
            time.sleep(pause)
        if op.run is not None and q.device.fault is None:
            try:
                op.run()
            except BaseException as error:  # a kernel fault is sticky, as in CUDA
                q.device.fault = _as_fault(error, op, q)
        op.finished_at = time.perf_counter()
        with _DONE:
            q.completed = op.seq
            _DONE.notify_all()


def _as_fault(error: BaseException, op: Op, q: Queue) -> CUDARuntimeError:
    if isinstance(error, CUDARuntimeError):
        return error
    fault = CUDARuntimeError(700)
    add_note(fault, f"{op.label} on {q.describe()} failed: {type(error).__name__}: {error}")
    fault.__cause__ = error
    return fault


def in_worker() -> bool:
    """Return True on a stream worker thread (where device memory may be touched)."""
    return getattr(_TLS, "worker", None) is not None


def run_host_func(fn: Callable[[], None]) -> Callable[[], None]:
    """Wrap a stream callback so that CUDA calls inside it fail, as CUDA requires."""
    def call() -> None:
        _TLS.in_host_func = True
        try:
            fn()
        finally:
            _TLS.in_host_func = False

    return call


def wait(q: Queue, seq: int, clock: dict[int, int]) -> None:
    """Block the host until op ``seq`` of ``q`` has run; the host then knows ``clock`` is done.

    Raises:
        CUDARuntimeError: the device has a sticky error.
    """
    check_api_allowed()
    raise_pending()
    with _DONE:
        while q.completed < seq:
            _DONE.wait()
    observe(clock)
    raise_pending(q.device)


def finished(q: Queue, seq: int, clock: dict[int, int]) -> bool:
    """Return True if op ``seq`` of ``q`` has run (and tell the race detector the host saw it)."""
    check_api_allowed()
    if q.completed < seq:
        return False
    observe(clock)
    return True


def observe(clock: dict[int, int]) -> None:
    """Record that the host has seen everything in ``clock`` finish."""
    with LOCK:
        _merge(_HOST_CLOCK, clock)


def snapshot(q: Queue) -> tuple[int, dict[int, int]]:
    """Return (last enqueued seq, clock) of ``q`` for a later ``wait``/``finished``."""
    with LOCK:
        return q.enqueued, dict(q.clock)


def synchronize_device(state: DeviceState) -> None:
    """Wait for every queue of ``state`` (cudaDeviceSynchronize)."""
    for q in list(state.queues):
        seq, clock = snapshot(q)
        wait(q, seq, clock)

