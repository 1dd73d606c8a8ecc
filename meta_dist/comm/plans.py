"""What each operation does between its arguments and the backend's primitive.

Imports numpy and meta_dist.comm.checks / consistency / xp; ``comm.base`` calls these, once per
call. A plan checks the call's arguments on this rank now and returns a closure that runs it
later (at once, or on the communication thread): the ranks compare their calls, a list is fused
into one flat buffer (``Fusion``), the backend's primitive moves it, "avg" divides once, and the
result is unpacked where it is due. Every choice that shapes the library calls depends only on
what every rank shares (sizes, dtype, op, root), never on where a rank's arrays lie, so ranks
whose lists are laid out differently still make the same calls.
"""

from __future__ import annotations

import operator
import sys
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

import numpy as np

from meta_dist.comm import checks
from meta_dist.comm.checks import DTYPES, REDUCE_OPS, SCATTER_OPS, flat_view
from meta_dist.comm.consistency import shape_code
from meta_dist.xp import array_module, is_cupy_array, split_buffer

if TYPE_CHECKING:
    from meta_dist.comm.base import Communicator

Run = Callable[[], Any]
_NBYTES = operator.attrgetter("nbytes")
RECYCLE_MIN_BYTES, RECYCLED_BUFFERS = 2**20, 2  # results recycled from this size; how many


def allreduce(c: Communicator, send: Any, op: str, out: Any) -> Run:
    """Plan ``Communicator.allreduce``."""
    sends, is_list = c._inputs("allreduce", send)
    checks.check_op("allreduce", op, REDUCE_OPS, sends[0].dtype)
    outs, fresh = c._outputs("allreduce", out, sends, None, is_list)
    c.traffic.count("allreduce", sends)

    def run() -> Any:
        c._fingerprint("allreduce", sends, op=op)
        flat_send, flat_out, unpack_into = c.fusion.fuse(sends, outs, fresh)
        c._allreduce(flat_send, flat_out, op)
        c._average(flat_out, op)
        c.fusion.unpack(flat_out, unpack_into)
        return outs if is_list else outs[0]

    return run


def reduce_scatter(c: Communicator, send: Any, op: str, out: Any) -> Run:
    """Plan ``Communicator.reduce_scatter``."""
    sends, is_list = c._inputs("reduce_scatter", send)
    checks.check_op("reduce_scatter", op, SCATTER_OPS, sends[0].dtype)
    checks.check_rows("reduce_scatter", sends, c.size)
    shapes = [checks.scatter_shape(s.shape, c.size) for s in sends]
    outs, _ = c._outputs("reduce_scatter", out, sends, shapes, is_list)
    c.traffic.count("reduce_scatter", sends)
    direct = c.fusion.direct(sends)

    def run() -> Any:
        c._fingerprint("reduce_scatter", sends, op=op)
        if direct:
            mine = flat_view(outs[0])
            c._reduce_scatter(flat_view(sends[0]), mine, op)
        else:  # rank-major packing: rank r's segment holds row block r of every array
            parts = [s.reshape(c.size, -1) for s in sends]
            buf = c.fusion.pack([p[r] for r in range(c.size) for p in parts])
            seg = buf.size // c.size
            mine = buf[c.rank * seg : (c.rank + 1) * seg]
            c._reduce_scatter(buf, mine, op)
        c._average(mine, op)
        c.fusion.unpack(mine, None if direct else outs)
        return outs if is_list else outs[0]

    return run


def allgather(c: Communicator, send: Any, out: Any) -> Run:
    """Plan ``Communicator.allgather``."""
    sends, is_list = c._inputs("allgather", send)
    checks.check_axis0("allgather", sends)
    shapes = [checks.gather_shape(s.shape, c.size) for s in sends]
    outs, _ = c._outputs("allgather", out, sends, shapes, is_list)
    c.traffic.count("allgather", sends)
    direct = c.fusion.direct(sends)

    def run() -> Any:
        c._fingerprint("allgather", sends)
        if direct:
            c._allgather(flat_view(sends[0]), flat_view(outs[0]))
            return outs if is_list else outs[0]
        seg = sum(s.size for s in sends)
        buf = c.fusion.buffer(sends[0], seg * c.size)
        mine = buf[c.rank * seg : (c.rank + 1) * seg]
        c.fusion.pack(sends, into=mine)
        c._allgather(mine, buf)
        by_rank, start = buf.reshape(c.size, seg), 0
        for o, s in zip(outs, sends, strict=True):
            c.fusion.copy(o.reshape(c.size, -1), by_rank[:, start : start + s.size])
            start += s.size
        return outs if is_list else outs[0]

    return run


