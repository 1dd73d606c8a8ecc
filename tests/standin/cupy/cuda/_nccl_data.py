"""What the stand-in's NCCL calls compute on a stream: messages to peers and reductions.

Imports numpy only (ml_dtypes for fp8, when installed). ``cupy.cuda.nccl`` plans each call;
these functions say which peers a call sends to and receives from, and how received bytes
become the result (usage/operations.html): reductions run in rank order, and for 16-bit and
8-bit floats every partial result is rounded to the element type, as NCCL keeps intermediate
values in the element type (gpu_facts.md 7). bfloat16 is handled as raw 16-bit storage
(round to nearest even), so uint16 arrays and ml_dtypes.bfloat16 arrays both work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

ALLREDUCE, BROADCAST, REDUCE, ALLGATHER, REDUCESCATTER, P2P = 1, 2, 3, 4, 5, 6
NCCL_AVG = 4
# ncclDataType_t -> (name, numpy storage dtype, first NCCL version that has it)
DATATYPES: dict[int, tuple[str, str, tuple[int, int, int]]] = {
    0: ("int8", "int8", (2, 0, 0)), 1: ("uint8", "uint8", (2, 0, 0)),
    2: ("int32", "int32", (2, 0, 0)), 3: ("uint32", "uint32", (2, 0, 0)),
    4: ("int64", "int64", (2, 0, 0)), 5: ("uint64", "uint64", (2, 0, 0)),
    6: ("float16", "float16", (2, 0, 0)), 7: ("float32", "float32", (2, 0, 0)),
    8: ("float64", "float64", (2, 0, 0)), 9: ("bfloat16", "uint16", (2, 10, 0)),
    10: ("float8_e4m3", "uint8", (2, 24, 0)), 11: ("float8_e5m2", "uint8", (2, 24, 0)),
}
# max and min skip NaN: NCCL reduces floats with fmaxf/fminf (fmax/fmin for double, __hmax and
# __hmin for 16-bit floats: NaN only where both are NaN), src/device/reduce_kernel.h
OPS: dict[int, tuple[str, Callable[..., Any], tuple[int, int, int]]] = {
    0: ("sum", np.add, (2, 0, 0)), 1: ("prod", np.multiply, (2, 0, 0)),
    2: ("max", np.fmax, (2, 0, 0)), 3: ("min", np.fmin, (2, 0, 0)),
    4: ("avg", np.add, (2, 10, 0)),
}


def fp8(datatype: int) -> Any:
    """Return the ml_dtypes dtype of fp8 datatype 10 or 11, or None without ml_dtypes."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes.float8_e4m3fn if datatype == 10 else ml_dtypes.float8_e5m2


def outgoing(call: Any, me: int, n: int, data: np.ndarray | None
              ) -> list[tuple[int, np.ndarray]]:
    others = [p for p in range(n) if p != me]
    if call.kind in (ALLREDUCE, ALLGATHER):
        return [(p, data) for p in others]
    if call.kind == BROADCAST:
        return [(p, data) for p in others] if me == call.root else []
    if call.kind == REDUCE:
        return [] if me == call.root else [(call.root, data)]
    if call.kind == REDUCESCATTER:
        block = len(data) // n if data is not None else 0
        return [(p, data[p * block:(p + 1) * block]) for p in others]
    if call.send is not None or call.name == "send":  # P2P send (count 0: empty payload)
        return [(call.root, data if data is not None else np.empty(0, np.uint8))]
    return []


def incoming(call: Any, me: int, n: int) -> list[int]:
    others = [p for p in range(n) if p != me]
    if call.kind in (ALLREDUCE, ALLGATHER, REDUCESCATTER):
        return others
    if call.kind == BROADCAST:
        return [] if me == call.root else [call.root]
    if call.kind == REDUCE:
        return others if me == call.root else []
    return [call.root] if call.name == "recv" else []


ONE_RANK_AVG_FIXED = (2, 29, 7)  # NVIDIA/nccl#1950, fixed in v2.29.7-1


