"""Fusion benchmark: allreduce 200 small float32 arrays one call each, or as one fused list.

    mpirun -np 2 [--bind-to core] python -m meta_dist bench fusion [--arrays 200]
        [--min-numel 100] [--max-numel 5000] [--seed 0] [--rounds 40] [--no-check]

Array sizes are drawn uniformly from [min-numel, max-numel] with a fixed seed (the same on every
rank). The arrays exist twice: allocated one by one (np.zeros each), and laid out back to back
in one buffer (``meta_dist.contiguous_arrays``, as DDP's gradient_as_bucket_view lays out
gradients). These ways to sum them across ranks are timed:
    (a) raw: one mpi4py ``Allreduce(MPI.IN_PLACE, a)`` per separately allocated array;
    (b) fused: ``meta_dist.allreduce(arrays, out=arrays)`` -- one collective for the list, in
        place, moved straight between the arrays;
    (b2) fused into new arrays: ``meta_dist.allreduce(arrays)``;
    (c) per-array: ``meta_dist.allreduce(a, out=a)`` for each array;
    (a') raw, one Allreduce per array of the one-buffer list;
    (d) fused, the one-buffer list in place: reduced as the buffer itself, no copy;
    (e) the copies fusion cannot avoid, alone: ``np.concatenate`` into a reused buffer, one raw
        Allreduce of it, and a copy back into each array (the floor of (b));
    (e2) the same without the copy back, the views of a new result made instead (the floor of
        (b2): its result buffer is recycled, see ``comm.fusion.Fusion.new_buffer``).
One sample is one pass over all arrays. Passes of every variant alternate in blocks (barrier
before each block, order rotated every block) so drift hits all alike; the time shown is the
maximum over ranks of each rank's median pass. --no-check sets META_DIST_CHECK=0 before meta_dist
starts (no cross-rank shape check per call). Rank 0 prints a table and a summary line with the
speedup of (b) over (a).

On a busy machine pass ``--bind-to core`` (Open MPI): unbound, the scheduler can stack
both ranks on one core, and then every exchange waits a whole time slice.
"""

import argparse
import os
import time

import numpy as np

from meta_dist.bench import ArgumentParser, check_counts, check_order
from meta_dist.lazy_mpi import MPI
from meta_dist.xp import split_buffer


