"""Train a small CNN data-parallel on fake data, at the ZeRO level the config selects.

    mpirun -np 4 python3 scripts/distributed/dist_example.py [--config FILE] [KEY=VALUE ...]

The dicts below are this script's defaults; a YAML file (--config) and KEY=VALUE words override
them (e.g. ``zero_opt_level=1 optimizer=adam lr=0.001``). Rank 0 prints the training and
distribution config, the mean loss of every epoch, and the memory each rank holds.
"""

import sys

import numpy as np

from meta_dist import distributed as dist
from meta_dist.config import check_world, format_config, load_config, parse_cli
from meta_dist.nn.layers import AvgPool2d, BatchNorm, Conv2d, Flatten, Linear, Sigmoid
from meta_dist.nn.model import Sequential
from meta_dist.train import Trainer, array_module_for, load_npz, synthetic_classification

train_config = {
    "n_epoch": 4,
    "n_mini_batch": 8,
    "batch_size": 64,
    "input_shape": [3, 28, 28],
    "num_classes": 10,
    "optimizer": "adam",
    "lr": 0.0005,
    "log_every": 4,
}
meta_dist_config = {
    "enable_data_parallel": True,
    "zero_opt_level": 0,
}


def build_cnn(input_shape, num_classes, xp, dtype, seed):
    """Conv2d 3->6 5x5 pad 2, BatchNorm, Sigmoid, AvgPool 2x2, Flatten, Linear to num_classes."""
    rng = np.random.default_rng(seed)  # the same seed on every rank: identical replicas
    channels, height, width = input_shape
    kw = {"rng": rng, "dtype": dtype, "xp": xp}
    return Sequential(
        Conv2d(channels, 6, 5, padding=2, **kw), BatchNorm(6, **kw), Sigmoid(), AvgPool2d(2),
        Flatten(), Linear(6 * (height // 2) * (width // 2), num_classes, **kw))


def fail_once(error):
    """Print a configuration error once (rank 0), end every rank alike, and return 2."""
    context = dist.get_context()  # every rank hit the same error: they leave together
    if context.rank == context.root_rank:
        print(f"dist_example: {error}", file=sys.stderr, flush=True)
    dist.shutdown()
    return 2


def main(argv):
    try:
        config = load_config(train_config, meta_dist_config, *parse_cli(argv))
    except (ValueError, TypeError) as error:  # every rank sees the same error
        return fail_once(error)
    dctx = dist.init(backend=config.dist.backend)
    try:
        check_world(config, dctx.size)
    except (ValueError, TypeError) as error:
        return fail_once(error)
    hosts = dctx.connector.allgather(dctx.connector.host)
    if dctx.rank == dctx.root_rank:
        print(f"{dctx.size} rank(s) on {len(set(hosts))} node(s); "
              f"MPI: {dctx.connector.library_version}")
        print(format_config(config), flush=True)
    tcfg = config.train
    xp = array_module_for(config, dctx)
    if tcfg.data_path:
        x, y = load_npz(tcfg.data_path)
    else:  # fake images labelled by a reference CNN of the same shape (another seed)
        teacher = build_cnn(tuple(tcfg.input_shape), tcfg.num_classes, np, tcfg.dtype,
                            config.dist.seed + 1).eval()
        x, y = synthetic_classification(tcfg.n_mini_batch * tcfg.batch_size,
                                        tuple(tcfg.input_shape), tcfg.num_classes,
                                        seed=config.dist.seed, dtype=tcfg.dtype,
                                        teacher=teacher.forward)
    model = build_cnn(tuple(tcfg.input_shape), tcfg.num_classes, xp, tcfg.dtype,
                      config.dist.seed)
    trainer = Trainer(model, config, context=dctx)
    trainer.fit(x, y)
    reports = dctx.connector.allgather(trainer.memory_report())
    if dctx.rank == dctx.root_rank:
        print("memory per rank (MiB): params / grads / optimizer / buffers / peak process")
        for rank, r in enumerate(reports):
            print(f"  rank {rank}: " + " / ".join(
                f"{r[k] / 2**20:.3f}" for k in ("params", "grads", "optimizer", "buffers", "peak")))
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
