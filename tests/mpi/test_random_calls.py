"""Random collectives, checked bit for bit: the ranks draw each call together and place it apart.

Each call (operation, op, dtype, shapes, root) comes from a generator seeded alike on every
rank; how a rank places it (in place, into new arrays or into given ones; a list's arrays
separate or back to back) comes from a generator seeded by its rank. So ranks that legally
differ in placement meet in almost every call, the case in which a choice made from a rank's
own layout would send the ranks down different MPI call sequences and hang the job. Inputs are
small integers (uint8 over its whole range, wrapping), so sums and products are exact in every
dtype and an average is that sum divided once in the dtype, as the library divides (float16's
divides first, on multiples of size: exact too): a result must equal numpy's byte for byte,
which also makes it the same bytes on every rank. Inputs of out-of-place calls come back
untouched, and an in-place reduce_scatter leaves the other ranks' rows alone. The second
communicator takes the pairwise exchange at every size in 40-byte segments, so arrays are cut
at many segment and chunk edges.
"""

import numpy as np
import pytest

from meta_dist import contiguous_arrays, make_communicator

CALLS = 400
DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint8")
OPS = {"allreduce": ("sum", "avg", "max", "min", "prod"), "reduce_scatter": ("sum", "avg"),
       "allgather": ("",), "broadcast": ("",), "reduce": ("sum", "avg", "max", "min", "prod")}
PLACEMENTS = ("new", "given", "in place")
PATHS = {  # communicator settings, and the most rows an array may have
    "library": ({}, 40_000),  # large arrays reach the pairwise reduce_scatter (128 KiB up)
    "pairwise in 40-byte segments": ({"pairwise_min_bytes": {"allreduce": 1, "reduce_scatter": 1},
                                      "segment_bytes": 40}, 400),
}


def draw_call(rng, size, most_rows):
    """Return (api, op, dtype, shapes, is_list, root): what every rank must call alike."""
    api = str(rng.choice(list(OPS)))
    dtype = np.dtype(str(rng.choice(DTYPES)))
    op = str(rng.choice([op for op in OPS[api] if op != "avg" or dtype.kind == "f"]))
    is_list = bool(rng.random() < 0.4)
    shapes = []
    for _ in range(int(rng.integers(1, 5)) if is_list else 1):
        rows = int(rng.integers(0, most_rows if rng.random() < 0.1 else 400))
        if api == "reduce_scatter":
            rows *= size
        elif rows == 0 and not is_list and api != "allgather":
            shapes.append(())  # a 0-d array, where the operation has no axis 0
            continue
        shapes.append((rows, int(rng.integers(1, 4))) if rng.random() < 0.3 else (rows,))
    return api, op, dtype, shapes, is_list, int(rng.integers(size))


def inputs_of(seed, rank, shapes, dtype, op, size):
    """Return one rank's arrays: small integers, so any reduction of them over 5 ranks is exact.

    A float16 average divides each rank's values by size before the sum (as ncclAvg does):
    they are multiples of size, so that the quotients, and their sums in any order, are exact.
    """
    rng = np.random.default_rng([seed, rank])
    if dtype == np.uint8:
        low, high = (0, 256) if op == "sum" else (0, 3 if op == "prod" else 9)
    else:
        low, high = (1, 3) if op == "prod" else (-8, 9)
    factor = size if (dtype, op) == (np.float16, "avg") else 1
    return [np.asarray(rng.integers(low, high, shape) * factor, dtype) for shape in shapes]


def reference(api, op, per_rank, rank, root):
    """Return what this rank must get, array by array, from every rank's arrays ``per_rank``."""
    size, out = len(per_rank), []
    for arrays in zip(*per_rank, strict=True):
        stack = np.stack(arrays)
        if api == "allgather":
            out.append(np.concatenate(arrays))
        elif api == "broadcast":
            out.append(arrays[root])
        elif op in ("max", "min"):
            out.append((np.maximum if op == "max" else np.minimum).reduce(stack))
        else:
            total = (np.multiply if op == "prod" else np.add).reduce(stack, dtype=stack.dtype)
            if op == "avg":
                total = total / total.dtype.type(size)  # as the library divides: once, in dtype
            if api == "reduce_scatter":
                m = len(total) // size
                total = total[rank * m:(rank + 1) * m]
            out.append(total)
    return out