def broadcast(c: Communicator, buf: Any, root: int, out: Any) -> Run:
    """Plan ``Communicator.broadcast``."""
    bufs, is_list = c._inputs("broadcast", buf)
    checks.check_rank("broadcast", "root", root, c.size)
    outs, fresh = c._outputs("broadcast", out, bufs, None, is_list)
    c.traffic.count("broadcast", bufs)

    def run() -> Any:
        c._fingerprint("broadcast", bufs, root=root)
        is_root = c.rank == root
        flat_buf, flat_out, unpack_into = c.fusion.fuse(bufs, outs, fresh, pack=is_root)
        if is_root and flat_out is not flat_buf:
            flat_out[...] = flat_buf
        c._broadcast(flat_out, root)
        c.fusion.unpack(flat_out, unpack_into)
        return outs if is_list else outs[0]

    return run


def reduce(c: Communicator, send: Any, root: int, op: str, out: Any) -> Run:
    """Plan ``Communicator.reduce``."""
    sends, is_list = c._inputs("reduce", send)
    checks.check_rank("reduce", "root", root, c.size)
    checks.check_op("reduce", op, REDUCE_OPS, sends[0].dtype)
    is_root = c.rank == root
    outs, fresh = c._outputs("reduce", out, sends, None, is_list) if is_root else (None, None)
    c.traffic.count("reduce", sends)

    def run() -> Any:
        c._fingerprint("reduce", sends, op=op, root=root)
        flat_send, flat_out, unpack_into = c.fusion.fuse(sends, outs, fresh)
        c._reduce(flat_send, flat_out, op, root)
        if not is_root:
            return None
        c._average(flat_out, op)
        c.fusion.unpack(flat_out, unpack_into)
        return outs if is_list else outs[0]

    return run


def send(c: Communicator, send: Any, peer: int) -> Run:
    """Plan ``Communicator.send``: a header first (with the check on), then the data.

    To this rank itself, a copy waits in ``c.fusion.to_self`` for the matching ``recv``: MPI's
    own send to oneself blocks until a receive is posted, which from one thread never happens.
    A list (or a device array through host memory) is packed into a buffer of its own: a send
    may run beside a collective, on another thread.
    """
    sends, _ = c._inputs("send", send)
    checks.check_rank("send", "peer", peer, c.size)
    shapes = [s.shape for s in sends]
    if peer == c.rank:
        return lambda: c.fusion.to_self.put((sends[0].dtype, shapes, c.fusion.pack(
            sends, into=c.fusion.private(sends[0], sum(s.size for s in sends)))))
    c.traffic.count("send", sends)

    def run() -> None:
        if c.check:
            header = np.array([DTYPES.index(sends[0].dtype), sum(s.size for s in sends),
                               shape_code(shapes)], np.int64)
            c._check_comm.Send(header, dest=peer)
        c._send(flat_view(sends[0]) if c.fusion.direct(sends) else c.fusion.pack(
            sends, into=c.fusion.private(sends[0], sum(s.size for s in sends))), peer)

    return run


def recv(c: Communicator, out: Any, peer: int) -> Run:
    """Plan ``Communicator.recv``: a sender whose header differs is drained, then refused."""
    outs, is_list = c._inputs("recv", out)
    checks.check_rank("recv", "peer", peer, c.size)
    for o in outs:
        checks.check_writable("recv", o)
    total, shapes, dtype = sum(o.size for o in outs), [o.shape for o in outs], outs[0].dtype
    if peer == c.rank:
        return lambda: _recv_from_self(c, outs, is_list, total)

    def run() -> Any:
        if c.check:
            header = np.empty(3, np.int64)
            c._check_comm.Recv(header, source=peer)
            sent, count = DTYPES[int(header[0])], int(header[1])
            if (sent, count, int(header[2])) != (dtype, total, shape_code(shapes)):
                c._recv(c.fusion.private(outs[0], count, sent), peer)  # drain it
                raise ValueError(
                    f"recv: rank {peer} sent {count} elements of {sent} with other shapes; "
                    f"this rank ({c.rank}) expected {total} elements of {dtype} shaped {shapes}; "
                    "send and recv must use the same shapes and dtype")
        if c.fusion.direct(outs):
            c._recv(flat_view(outs[0]), peer)
        else:
            buf = c.fusion.private(outs[0], total)
            c._recv(buf, peer)
            c.fusion.unpack(buf, outs)
        return outs if is_list else outs[0]

    return run


