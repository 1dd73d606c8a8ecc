"""Train a small GPT (nanoGPT's shape) on the characters of Python's own standard library.

    mpirun -np 4 python3 scripts/distributed/train_gpt.py --config configs/gpt-tiny.yaml \
        [KEY=VALUE ...]

The corpus is the sources of a fixed list of standard-library modules (``train.data.char_corpus``:
it ships with every Python, nothing is downloaded), 90% to train on and the last 10% held out.
The dicts below are this script's defaults; a YAML file (--config) and KEY=VALUE words override
them (``max_steps=200 eval_every=50 zero_opt_level=3``). Rank 0 prints the configuration, then at
step 0, every ``eval_every`` steps and the last step a line ``step N  train loss X  val loss Y
tokens/s T``, then each rank's memory and a short sample of generated text.
"""

import sys
import time

import numpy as np

from meta_dist import distributed as dist
from meta_dist.config import check_world, format_config, load_config, parse_cli
from meta_dist.errors import UsageError
from meta_dist.models.gpt import gpt
from meta_dist.nn.losses import cross_entropy_tokens
from meta_dist.train import Trainer, array_module_for
from meta_dist.train.data import char_corpus, windows
from meta_dist.xp import to_numpy

train_config = {
    "optimizer": "adamw",
    "lr": 0.003,
    "betas": [0.9, 0.99],
    "weight_decay": 0.1,
    "decay_biases_and_norms": False,  # nanoGPT's groups: only matrices and embeddings decay
    "batch_size": 32,
    "n_mini_batch": 1_000_000,  # an epoch is every window once; max_steps ends the run
    "max_steps": 200,
    "eval_every": 50,
    "lr_schedule": "cosine",
    "warmup_steps": 20,
    "clip_grad_norm": 1.0,
    "log_every": 1_000_000,  # the evaluation lines report progress
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "block_size": 32,
}
meta_dist_config = {"enable_data_parallel": True, "zero_opt_level": 0}
EVAL_WINDOWS = 256  # validation windows per evaluation (shared out among the ranks)
UNUSED_KEYS = ("data_path", "dataset", "input_shape", "num_classes")  # dist_example's data
SAMPLE_CHARS = 80


class Evaluation:
    """The loss on held-out windows, and the training throughput since the last evaluation."""

    def __init__(self, trainer, x_val, y_val, x_train, y_train, tokens_per_step):
        self.trainer, self.tokens_per_step = trainer, tokens_per_step
        context = trainer.context
        part = slice(context.rank, EVAL_WINDOWS, context.size)  # every rank a share
        self.val = (x_val[:EVAL_WINDOWS][part], y_val[:EVAL_WINDOWS][part])
        self.train = (x_train[:EVAL_WINDOWS][part], y_train[:EVAL_WINDOWS][part])
        self.last = (0, time.perf_counter())

    def __call__(self, step):
        """Print ``step N  train loss X  val loss Y  T tokens/s`` (rank 0). Collective."""
        train_loss, val_loss = self.loss(*self.train), self.loss(*self.val)
        steps, started = step - self.last[0], self.last[1]
        rate = steps * self.tokens_per_step / (time.perf_counter() - started) if steps else 0.0
        if self.trainer.context.rank == 0:
            print(f"step {step}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
                  f"{rate:,.0f} tokens/s", flush=True)
        self.last = (step, time.perf_counter())

    def loss(self, x, y):
        """Mean loss over every rank's windows (forward only, in eval mode). Collective.

        The windows go through in pieces of a training step's local batch, so evaluating holds
        no more activations than training does.
        """
        trainer = self.trainer
        xp, piece = trainer.xp, trainer.config.train.batch_size // trainer.context.size
        total = 0.0
        for start in range(0, len(x), piece):
            part = slice(start, start + piece)
            loss, _ = cross_entropy_tokens(trainer.model.forward(xp.asarray(x[part])),
                                           xp.asarray(y[part]))
            total += float(loss) * len(x[part])
        # two host numbers: through the connector, whatever the backend (NCCL takes device
        # arrays only)
        every = trainer.context.connector.allgather((total, len(x)))
        return sum(t for t, _ in every) / sum(n for _, n in every)


