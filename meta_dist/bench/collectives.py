"""nccl-tests-style time and bandwidth of meta_dist's collectives beside the raw library call.

    mpirun -np 2 [--bind-to core] python -m meta_dist bench collectives [--min-bytes 4096]
        [--max-bytes 67108864] [--factor 4] [--dtype float32] [--ops allreduce,broadcast]
        [--no-check] [--check-cost] [--backend mpi|nccl] [--new-arrays]

For each operation and size, rank 0 prints the time through meta_dist (µs), its algbw and busbw
(GB/s; nccl-tests formulas: allreduce busbw = algbw*2(n-1)/n, reduce_scatter and allgather
algbw*(n-1)/n with S the total size, broadcast and sendrecv algbw), the raw call's time on the
SAME buffers (mpi4py in-place Allreduce, Reduce_scatter_block, Allgather, Bcast, Send/Recv; with
--backend nccl the raw cupy.cuda.nccl call), raw/meta_dist (> 1: meta_dist faster) and whether
meta_dist's result was right. Everything runs in place, except that --new-arrays calls meta_dist
as the Meta design writes it, ``x = meta_dist.allreduce(x)``: a new result array each call
(the raw call stays in place: it is what the library offers). sendrecv is a ping-pong between
ranks 0 and 1; its time is one way (half a round trip).

Timing: after warmup, blocks of meta_dist calls and raw calls alternate (barrier before each
block, order flipped every block) so drift hits both alike. Each call is timed alone; the time
shown is the MAXIMUM OVER RANKS of each rank's median. --check-cost also times, at the smallest
size, a communicator with check=False beside the default one, in the same process.

On a busy machine pass ``--bind-to core`` (Open MPI): unbound, the scheduler can stack
both ranks on one core, and then every exchange waits a whole time slice.
"""

import argparse
import time

import numpy as np

from meta_dist.bench import ArgumentParser, check_counts, check_order
from meta_dist.comm import make_communicator
from meta_dist.connector import MPIConnector
from meta_dist.lazy_mpi import MPI

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast", "sendrecv")
BUS_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "allgather": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "sendrecv": lambda n: 1.0}