def _recv_from_self(c: Communicator, outs: list[Any], is_list: bool, total: int) -> Any:
    """Take the oldest message this rank sent itself (a blocking recv cannot wait for one)."""
    if c.fusion.to_self.empty() and threading.current_thread() is threading.main_thread():
        raise RuntimeError(
            f"recv: rank {c.rank} receives from itself, and no send to itself is waiting; a "
            "blocking recv from oneself would wait forever; send first (or use recv_async)")
    dtype, shapes, data = c.fusion.to_self.get()
    if (dtype, data.size, shapes) != (outs[0].dtype, total, [o.shape for o in outs]):
        raise ValueError(
            f"recv: rank {c.rank} sent itself {data.size} elements of {dtype} shaped {shapes}; "
            f"expected {total} elements of {outs[0].dtype} shaped {[o.shape for o in outs]}; "
            "send and recv must use the same shapes and dtype")
    c.fusion.unpack(data, outs)
    return outs if is_list else outs[0]


class Traffic:
    """Calls and bytes this rank has asked each operation to move, since the last ``reset``.

    Bytes are the bandwidth-optimal algorithm's bytes sent per rank (NCCL's "bus bytes"), for
    data of S bytes over n ranks: allreduce 2(n-1)/n S (a reduce-scatter, then an allgather);
    reduce_scatter and allgather (n-1)/n S, where S is the whole array (the input of a
    reduce-scatter, the output of an allgather); broadcast, reduce and send S. So the figures
    compare what ZeRO's levels cost the network, independent of the MPI's own algorithm.
    The cross-rank check's small allreduces are not counted.
    """

    def __init__(self, size: int) -> None:
        n = size
        self.factor = {"allreduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
                       "allgather": (n - 1), "broadcast": 1.0, "reduce": 1.0, "send": 1.0}
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, float] = {}

    def count(self, api: str, arrays: list[Any]) -> None:
        """Count one call of ``api`` on ``arrays`` (an allgather's inputs: n of them arrive)."""
        nbytes = arrays[0].nbytes if len(arrays) == 1 else sum(map(_NBYTES, arrays))
        self.calls[api] = self.calls.get(api, 0) + 1
        self.bytes[api] = self.bytes.get(api, 0.0) + self.factor[api] * nbytes

    def total(self) -> float:
        """Return the bytes counted, all operations together."""
        return sum(self.bytes.values())

    def reset(self) -> None:
        """Start counting again from zero."""
        self.calls.clear()
        self.bytes.clear()


