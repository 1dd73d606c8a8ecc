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

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from meta_dist.comm import checks
from meta_dist.comm.checks import DTYPES, REDUCE_OPS, SCATTER_OPS, flat_view
from meta_dist.comm.consistency import shape_code

if TYPE_CHECKING:
    from meta_dist.comm.base import Communicator

Run = Callable[[], Any]
_NBYTES, _SIZE = operator.attrgetter("nbytes"), operator.attrgetter("size")


def allreduce(c: Communicator, send: Any, op: str, out: Any) -> Run:
    """Plan ``Communicator.allreduce``."""
    sends, is_list = inputs(c, "allreduce", send)
    checks.check_op("allreduce", op, REDUCE_OPS, sends[0].dtype)
    outs, fresh = outputs(c, "allreduce", out, sends, None, is_list)
    c.traffic.count("allreduce", sends)

    def run() -> Any:
        c._fingerprint("allreduce", sends, op=op)
        flat_send, flat_out, unpack_into = c.fusion.fuse(sends, outs, fresh)
        c._allreduce(flat_send, flat_out, op)
        c._average(flat_out, op)
        if unpack_into:
            c.fusion.unpack(flat_out, unpack_into)
        return _result(out, outs, is_list)

    return run


def reduce_scatter(c: Communicator, send: Any, op: str, out: Any) -> Run:
    """Plan ``Communicator.reduce_scatter``."""
    sends, is_list = inputs(c, "reduce_scatter", send)
    checks.check_op("reduce_scatter", op, SCATTER_OPS, sends[0].dtype)
    checks.check_rows("reduce_scatter", sends, c.size)
    shapes = [(s.shape[0] // c.size, *s.shape[1:]) for s in sends]
    outs, _ = outputs(c, "reduce_scatter", out, sends, shapes, is_list)
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
        if not direct:
            c.fusion.unpack(mine, outs)
        return _result(out, outs, is_list)

    return run


def allgather(c: Communicator, send: Any, out: Any) -> Run:
    """Plan ``Communicator.allgather``."""
    sends, is_list = inputs(c, "allgather", send)
    for s in sends:
        checks.check_axis0("allgather", s)
    shapes = [(s.shape[0] * c.size, *s.shape[1:]) for s in sends]
    outs, _ = outputs(c, "allgather", out, sends, shapes, is_list)
    c.traffic.count("allgather", sends)
    direct = c.fusion.direct(sends)

    def run() -> Any:
        c._fingerprint("allgather", sends)
        if direct:
            c._allgather(flat_view(sends[0]), flat_view(outs[0]))
            return _result(out, outs, is_list)
        seg = sum(map(_SIZE, sends))
        buf = c.fusion.buffer(sends[0], seg * c.size)
        mine = buf[c.rank * seg : (c.rank + 1) * seg]
        c.fusion.pack(sends, into=mine)
        c._allgather(mine, buf)
        by_rank, start = buf.reshape(c.size, seg), 0
        for o, s in zip(outs, sends, strict=True):
            c.fusion.copy(o.reshape(c.size, -1), by_rank[:, start : start + s.size])
            start += s.size
        return _result(out, outs, is_list)

    return run


def broadcast(c: Communicator, buf: Any, root: int, out: Any) -> Run:
    """Plan ``Communicator.broadcast``."""
    bufs, is_list = inputs(c, "broadcast", buf)
    checks.check_rank("broadcast", "root", root, c.size)
    root = int(root)  # a numpy integer (np.argmax's) would overflow in the fingerprint
    outs, fresh = outputs(c, "broadcast", out, bufs, None, is_list)
    c.traffic.count("broadcast", bufs)

    def run() -> Any:
        c._fingerprint("broadcast", bufs, root=root)
        is_root = c.rank == root
        flat_buf, flat_out, unpack_into = c.fusion.fuse(bufs, outs, fresh, pack=is_root)
        if is_root and flat_out is not flat_buf:
            flat_out[...] = flat_buf
        c._broadcast(flat_out, root)
        c.fusion.unpack(flat_out, unpack_into)
        return _result(out, outs, is_list)

    return run


def reduce(c: Communicator, send: Any, root: int, op: str, out: Any) -> Run:
    """Plan ``Communicator.reduce``."""
    sends, is_list = inputs(c, "reduce", send)
    checks.check_rank("reduce", "root", root, c.size)
    root = int(root)
    checks.check_op("reduce", op, REDUCE_OPS, sends[0].dtype)
    is_root = c.rank == root
    outs, fresh = outputs(c, "reduce", out, sends, None, is_list) if is_root else (None, None)
    c.traffic.count("reduce", sends)

    def run() -> Any:
        c._fingerprint("reduce", sends, op=op, root=root)
        flat_send, flat_out, unpack_into = c.fusion.fuse(sends, outs, fresh)
        c._reduce(flat_send, flat_out, op, root)
        if not is_root:
            return None
        c._average(flat_out, op)
        c.fusion.unpack(flat_out, unpack_into)
        return _result(out, outs, is_list)

    return run


def send(c: Communicator, send: Any, peer: int) -> Run:
    """Plan ``Communicator.send``: a header first (with the check on), then the data.

    A list (or a device array through host memory) is packed into a buffer of its own: a send
    may run beside a collective, on another thread.
    """
    sends, _ = inputs(c, "send", send)
    _check_peer(c, "send", peer)
    shapes, total = [s.shape for s in sends], sum(map(_SIZE, sends))
    c.traffic.count("send", sends)

    def run() -> None:
        if c.check:
            header = np.array([DTYPES.index(sends[0].dtype), total, shape_code(shapes)], np.int64)
            c._check_comm.Send(header, dest=peer)
        c._send(flat_view(sends[0]) if c.fusion.direct(sends) else c.fusion.pack(
            sends, into=c.fusion.private(sends[0], total)), peer)

    return run


def recv(c: Communicator, out: Any, peer: int) -> Run:
    """Plan ``Communicator.recv``: a sender whose header differs is drained, then refused."""
    outs, is_list = inputs(c, "recv", out)
    _check_peer(c, "recv", peer)
    for o in out if is_list else [out]:  # as given: inputs() copies a non-contiguous array
        checks.check_writable("recv", o)
    total, shapes, dtype = sum(map(_SIZE, outs)), [o.shape for o in outs], outs[0].dtype

    def run() -> Any:
        if c.check:
            header = np.empty(3, np.int64)
            c._check_comm.Recv(header, source=peer)
            sent, count = DTYPES[int(header[0])], int(header[1])
            if (sent, count, int(header[2])) != (dtype, total, shape_code(shapes)):
                c._recv(c.fusion.private(outs[0], count, sent), peer)  # drain it
                shaped = "" if int(header[2]) == shape_code(shapes) else " with other shapes"
                raise ValueError(
                    f"recv: rank {peer} sent {count} elements of {sent}{shaped}; "
                    f"this rank ({c.rank}) expected {total} elements of {dtype} shaped {shapes}; "
                    "send and recv must use the same shapes and dtype")
        if c.fusion.direct(outs):
            c._recv(flat_view(outs[0]), peer)
        else:
            buf = c.fusion.private(outs[0], total)
            c._recv(buf, peer)
            c.fusion.unpack(buf, outs)
        return _result(out, outs, is_list)

    return run


def _check_peer(c: Communicator, api: str, peer: int) -> None:
    """Refuse a peer out of range, or this rank itself.

    MPI's blocking send to oneself waits for a receive the same thread never posts; PyTorch
    refuses it too.
    """
    checks.check_rank(api, "peer", peer, c.size)
    if peer == c.rank:
        raise ValueError(f"{api}: peer is this rank ({peer}); expected another rank: a rank "
                         "cannot send to or receive from itself; copy the array instead")


def _result(out: Any, outs: list[Any], is_list: bool) -> Any:
    """What a call returns: its one array, or its list; ``out`` itself where one was given."""
    if not is_list:
        return outs[0]
    return outs if out is None else out


def check_open(c: Communicator, api: str) -> None:
    """Raise RuntimeError if ``c`` was closed."""
    if c.closed:
        raise RuntimeError(f"{api} called after close(); create a new communicator "
                           "(meta_dist.init() or meta_dist.make_communicator) first")


def inputs(c: Communicator, api: str, arrays: Any) -> tuple[list[Any], bool]:
    """Check the arrays a call reads (``checks.inputs``, then the backend's own check)."""
    check_open(c, api)
    sends, is_list = checks.inputs(api, arrays)
    c._check_arrays(api, sends)
    return sends, is_list


def outputs(c: Communicator, api: str, out: Any, sends: list[Any],
            shapes: list[tuple[int, ...]] | None, is_list: bool) -> tuple[list[Any], Any]:
    """Check or make the outputs (``shapes`` None: the inputs').

    Returns the outputs, and the one flat buffer they are views of when made here (else None).
    """
    if shapes is None and ((out is sends[0] and not is_list) or (
            is_list and isinstance(out, (list, tuple)) and checks.same_arrays(list(out), sends))):
        # in place: the inputs (contiguous, or they would be copies) take the result
        for o in sends:
            if not getattr(o.flags, "writeable", True):  # CuPy has no flag
                checks.check_writable(api, o)
        return sends, None
    if out is None:  # one new buffer, the outputs its views: a fused result needs no copy
        if shapes is None:
            return c.fusion.outputs(sends[0], [s.shape for s in sends], sum(map(_SIZE, sends)))
        return c.fusion.outputs(sends[0], shapes, sum(map(math.prod, shapes)))
    outs = checks.outputs(api, out, shapes or [s.shape for s in sends], sends, is_list)
    c._check_arrays(api, outs)
    if len(sends) == 1:
        checks.check_alias(api, sends[0], outs[0], c.rank, c._address)
    return outs, None


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
        """Start counting again from zero (the same dicts: one held across steps stays live)."""
        self.calls.clear()
        self.bytes.clear()
