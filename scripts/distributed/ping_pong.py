"""Ping-pong (the ARK tutorial's test): rank 0 sends float16 data to rank 1, which sends it back.

    mpirun -np 2 python3 scripts/distributed/ping_pong.py [--numel 2048] [--device cpu|cuda]

Rank 0 prints the max and mean error between what it sent and what came back; both must be
exactly 0 (the exit code is 1 otherwise). Ranks above 1 take no part.
"""

import sys

import numpy as np

import meta_dist
from meta_dist import distributed as dist
from meta_dist.bench import ArgumentParser, check_counts


def main() -> int:
    # the benchmarks' parser: a mistake is one line for the job (exit 2), not a usage per rank
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2048)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    check_counts(parser, args, {"--numel": 1})  # 0: max() of nothing; < 0: numpy's traceback

    dctx = dist.get_context()
    if dctx.size < 2:
        print("ping_pong needs at least 2 ranks: mpirun -np 2 python3 "
              "scripts/distributed/ping_pong.py", file=sys.stderr)
        return 2
    xp = np
    if args.device == "cuda":
        from meta_dist.xp import select_device
        select_device(dctx.local_rank)  # without a GPU or cupy: one line saying what to do

        import cupy as xp

    sent = xp.asarray(np.random.default_rng(0).standard_normal(args.numel).astype(np.float16))
    received = xp.empty_like(sent)
    status = 0
    if dctx.rank == 0:
        meta_dist.send(sent, peer=1)
        meta_dist.recv(received, peer=1)
        error = xp.abs(received.astype(xp.float32) - sent.astype(xp.float32))
        max_error, mean_error = float(error.max()), float(error.mean())
        print(f"ping-pong of {args.numel} float16 elements on {args.device}: "
              f"max error {max_error}, mean error {mean_error}")
        status = 0 if max_error == 0 and mean_error == 0 else 1
    elif dctx.rank == 1:
        meta_dist.recv(received, peer=0)
        meta_dist.send(received, peer=0)
    status = dctx.connector.broadcast(status)
    dist.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