class Fusion:
    """The buffers a communicator fuses lists in, the results it makes, and how data gets there.

    A backend whose library moves host memory only (MPI, unless CUDA-aware) ``stages`` CuPy
    arrays: they are always packed, into pinned host buffers (the device-to-host copies are the
    packing), and unpacked back onto the device; a single CuPy array takes the path of a list.

    Args:
        address: returns an array's data address (the backend's cheapest way).
        stages: device arrays go through host buffers.
    """

    def __init__(self, address: Callable[[Any], int], stages: bool = False) -> None:
        self.address, self.stages = address, stages
        self.to_self: SimpleQueue = SimpleQueue()  # messages this rank sent itself
        self._buffers: dict[tuple[str, np.dtype, bool], Any] = {}
        self._recycled: list[np.ndarray] = []  # large result buffers, see new_buffer
        self._copied: Any = None  # an event after the last copy from a pinned buffer

    def direct(self, arrays: list[Any]) -> bool:
        """Whether one array moves as it is (a list, or a staged device array, is packed)."""
        return len(arrays) == 1 and not (self.stages and is_cupy_array(arrays[0]))

    def fuse(self, sends: list[Any], outs: list[Any] | None, fresh: Any,
             pack: bool = True) -> tuple[Any, Any, list[Any] | None]:
        """Return flat (send, out) buffers for a collective whose result has the inputs' layout.

        ``fresh`` is the new buffer the outputs are views of (None: they were given). The third
        item lists the outputs to unpack the result into afterwards (None: the flat out is
        already their memory). ``outs`` None (reduce off the root) gives out None. ``pack``
        False leaves the buffer's values unset (broadcast off the root).
        """
        if self.direct(sends):  # [x] is the call x: the same library calls on every rank
            flat = flat_view(sends[0])
            if outs is None or outs[0] is sends[0]:
                return flat, None if outs is None else flat, None
            return flat, flat_view(outs[0]), None
        staged = self.stages and is_cupy_array(sends[0])
        if fresh is not None and not staged:
            if pack:
                self.pack(sends, into=fresh)
            return fresh, fresh, None
        if outs is sends and not staged:  # in place: a list back to back in one buffer is it
            run = checks.adjacent_run(sends, self.address)
            if run is not None:
                return run, run, None
        buf = self.pack(sends) if pack else self.buffer(sends[0], sum(s.size for s in sends))
        if outs is None:
            return buf, None, None
        return buf, buf, [fresh] if fresh is not None else outs

    def buffer(self, like: Any, numel: int) -> Any:
        """Return the reused buffer of ``numel`` elements (fresh ones cost page faults)."""
        staged = self.stages and is_cupy_array(like)
        xp = np if staged else array_module(like)
        key = (xp.__name__, like.dtype, staged)
        buf = self._buffers.get(key)
        if buf is None or buf.size < numel:
            buf = self._buffers[key] = (_pinned if staged else xp.empty)(numel, like.dtype)
        if staged and self._copied is not None:
            self._copied.synchronize()  # a copy to the device may still read the buffer
            self._copied = None
        return buf[:numel]

    def private(self, like: Any, numel: int, dtype: Any = None) -> Any:
        """Return a new buffer for one point-to-point message (on the host when staged)."""
        staged = self.stages and is_cupy_array(like)
        return (np if staged else array_module(like)).empty(numel, dtype or like.dtype)

    def pack(self, arrays: list[Any], into: Any = None) -> Any:
        """Copy arrays one after another into ``into`` (default: the reused buffer)."""
        if into is None:
            into = self.buffer(arrays[0], sum(a.size for a in arrays))
        if type(into) is np.ndarray and is_cupy_array(arrays[0]):  # device to host
            start = 0
            for a in arrays:
                a.get(out=into[start : start + a.size].reshape(a.shape), blocking=False)
                start += a.size
            array_module(arrays[0]).cuda.get_current_stream().synchronize()  # MPI reads next
        else:
            array_module(arrays[0]).concatenate(arrays, axis=None, out=into)
        return into

    def unpack(self, buf: Any, outs: list[Any] | None) -> None:
        """Copy a flat buffer into contiguous arrays, one after another (nothing for None)."""
        if outs and type(buf) is not type(outs[0]):  # onto the device, from a staging buffer
            for o, part in zip(outs, split_buffer(buf, [o.shape for o in outs]), strict=True):
                self.copy(o, part)
            return
        start = 0
        for o in outs or ():  # per array as little as it can be: a list may hold thousands
            stop = start + o.size
            (o if o.ndim == 1 else o.reshape(-1))[...] = buf[start:stop]
            start = stop

    def copy(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (same shape), from a host buffer onto the device if staged."""
        if type(src) is np.ndarray and is_cupy_array(dst):
            dst.set(np.ascontiguousarray(src))  # asynchronous: buffer() waits for it
            self._copied = array_module(dst).cuda.get_current_stream().record()
        else:
            dst[...] = src

    def new_buffer(self, like: Any, numel: int) -> Any:
        """Return a new result buffer; large host ones are recycled once nothing refers to them.

        The kernel zeroes every fresh page a large array first touches, and MPI registers each
        new address again; ``x = meta_dist.allreduce(x)`` frees such an array every call and
        asks for another of the same size. A buffer here is handed out again only when this
        list holds the sole reference (every view of it keeps it alive through ``.base``).
        """
        xp = array_module(like)
        if xp is not np or numel * like.itemsize < RECYCLE_MIN_BYTES:
            return xp.empty(numel, like.dtype)
        for held in self._recycled:
            # references: the list, ``held`` and getrefcount's argument; any more is a user's
            if held.size == numel and held.dtype == like.dtype and sys.getrefcount(held) == 3:
                return held[:]
        held = np.empty(numel, like.dtype)
        self._recycled = [*self._recycled[1 - RECYCLED_BUFFERS :], held]
        return held[:]

    def outputs(self, like: Any, shapes: list[tuple[int, ...]],
                numel: int) -> tuple[list[Any], Any]:
        """Return new outputs of ``shapes`` (``numel`` elements) as views of one buffer, and it."""
        buffer = self.new_buffer(like, numel)
        return split_buffer(buffer, shapes), buffer

    def clear(self) -> None:
        """Release every buffer (after any copy still reading one)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._buffers.clear()
        self._recycled.clear()


def _pinned(numel: int, dtype: np.dtype) -> np.ndarray:
    """Return page-locked host memory, so copies to and from the device run asynchronously."""
    try:
        import cupyx

        return cupyx.empty_pinned(numel, dtype)
    except (ImportError, AttributeError):  # older CuPy: pageable memory, synchronous copies
        return np.empty(numel, dtype)
