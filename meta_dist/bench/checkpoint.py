"""Checkpoint benchmark: save and resume time and bytes per rank, beside plain np.save.

    mpirun -np 2 python -m meta_dist bench checkpoint save DIR [--level 2]
        [--hidden 2048 --depth 6]
    mpirun -np 1 python -m meta_dist bench checkpoint load DIR [--level 0]

``save`` builds the MLP 784-H x depth-10 with Adam (22.6M parameters by default), takes one step,
and times ``Trainer.save_checkpoint`` (every rank writes its shard at once, with checksums);
rank 0 then times ``np.save`` of the same number of bytes alone, one process, into the same
directory. ``load`` times ``Trainer.load_checkpoint`` of DIR's latest checkpoint at this job's
world size and level (resharding when they differ from the save). Times are the max over
ranks, best of --repeat.
"""

import time
from pathlib import Path

import numpy as np

from meta_dist import distributed as dist
from meta_dist.bench import ArgumentParser, check_counts
from meta_dist.config import load_config
from meta_dist.lazy_mpi import MPI
from meta_dist.nn.layers import Linear, ReLU
from meta_dist.nn.model import Sequential
from meta_dist.train import Trainer


def parse_args(argv):
    """Parse the command line."""
    p = ArgumentParser(prog="python -m meta_dist bench checkpoint",
                       description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("save", "load"))
    p.add_argument("dir")
    p.add_argument("--level", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    check_counts(p, args, {"--hidden": 1, "--depth": 1, "--repeat": 1})
    return args


def main(argv):
    """Save or load the benchmark model's checkpoint and print the times (rank 0)."""
    args = parse_args(argv)
    context = dist.get_context()
    world = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    layers = [Linear(784, args.hidden, rng=rng), ReLU()]
    for _ in range(args.depth - 1):
        layers += [Linear(args.hidden, args.hidden, rng=rng), ReLU()]
    model = Sequential(*layers, Linear(args.hidden, 10, rng=rng))
    psi = sum(model.layer_numels())
    batch = 8 * context.size
    config = load_config({"optimizer": "adam", "lr": 1e-3, "batch_size": batch},
                         {"zero_opt_level": args.level, "backend": "mpi", "device": "cpu"})
    trainer = Trainer(model, config, log=None)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    mine = slice(context.rank * 8, context.rank * 8 + 8)
    trainer.train_step(x[mine], y[mine])
    root = Path(args.dir)
    times = []
    for _ in range(args.repeat):
        world.Barrier()
        start = time.perf_counter()
        if args.mode == "save":
            saved = trainer.save_checkpoint(root)
        else:
            trainer.load_checkpoint(root)
        times.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if args.mode == "save":
        mine_bytes = sum(p.stat().st_size for p in saved.glob(f"rank{context.rank:05d}.*"))
        per_rank = world.gather(mine_bytes)
    if context.rank == 0:
        what = f"{psi / 1e6:.1f}M parameters, Adam, level {args.level}, {context.size} ranks"
        if args.mode == "save":
            total = sum(per_rank)
            plain = []
            blob = np.ones(total // 4, np.float32)
            for i in range(args.repeat):
                start = time.perf_counter()
                np.save(root / f"plain-{i}.npy", blob)
                plain.append(time.perf_counter() - start)
                (root / f"plain-{i}.npy").unlink()
            print(f"# save, {what}: {total / 2**20:.1f} MiB in all, per rank "
                  + ", ".join(f"{b / 2**20:.1f}" for b in per_rank) + " MiB")
            print(f"save_checkpoint {min(times) * 1e3:.0f} ms; np.save of the same bytes, one "
                  f"process {min(plain) * 1e3:.0f} ms; ratio {min(times) / min(plain):.2f}")
        else:
            print(f"# load, {what}: load_checkpoint {min(times) * 1e3:.0f} ms")
    dist.shutdown()
    return 0