def one_rank_avg_written(nbytes: int, itemsize: int) -> int:
    """Return how many bytes NCCL before 2.29.7 writes of a floating avg on one rank.

    One rank reduces with oneRankReduce (src/device/onerank.cu): min(32, ceil(nbytes / 16 KiB))
    blocks of alignUp(n // blocks, 16 // itemsize) elements each, so the last
    n - blocks * (n // blocks) elements stay unwritten where that alignment adds nothing
    (NVIDIA/nccl#1950, "One-rank avg reduction missing elements"; seen on a real H200 with NCCL
    2.28.3: 17 of 70001 float32 elements).
    """
    n = nbytes // itemsize
    if n == 0:
        return 0
    blocks = min(32, -(-nbytes // (16 << 10)))
    per_pack = max(1, 16 // itemsize)
    step = -(-(n // blocks) // per_pack) * per_pack
    return min(n, blocks * step) * itemsize


def finish(call: Any, me: int, n: int, mine: np.ndarray | None,
           payloads: dict[int, np.ndarray], version: tuple[int, int, int]) -> None:
    if call.recv is None:
        return
    name, storage, _ = DATATYPES[call.datatype]
    if (n == 1 and call.op == NCCL_AVG and call.kind in (ALLREDUCE, REDUCE, REDUCESCATTER)
            and version < ONE_RANK_AVG_FIXED and "float" in name):  # ncclDevPreMulSum
        written = one_rank_avg_written(len(mine), np.dtype(storage).itemsize)
        call.recv.write_prefix(reduce([mine[:written]], call.datatype, call.op, 1))
        return
    if call.kind == P2P or (call.kind == BROADCAST and me != call.root):
        call.recv.write(payloads[call.root])
    elif call.kind == BROADCAST:
        call.recv.write(mine)
    elif call.kind == ALLGATHER:
        call.recv.write(np.concatenate([mine if p == me else payloads[p] for p in range(n)]))
    else:
        if call.kind == REDUCESCATTER:
            block = len(mine) // n
            mine = mine[me * block:(me + 1) * block]
        parts = [mine if p == me else payloads[p] for p in range(n)]
        call.recv.write(reduce(parts, call.datatype, call.op, n))


def reduce(parts: list[np.ndarray], datatype: int, op: int, n: int) -> np.ndarray:
    """Reduce byte blocks in rank order, keeping each partial result in the element type.

    avg is what NCCL's hostToDevRedOp (src/enqueue.cc) makes of ncclAvg: for floating types
    ncclDevPreMulSum, each input multiplied by 1/nranks (rounded to the element type) before
    the sum, so an fp16 average does not overflow where the sum would; for integers
    ncclDevSumPostDiv, the sum divided by nranks, truncated.
    """
    low = datatype in (6, 9, 10, 11)
    values = [decode(p, datatype) for p in parts]
    premultiply = op == NCCL_AVG and values[0].dtype.kind == "f"
    if premultiply:
        scale = _in_type(np.asarray([1.0 / n], values[0].dtype), datatype)
        values = [_in_type(v * scale, datatype) for v in values]
    fn = OPS[op][1]
    acc = values[0]
    for v in values[1:]:
        acc = fn(acc, v)
        if low:
            acc = _in_type(acc, datatype)  # intermediate rounded to the type
    if op == NCCL_AVG and not premultiply:
        acc = np.sign(acc) * (np.abs(acc) // n) if acc.dtype.kind == "i" else acc // n
    return encode(acc, datatype)


def _in_type(values: np.ndarray, datatype: int) -> np.ndarray:
    """Round ``values`` to NCCL datatype ``datatype`` (returned decoded, for arithmetic)."""
    return decode(encode(values, datatype), datatype)


def decode(raw: np.ndarray, datatype: int) -> np.ndarray:
    storage = np.dtype(DATATYPES[datatype][1])
    if datatype == 9:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if datatype in (10, 11):
        return raw.view(fp8(datatype)).astype(np.float32)
    values = raw.view(storage)
    return values.astype(np.float32) if datatype == 6 else values


def encode(values: np.ndarray, datatype: int) -> np.ndarray:
    if datatype == 9:
        bits = values.astype(np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16)
        rounded = np.where(np.isnan(values), (bits >> 16) | np.uint32(0x40), rounded)
        return rounded.astype(np.uint16).view(np.uint8)
    if datatype in (10, 11):
        return values.astype(fp8(datatype)).view(np.uint8)
    return np.asarray(values).astype(DATATYPES[datatype][1]).view(np.uint8)
