"""Train a small CNN data-parallel, at the ZeRO level the config selects.

    mpirun -np 4 python3 scripts/distributed/dist_example.py [--config FILE] [KEY=VALUE ...]

The dicts below are this script's defaults: 1797 real handwritten 8x8 digits (shipped with
meta_dist), on which the held-out accuracy rises from about 10% to about 92% in seconds.
``dataset=synthetic`` trains on images of any ``input_shape`` labelled by a reference CNN of the
same shape (to size a model; it learns little in a few steps), ``data_path=FILE.npz`` on your
own. A YAML file (--config) and KEY=VALUE words override the defaults (e.g. ``zero_opt_level=1
optimizer=sgd lr=0.05``). Rank 0 prints the training and distribution config, the mean loss
of every epoch, the accuracy on held-out samples (20%, never trained on; none for a data_path
file whose other 80% would hold less than one global batch: all of it trains) before and after
training, and per rank the memory its ZeRO level should hold (from the partition plan), what it
holds, and its measured peak growth since before the model was built.
"""

import sys

import numpy as np

from meta_dist import distributed as dist
from meta_dist.config import check_world, format_config, load_config, parse_cli
from meta_dist.errors import UsageError
from meta_dist.nn.conv import AvgPool2d, Conv2d
from meta_dist.nn.layers import Flatten, Linear, Sigmoid
from meta_dist.nn.model import Sequential
from meta_dist.nn.norm import BatchNorm
from meta_dist.train import Trainer, array_module_for, load_npz, synthetic_classification
from meta_dist.train.data import check_samples, held_out, load_digits
from meta_dist.train.memory import HEADING, PeakMeter, format_memory
from meta_dist.xp import to_numpy

train_config = {
    "n_epoch": 10,
    "n_mini_batch": 22,
    "batch_size": 64,
    "dataset": "digits",
    "input_shape": [1, 8, 8],
    "num_classes": 10,
    "optimizer": "adam",
    "lr": 0.01,
    "log_every": 11,
}
meta_dist_config = {
    "enable_data_parallel": True,
    "zero_opt_level": 0,
}
UNUSED_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "dropout", "eval_every")  # the GPT's
HELD_OUT = 0.2  # of every data source: the samples whose accuracy is printed


def check_keys(config):
    """Raise UsageError for a key this script would ignore (train_gpt.py's model and
    evaluation keys)."""
    given = [f"train_config.{key} (set in {config.sources[f'train_config.{key}']})"
             for key in UNUSED_KEYS
             if config.sources.get(f"train_config.{key}", "default") != "default"]
    if given:
        raise UsageError(f"{', '.join(given)}: not used by dist_example.py, which trains a "
                         "small CNN; remove it (train_gpt.py takes the GPT's shape)")


def check_image_shape(config):
    """Raise UsageError unless train_config.input_shape is [channels, height, width], both
    sides at least 2 (the CNN pools 2x2)."""
    shape = list(config.train.input_shape)
    if len(shape) != 3 or shape[1] < 2 or shape[2] < 2:
        where = config.sources.get("train_config.input_shape", "script")
        raise UsageError(f"train_config.input_shape (set in {where}): this script's CNN takes "
                         f"images; got {shape}, expected [channels, height, width] with height "
                         "and width >= 2 (data: an .npz whose x is (N, C, H, W))")