def sample(trainer, vocab, prompt, count, seed):
    """Generate ``count`` characters after ``prompt``, sampled at temperature 0.8.

    Collective: at ZeRO-3 every forward gathers parameters, so every rank generates the same
    text (one seed) in step.
    """
    xp, block = trainer.xp, trainer.config.train.block_size
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = [lookup.get(c, 0) for c in prompt]
    rng = np.random.default_rng(seed)
    trainer.model.eval()
    for _ in range(count):
        logits = trainer.model.forward(xp.asarray(np.array([ids[-block:]])))
        last = to_numpy(logits[0, -1]).astype(np.float64)
        p = np.exp((last - last.max()) / 0.8)
        ids.append(int(rng.choice(len(vocab), p=p / p.sum())))
    trainer.model.train()
    return "".join(vocab[i] for i in ids)


def check_keys(config, corpus_chars):
    """Raise UsageError for a key this script would ignore, or a block_size the corpus lacks."""
    given = [f"train_config.{key} (set in {config.sources[f'train_config.{key}']})"
             for key in UNUSED_KEYS
             if config.sources.get(f"train_config.{key}", "default") != "default"]
    if given:
        raise UsageError(f"{', '.join(given)}: not used by train_gpt.py, which trains on the "
                         "characters of Python's standard library; remove it (dist_example.py "
                         "takes a data file)")
    held_out = corpus_chars - int(corpus_chars * 0.9)
    if config.train.block_size >= held_out:
        where = config.sources.get("train_config.block_size", "default")
        raise UsageError(f"train_config.block_size (set in {where}): longer than the held-out "
                         f"text; got {config.train.block_size}, expected at most "
                         f"{held_out - 1}")


def main(argv):
    # a mistake in the config raises UsageError: one message for the job (meta_dist.failfast)
    config = load_config(train_config, meta_dist_config,
                         *parse_cli(argv, train_config, meta_dist_config))
    context = dist.init(backend=config.dist.backend)
    check_world(config, context.size)
    tcfg = config.train
    ids, vocab = char_corpus()
    check_keys(config, len(ids))
    cut = int(len(ids) * 0.9)
    x_train, y_train = windows(ids[:cut], tcfg.block_size)
    x_val, y_val = windows(ids[cut:], tcfg.block_size)
    xp = array_module_for(config, context)
    model = gpt(len(vocab), tcfg.block_size, tcfg.n_layer, tcfg.n_head, tcfg.n_embd,
                dropout=tcfg.dropout, seed=config.dist.seed, dtype=np.dtype(tcfg.dtype), xp=xp)
    if context.rank == 0:
        print(format_config(config), flush=True)
    trainer = Trainer(model, config, loss_fn=cross_entropy_tokens)
    if context.rank == 0:  # the tied head's weight is the token table: counted once
        print(f"{context.size} rank(s); corpus {len(ids):,} characters of the standard library, "
              f"vocabulary {len(vocab)}; {len(x_train):,} training windows of {tcfg.block_size}; "
              f"{trainer.stage.flat.numel:,} parameters", flush=True)
    evaluation = Evaluation(trainer, x_val, y_val, x_train, y_train,
                            tcfg.batch_size * tcfg.block_size)
    trainer.fit(x_train, y_train, evaluate=evaluation)
    report = trainer.memory_report()
    every = context.connector.allgather(report)
    text = sample(trainer, vocab, "def ", SAMPLE_CHARS, config.dist.seed)
    if context.rank == 0:
        for rank, r in enumerate(every):
            print(f"  rank {rank}: params {r['params'] / 2**20:.2f} MiB  grads "
                  f"{r['grads'] / 2**20:.2f} MiB  optimizer {r['optimizer'] / 2**20:.2f} MiB  "
                  f"buffers {r['buffers'] / 2**20:.2f} MiB  peak RSS {r['peak'] / 2**20:.0f} MiB")
        print("sample:\n" + text, flush=True)
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