def meta_call(op, comm, buf, new_arrays=False):
    """Return a no-argument function running ``op`` through meta_dist on ``buf``.

    In place, or (``new_arrays``) returning a new result array each call.
    """
    rank, size = comm.rank, comm.size
    mine = buf[rank * (buf.size // size):(rank + 1) * (buf.size // size)]
    if op == "sendrecv":
        return _ping_pong(rank, lambda p: comm.send(buf, p), lambda p: comm.recv(buf, p))
    if new_arrays:
        return {"allreduce": lambda: comm.allreduce(buf, "sum"),
                "reduce_scatter": lambda: comm.reduce_scatter(buf, "sum"),
                "allgather": lambda: comm.allgather(mine),
                "broadcast": lambda: comm.broadcast(buf, 0)}[op]
    return {"allreduce": lambda: comm.allreduce(buf, "sum", out=buf),
            "reduce_scatter": lambda: comm.reduce_scatter(buf, "sum", out=mine),
            "allgather": lambda: comm.allgather(mine, out=buf),
            "broadcast": lambda: comm.broadcast(buf, 0, out=buf)}[op]


def raw_mpi_call(op, world, buf):
    """Return a function making the plain mpi4py call, in place on ``buf`` (MPI's meaning)."""
    if op == "sendrecv":
        return _ping_pong(world.rank, lambda p: world.Send(buf, dest=p),
                          lambda p: world.Recv(buf, source=p))
    return {"allreduce": lambda: world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
            "reduce_scatter": lambda: world.Reduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM),
            "allgather": lambda: world.Allgather(MPI.IN_PLACE, buf),
            "broadcast": lambda: world.Bcast(buf, root=0)}[op]


def raw_nccl_call(op, raw, buf, rank, size):
    """Return a function making the plain cupy.cuda.nccl call on ``buf`` and waiting for it."""
    import cupy
    from cupy.cuda import nccl

    from meta_dist.comm.nccl_backend import NCCL_DTYPE_NAMES

    stream = cupy.cuda.get_current_stream()
    ptr, m = buf.data.ptr, buf.size // size
    dt = getattr(nccl, NCCL_DTYPE_NAMES[buf.dtype.name])
    mine = ptr + rank * m * buf.itemsize  # NCCL's in place: recvbuff == sendbuff + rank*count
    calls = {"allreduce": lambda: raw.allReduce(ptr, ptr, buf.size, dt, nccl.NCCL_SUM, stream.ptr),
             "reduce_scatter": lambda: raw.reduceScatter(ptr, mine, m, dt, nccl.NCCL_SUM,
                                                         stream.ptr),
             "allgather": lambda: raw.allGather(mine, ptr, m, dt, stream.ptr),
             "broadcast": lambda: raw.bcast(ptr, buf.size, dt, 0, stream.ptr)}

    def p2p(call):  # NCCL point-to-point calls must sit in a group
        nccl.groupStart()
        call()
        nccl.groupEnd()

    if op == "sendrecv":
        run = _ping_pong(rank, lambda p: p2p(lambda: raw.send(ptr, buf.size, dt, p, stream.ptr)),
                         lambda p: p2p(lambda: raw.recv(ptr, buf.size, dt, p, stream.ptr)))
    else:
        run = calls[op]
    return lambda: (run(), stream.synchronize())  # a call's time includes finishing on the GPU


def _ping_pong(rank, send, recv):
    """Rank 0 sends to 1 and waits for the echo; ranks above 1 idle (their time is ~0)."""
    if rank == 0:
        return lambda: (send(1), recv(1))
    if rank == 1:
        return lambda: (recv(0), send(0))
    return lambda: None


def verify(op, run, buf, xp, rank, size):
    """Run ``run`` once on known values; return True if meta_dist's result is right here.

    The references are numpy arrays on the host; device results are copied back to compare.
    """
    m = buf.size // size
    base = (np.arange(buf.size) % 7).astype(buf.dtype)
    buf[...] = xp.asarray(base + rank)
    got = run()
    total = base * size + size * (size - 1) // 2
    rows = slice(rank * m, (rank + 1) * m)
    if op == "sendrecv" and rank > 1:
        return True  # not part of the ping-pong
    if got is not None and op != "sendrecv":  # a new array (or out, which is buf or its rows)
        want = {"allreduce": total, "reduce_scatter": total[rows],
                "allgather": base + np.repeat(np.arange(size), m).astype(buf.dtype),
                "broadcast": base}[op]
        return bool((_host(got) == want).all())
    return bool((_host(buf) == base).all())  # the echo of rank 0's values


def _host(array):
    """Return ``array`` as a numpy array (a CuPy array is copied back)."""
    return array.get() if hasattr(array, "get") else array


def time_calls(run, iters):
    """Return the seconds of each of ``iters`` calls of ``run``."""
    out = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        out.append(time.perf_counter() - start)
    return out


def measure(world, calls, args):
    """Time the ``calls`` {name: function} in alternating blocks; return max-over-ranks medians."""
    estimate = max(float(np.median(time_calls(run, args.warmup))) for run in calls.values())
    estimate = world.allreduce(estimate, op=MPI.MAX)  # every rank must run as many calls
    iters = int(min(args.max_iters, max(3, args.block_ms / 1e3 / max(estimate, 1e-7))))
    samples = {name: [] for name in calls}
    for block in range(args.blocks):
        for name in (list(calls) if block % 2 == 0 else list(calls)[::-1]):
            world.Barrier()
            samples[name] += time_calls(calls[name], iters)
    return {name: world.allreduce(float(np.median(s)), op=MPI.MAX) for name, s in samples.items()}


def parse_args(argv):
    """Parse the command line."""
    p = ArgumentParser(prog="python -m meta_dist bench collectives",
                       description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=int, default=4096)
    p.add_argument("--max-bytes", type=int, default=64 * 2**20)
    p.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("--dtype", default="float32",
                   choices=("float16", "float32", "float64", "int32", "int64", "uint8"))
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of the default")
    p.add_argument("--backend", choices=("mpi", "nccl"), default="mpi")
    p.add_argument("--new-arrays", action="store_true",
                   help="meta_dist returns a new array each call (x = meta_dist.allreduce(x))")
    p.add_argument("--no-check", action="store_true",
                   help="communicator with check=False (no cross-rank shape check per call)")
    p.add_argument("--check-cost", action="store_true",
                   help="also time check=True and check=False side by side at --min-bytes")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per variant and size")
    p.add_argument("--blocks", type=int, default=5, help="timed blocks per variant and size")
    p.add_argument("--block-ms", type=float, default=60.0, help="target length of one block")
    p.add_argument("--max-iters", type=int, default=400, help="most calls in one block")
    args = p.parse_args(argv)
    args.ops = args.ops.split(",")
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        p.error(f"--ops: unknown {', '.join(map(repr, unknown))}; expected some of "
                f"{', '.join(OPS)}, comma-separated")
    check_counts(p, args, {"--factor": 2, "--min-bytes": 1, "--warmup": 0, "--blocks": 1,
                           "--max-iters": 1})
    check_order(p, args, "--min-bytes", "--max-bytes")
    return args


def main(argv):
    """Time the collectives beside raw mpi4py and print the table (rank 0)."""
    args = parse_args(argv)
    world = MPI.COMM_WORLD.Dup()  # the raw calls' own communicator
    rank, size = world.rank, world.size
    connector = MPIConnector()
    comms = {"meta": make_communicator(args.backend, connector, check=not args.no_check)}
    if args.check_cost:
        comms["meta check=True"] = make_communicator(args.backend, connector, check=True)
        comms["meta check=False"] = make_communicator(args.backend, connector, check=False)
    xp, raw = np, None
    if args.backend == "nccl":
        import cupy as xp
        from cupy.cuda import nccl
        xp.cuda.Device(comms["meta"].device).use()
        raw = nccl.NcclCommunicator(size, world.bcast(nccl.get_unique_id() if rank == 0 else None),
                                    rank)
        sync = xp.cuda.get_current_stream().synchronize
    say = print if rank == 0 else (lambda *a, **k: None)
    if size < 2 and "sendrecv" in args.ops:
        args.ops.remove("sendrecv")  # a ping-pong needs two ranks
    itemsize = np.dtype(args.dtype).itemsize
    sizes, nbytes = [], args.min_bytes
    while nbytes <= args.max_bytes:
        sizes.append(nbytes)
        nbytes *= args.factor

    def calls_for(op, buf, comm):
        meta = meta_call(op, comm, buf, args.new_arrays)
        if args.backend == "nccl":  # wait for the GPU after meta_dist's call as after raw's
            return (lambda: (meta(), sync())[0]), raw_nccl_call(op, raw, buf, rank, size)
        return meta, raw_mpi_call(op, world, buf)

    placement = "meta_dist into new arrays" if args.new_arrays else "in place"
    say(f"# {size} ranks, backend {args.backend}, {args.dtype}, check="
        f"{'off' if args.no_check else 'on'}, {placement}; time = max over ranks of the median; "
        f"bandwidth GB/s; raw/meta > 1 means meta_dist is faster")
    say(f"{'op':<15}{'bytes':>11}{'meta µs':>11}{'algbw':>8}{'busbw':>8}{'raw µs':>11}"
        f"{'busbw':>8}{'raw/meta':>9}  ok")
    ratios, extras, wrong = {}, {}, 0
    for op in args.ops:
        for nbytes in sizes:
            count = max(size, nbytes // itemsize // size * size)  # divisible by size: RS and AG
            buf = xp.zeros(count, args.dtype)
            meta, raw_run = calls_for(op, buf, comms["meta"])
            ok = world.allreduce(verify(op, meta, buf, xp, rank, size), op=MPI.LAND)
            wrong += not ok
            buf[...] = 0  # zeros: sums stay finite however often they run in place
            t = measure(world, {"meta": meta, "raw": raw_run}, args)
            half = 0.5 if op == "sendrecv" else 1.0  # one way of the round trip
            tm, tr, s = t["meta"] * half, t["raw"] * half, count * itemsize
            algbw = s / tm / 1e9
            factor = BUS_FACTOR[op](size)
            ratios[op] = tr / tm  # the last (largest) size's ratio is kept for the summary
            if nbytes == sizes[0]:
                extras[op] = (tm - tr) * 1e6
            say(f"{op:<15}{s:>11}{tm * 1e6:>11.1f}{algbw:>8.3f}{algbw * factor:>8.3f}"
                f"{tr * 1e6:>11.1f}{s / tr / 1e9 * factor:>8.3f}{tr / tm:>9.2f}  "
                f"{'ok' if ok else 'WRONG'}", flush=True)
    if args.check_cost:
        say(f"\n# extra µs of meta_dist over raw at {sizes[0]} bytes, same process")
        say(f"{'op':<15}{'raw µs':>9}{'check=True':>12}{'extra':>8}{'check=False':>12}{'extra':>8}")
        for op in args.ops:
            buf = xp.zeros(max(size, sizes[0] // itemsize // size * size), args.dtype)
            calls = {"raw": calls_for(op, buf, comms["meta"])[1]}
            for name in ("meta check=True", "meta check=False"):
                calls[name] = calls_for(op, buf, comms[name])[0]
            t = {k: v * (0.5 if op == "sendrecv" else 1.0) * 1e6
                 for k, v in measure(world, calls, args).items()}
            yes, no = t["meta check=True"], t["meta check=False"]
            say(f"{op:<15}{t['raw']:>9.1f}{yes:>12.1f}{yes - t['raw']:>+8.1f}{no:>12.1f}"
                f"{no - t['raw']:>+8.1f}", flush=True)
    say(f"summary: {size} ranks {args.backend} check={'off' if args.no_check else 'on'}; "
        f"raw/meta at {sizes[-1]} B: " + " ".join(f"{o} {r:.2f}x" for o, r in ratios.items())
        + f"; extra µs at {sizes[0]} B: " + " ".join(f"{o} {e:+.1f}" for o, e in extras.items())
        + f"; {'all results right' if not wrong else f'{wrong} WRONG'}")
    for comm in comms.values():
        comm.close()
    if raw is not None:
        raw.destroy()
    connector.close()
    world.Free()
    return 1 if wrong else 0