def build_cnn(input_shape, num_classes, xp, dtype, seed):
    """Conv2d 3->6 5x5 pad 2, BatchNorm, Sigmoid, AvgPool 2x2, Flatten, Linear to num_classes."""
    rng = np.random.default_rng(seed)  # the same seed on every rank: identical replicas
    channels, height, width = input_shape
    kw = {"rng": rng, "dtype": dtype, "xp": xp}
    return Sequential(
        Conv2d(channels, 6, 5, padding=2, **kw), BatchNorm(6, **kw), Sigmoid(), AvgPool2d(2),
        Flatten(), Linear(6 * (height // 2) * (width // 2), num_classes, **kw))


def load_data(config):
    """Return (x, y) to train on and (x, y) held out: 20% of any source (none of a data_path
    file whose other 80% would hold less than one global batch)."""
    tcfg, seed = config.train, config.dist.seed
    if tcfg.data_path:
        where = f"train_config.data_path (set in {config.sources['train_config.data_path']})"
        try:
            x, y = load_npz(tcfg.data_path)
        except UsageError as error:  # the file's own message, and the key that named it
            raise UsageError(f"{where}: {error}") from None
        if x.ndim != 4:
            raise UsageError(f"{where} {tcfg.data_path}: samples of shape {tuple(x.shape[1:])}; "
                             "this script's CNN takes images of train_config.input_shape "
                             f"{list(tcfg.input_shape)}: expected x of shape (N, C, H, W); "
                             "reshape the data (one channel: x.reshape(len(x), 1, H, W))")
        check_samples(x, y, tcfg.input_shape, tcfg.num_classes, tcfg.batch_size,
                      f"{where} {tcfg.data_path}")
    elif tcfg.dataset == "digits":
        x, y = load_digits()
        x = x.astype(tcfg.dtype)
    else:  # fake images labelled by a reference CNN of the same shape (another seed); the
        # training samples are those of earlier versions, 20% more drawn after them held out
        teacher = build_cnn(tuple(tcfg.input_shape), tcfg.num_classes, np, tcfg.dtype,
                            seed + 1).eval()
        n = tcfg.n_mini_batch * tcfg.batch_size
        x, y = synthetic_classification(n + n // 4, tuple(tcfg.input_shape), tcfg.num_classes,
                                        seed=seed, dtype=tcfg.dtype, teacher=teacher.forward)
        return x[:n], y[:n], x[n:], y[n:]
    train, out = held_out(len(x), HELD_OUT, seed)
    if tcfg.data_path and len(train) < tcfg.batch_size:  # a file of one batch, not one besides
        return x, y, x[:0], y[:0]  # 20% out: all of it trains (fit would blame the file)
    return x[train], y[train], x[out], y[out]


class Accuracy:
    """Print the accuracy on held-out samples (rank 0). Collective: every rank runs the same
    forward (at ZeRO-3 the forward gathers parameters)."""

    def __init__(self, trainer, x, y):
        self.trainer, self.x, self.y = trainer, x, y

    def __call__(self, step):
        xp = self.trainer.xp
        right = 0
        for start in range(0, len(self.x), 256):
            logits = self.trainer.model.forward(xp.asarray(self.x[start : start + 256]))
            predicted = to_numpy(logits.argmax(axis=-1))
            right += int((predicted == self.y[start : start + 256]).sum())
        if self.trainer.context.rank == 0:
            print(f"held-out accuracy {right / len(self.y):.3f} ({len(self.y)} samples) "
                  f"after step {step}", flush=True)


def main(argv):
    # a mistake in the config raises UsageError: one message for the job (meta_dist.failfast)
    config = load_config(train_config, meta_dist_config,
                         *parse_cli(argv, train_config, meta_dist_config))
    dctx = dist.init(backend=config.dist.backend)
    check_world(config, dctx.size)
    check_keys(config)
    check_image_shape(config)
    hosts = dctx.connector.allgather(dctx.connector.host)
    if dctx.rank == dctx.root_rank:
        print(f"{dctx.size} rank(s) on {len(set(hosts))} node(s); "
              f"MPI: {dctx.connector.library_version}")
        print(format_config(config), flush=True)
    tcfg = config.train
    xp = array_module_for(config, dctx)
    x, y, x_out, y_out = load_data(config)
    meter = PeakMeter(xp)
    meter.reset()  # the peak growth counts from here: the model, the trainer, training
    model = build_cnn(tuple(tcfg.input_shape), tcfg.num_classes, xp, tcfg.dtype,
                      config.dist.seed)
    trainer = Trainer(model, config, context=dctx)
    trainer.fit(x, y, evaluate=Accuracy(trainer, x_out, y_out) if len(y_out) else None)
    lines = dctx.connector.allgather(format_memory(trainer.predicted_memory(),
                                                   trainer.memory_report(), meter.growth()))
    if dctx.rank == dctx.root_rank:
        print(HEADING)
        for rank, line in enumerate(lines):
            print(f"  rank {rank}: {line}")
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
