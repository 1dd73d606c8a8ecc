"""A stop signal mid-training must stop every rank after the same step (tests/test_launch.py).

    mpirun -np N python tests/scripts/stop_signal.py MODE DIR

MODE ``planted``: the last rank sends itself SIGTERM while it computes step 3 (from its loss
function), and only that rank gets it. ``resume``: planted's run, resumed from its latest
checkpoint to the end. ``late``: one epoch, checkpointed at its end; the last rank gets SIGTERM
while it writes that checkpoint, after the last step's vote. ``outside``: every rank writes its pid
to DIR/pid-R and trains slowly for a long time, for the test to signal the ranks from outside, as
Slurm does. Checkpoints go to DIR/ckpt. Each rank prints ``rank R left after step S`` as it leaves
on a signal.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from meta_dist import checkpoint
from meta_dist import distributed as dist
from meta_dist.config import load_config
from meta_dist.nn.layers import Linear, Tanh
from meta_dist.nn.losses import softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.train import Trainer
from meta_dist.train.signals import TrainingStopped

MODE, DIR = sys.argv[1], Path(sys.argv[2])
BATCH, STEPS = 60, 10

context = dist.get_context()
rng = np.random.default_rng(3)
model = Sequential(Linear(6, 9, rng=rng), Tanh(), Linear(9, 3, rng=rng))
config = load_config({"optimizer": "adam", "lr": 0.01, "batch_size": BATCH,
                      "n_epoch": {"outside": 1000, "late": 1}.get(MODE, 2), "n_mini_batch": STEPS,
                      "checkpoint_dir": str(DIR / "ckpt"),
                      "checkpoint_every": 0 if MODE == "late" else 1000,
                      "resume_from": "latest" if MODE == "resume" else None},
                     {"zero_opt_level": 2, "bucket_size_mb": 1e-4, "backend": "mpi",
                      "device": "cpu"})
x = rng.standard_normal((BATCH * STEPS, 6)).astype(np.float32)
y = rng.integers(0, 3, BATCH * STEPS)
calls = [0]


def loss_fn(output, labels):
    calls[0] += 1
    if MODE == "outside" and calls[0] == 1:  # fit() catches the signals from here on
        (DIR / f"pid-{context.rank}").write_text(str(os.getpid()))
    if MODE == "planted" and calls[0] == 3 and context.rank == context.size - 1:
        os.kill(os.getpid(), signal.SIGTERM)
    if MODE == "outside":
        time.sleep(0.02)
    return softmax_cross_entropy(output, labels)


trainer = Trainer(model, config, loss_fn=loss_fn, log=sys.stdout)
if MODE == "late" and context.rank == context.size - 1:
    real = checkpoint.save_shard

    def save_and_get_signalled(*args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args)

    checkpoint.save_shard = save_and_get_signalled
try:
    trainer.fit(x, y)
except TrainingStopped:
    print(f"rank {context.rank} left after step {trainer.steps_done}", flush=True)
    raise
print(f"{'' if MODE == 'resume' else 'unreachable: '}rank {context.rank} finished training",
      flush=True)