def parse_args(argv):
    """Parse the command line."""
    p = ArgumentParser(prog="python -m meta_dist bench fusion",
                       description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arrays", type=int, default=200, help="how many arrays")
    p.add_argument("--min-numel", type=int, default=100)
    p.add_argument("--max-numel", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0, help="seed of the array sizes")
    p.add_argument("--rounds", type=int, default=40, help="timed blocks per variant")
    p.add_argument("--per-block", type=int, default=3, help="passes in one block")
    p.add_argument("--warmup", type=int, default=5, help="untimed passes per variant")
    p.add_argument("--no-check", action="store_true", help="set META_DIST_CHECK=0")
    args = p.parse_args(argv)
    check_counts(p, args, {"--arrays": 1, "--min-numel": 1, "--rounds": 1, "--per-block": 1,
                           "--warmup": 0, "--seed": 0})
    check_order(p, args, "--min-numel", "--max-numel")
    return args


def main(argv):
    """Time the variants and print the table and the summary (rank 0); return 0 if right."""
    args = parse_args(argv)
    if args.no_check:
        os.environ["META_DIST_CHECK"] = "0"  # read when the context's communicator is made
    import meta_dist  # after the flag above, so the default communicator sees it

    dctx = meta_dist.init(backend="mpi")
    world = MPI.COMM_WORLD.Dup()  # the raw calls' own communicator
    rank, size = world.rank, world.size
    sizes = np.random.default_rng(args.seed).integers(args.min_numel, args.max_numel + 1,
                                                      args.arrays)
    arrays = [np.zeros(int(n), np.float32) for n in sizes]  # zeros: in-place sums stay finite
    adjacent = meta_dist.contiguous_arrays([a.shape for a in arrays], np.float32)

    def raw():
        for a in arrays:
            world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def fused():
        meta_dist.allreduce(arrays, out=arrays)

    def fused_new():
        meta_dist.allreduce(arrays)  # new result arrays: packed, reduced, copied out

    def per_array():
        for a in arrays:
            meta_dist.allreduce(a, out=a)

    def raw_adjacent():
        for a in adjacent:
            world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    def fused_adjacent():
        meta_dist.allreduce(adjacent, out=adjacent)

    packed = np.empty(int(sizes.sum()), np.float32)
    shapes = [a.shape for a in arrays]

    def copies_alone():
        np.concatenate(arrays, out=packed)
        world.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
        for a, part in zip(arrays, split_buffer(packed, shapes), strict=True):
            a[...] = part

    def copies_alone_new():
        np.concatenate(arrays, out=packed)
        world.Allreduce(MPI.IN_PLACE, packed, op=MPI.SUM)
        return split_buffer(packed, shapes)

    variants = {"(a) raw mpi4py, one Allreduce per array": raw,
                "(b) meta_dist.allreduce(list), fused": fused,
                "(b2) fused, new arrays (out=None)": fused_new,
                "(c) meta_dist.allreduce, one call per array": per_array,
                "(a') raw per array, arrays in one buffer": raw_adjacent,
                "(d) fused, arrays in one buffer (no copy)": fused_adjacent,
                "(e) pack, raw Allreduce, unpack: (b)'s floor": copies_alone,
                "(e2) pack, raw Allreduce, views: (b2)'s floor": copies_alone_new}
    for run in variants.values():
        for _ in range(args.warmup):
            run()
    samples = {name: [] for name in variants}
    names = list(variants)
    for block in range(args.rounds):
        shift = block % len(names)  # rotate the order: no variant always runs first
        for name in names[shift:] + names[:shift]:
            world.Barrier()
            for _ in range(args.per_block):
                start = time.perf_counter()
                variants[name]()
                samples[name].append(time.perf_counter() - start)
    times = {n: world.allreduce(float(np.median(s)), op=MPI.MAX) for n, s in samples.items()}

    # correctness of the fused path on known values: every rank adds rank + 1
    ok = True
    for listed in (arrays, adjacent):
        for i, a in enumerate(listed):
            a[...] = np.arange(a.size) % 5 + rank + 1 + i
        meta_dist.allreduce(listed, out=listed)
        ok = ok and all((a == size * (np.arange(a.size) % 5 + i) + size * (size + 1) // 2).all()
                        for i, a in enumerate(listed))
    ok = world.allreduce(ok, op=MPI.LAND)

    if rank == 0:
        total = int(sizes.sum())
        check = "on" if dctx.communicator("mpi").check else "off"
        print(f"# {size} ranks, {args.arrays} float32 arrays of {args.min_numel}..{args.max_numel}"
              f" elements (seed {args.seed}), {total} elements = {total * 4 / 2**20:.2f} MiB in "
              f"all; check={check}; time = max over ranks of the median pass "
              f"({args.rounds * args.per_block} passes each)")
        base = times[names[0]]
        print(f"{'variant':<46}{'ms/pass':>9}{'µs/array':>10}{'vs (a)':>8}")
        for name, t in times.items():
            print(f"{name:<46}{t * 1e3:>9.3f}{t * 1e6 / args.arrays:>10.1f}{base / t:>7.2f}x")
        print(f"summary: fused meta_dist.allreduce is {base / times[names[1]]:.1f}x faster than "
              f"{args.arrays} raw Allreduce calls ({times[names[1]] * 1e3:.2f} vs "
              f"{base * 1e3:.2f} ms), {times[names[4]] / times[names[5]]:.1f}x on arrays in one "
              f"buffer ({times[names[5]] * 1e3:.2f} vs {times[names[4]] * 1e3:.2f} ms); "
              f"per-array meta_dist {base / times[names[3]]:.2f}x raw; the copies alone "
              f"{base / times[names[6]]:.1f}x in place, {base / times[names[7]]:.1f}x into new "
              f"arrays (fused {base / times[names[2]]:.1f}x); "
              f"fused results {'right' if ok else 'WRONG'}")
    world.Free()
    meta_dist.shutdown()
    return 0 if ok else 1