def place(rng, api, sends, want, is_list, rank):
    """Return (send, out, placement) as this rank chooses to lay out and place the call."""
    if is_list and rng.random() < 0.5:  # back to back in one buffer
        adjacent = contiguous_arrays([s.shape for s in sends], sends[0].dtype)
        for a, s in zip(adjacent, sends, strict=True):
            a[...] = s
        sends = adjacent
    placement = str(rng.choice(PLACEMENTS))
    if placement == "in place" and is_list and api in ("reduce_scatter", "allgather"):
        placement = "new"  # their in-place forms are single arrays' views
    send = sends if is_list else sends[0]
    if placement == "new":
        return send, None, placement
    if placement == "given":
        outs = [np.full(w.shape, 7, w.dtype) for w in want]
        return send, (outs if is_list else outs[0]), placement
    if api == "reduce_scatter":  # this rank's rows of the input
        m = len(want[0])
        return send, send[rank * m:(rank + 1) * m], placement
    if api == "allgather":  # the input is this rank's rows of the output
        full = np.full(want[0].shape, 7, send.dtype)
        rows = full[rank * len(send):(rank + 1) * len(send)]
        rows[...] = send
        return rows, full, placement
    return send, send, placement


@pytest.mark.parametrize("path", list(PATHS))
def test_random_calls_are_exact(connector, path):
    settings, most_rows = PATHS[path]
    comm = make_communicator("mpi", connector, **settings)
    size, rank, failures = comm.size, comm.rank, []
    shared = np.random.default_rng(1234)  # the calls: alike on every rank
    own = np.random.default_rng([1234, rank])  # their placement: this rank's own
    try:
        for call in range(CALLS):
            api, op, dtype, shapes, is_list, root = draw_call(shared, size, most_rows)
            per_rank = [inputs_of(call, r, shapes, dtype, op, size) for r in range(size)]
            want = reference(api, op, per_rank, rank, root)
            send, out, placement = place(own, api, per_rank[rank], want, is_list, rank)
            sends = send if is_list else [send]
            kept = [s.copy() for s in sends]
            args = {"allreduce": (op,), "reduce_scatter": (op,), "allgather": (),
                    "broadcast": (root,), "reduce": (root, op)}[api]
            got = getattr(comm, api)(send, *args, out=out)
            what = f"call {call}: {api} {op} {dtype} {shapes} list={is_list} {placement}"
            if placement != "in place" or (api == "reduce" and rank != root):
                if any(s.tobytes() != k.tobytes() for s, k in zip(sends, kept, strict=True)):
                    failures.append(f"{what}: an input changed")  # out elsewhere, or ignored
            elif api == "reduce_scatter":  # in place: the other ranks' rows stay as they were
                m = len(want[0])
                if (send[:rank * m].tobytes() != kept[0][:rank * m].tobytes()
                        or send[(rank + 1) * m:].tobytes() != kept[0][(rank + 1) * m:].tobytes()):
                    failures.append(f"{what}: rows of other ranks changed")
            if api == "reduce" and rank != root:
                if got is not None:
                    failures.append(f"{what}: off the root got {type(got).__name__}, not None")
                continue
            results = got if is_list else [got]
            if out is not None and any(g is not o for g, o in zip(
                    results, out if is_list else [out], strict=True)):
                failures.append(f"{what}: the result is not the given out")
            for i, (g, w) in enumerate(zip(results, want, strict=True)):
                if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
                    failures.append(f"{what}: array {i} differs from numpy's")
    finally:
        comm.close()
    assert not failures, f"rank {rank}, {len(failures)} failures: " + "; ".join(failures[:5])
