"""Save or resume a checkpoint at this job's world size and ZeRO level (tests/test_launch.py).

    mpirun -np N python tests/scripts/checkpoint_job.py save DIR LEVEL
    mpirun -np N python tests/scripts/checkpoint_job.py resume DIR LEVEL
    mpirun -np N python tests/scripts/checkpoint_job.py kill DIR LEVEL

``save`` trains 2 epochs of 4 steps and checkpoints every 3 steps. ``resume`` continues from
the step-3 checkpoint (mid-epoch 1) to the end and compares every parameter with one process
that trained the same global batches without stopping (rank 0, on MPI_COMM_SELF); it prints
``match`` and the largest relative difference. ``kill`` makes rank 1 die by SIGKILL while it
saves step 4, after writing its files.
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np

from meta_dist import MPIConnector, checkpoint
from meta_dist import distributed as dist
from meta_dist.config import load_config
from meta_dist.nn.layers import Linear, Tanh
from meta_dist.nn.model import Sequential
from meta_dist.train import Trainer

MODE, DIR, LEVEL = sys.argv[1], sys.argv[2], int(sys.argv[3])
BATCH, STEPS = 120, 4  # divides 1-5 ranks


def model():
    rng = np.random.default_rng(3)
    return Sequential(Linear(6, 9, rng=rng), Tanh(), Linear(9, 7, rng=rng), Tanh(),
                      Linear(7, 3, rng=rng))


def config(**train):
    return load_config({"optimizer": "adam", "lr": 0.01, "batch_size": BATCH, "n_epoch": 2,
                        "n_mini_batch": STEPS, **train},
                       {"zero_opt_level": LEVEL, "bucket_size_mb": 1e-4, "backend": "mpi",
                        "device": "cpu"})


rng = np.random.default_rng(11)
x = rng.standard_normal((BATCH * STEPS, 6)).astype(np.float32)
y = rng.integers(0, 3, BATCH * STEPS)
context = dist.get_context()
if MODE == "kill" and context.rank == 1:
    real = checkpoint.save_shard

    def save_then_die(directory, rank, arrays):
        sums = real(directory, rank, arrays)
        if directory.name.endswith("00000004"):
            os.kill(os.getpid(), signal.SIGKILL)  # mid-save: files written, no manifest
        return sums

    checkpoint.save_shard = save_then_die
if MODE in ("save", "kill"):
    Trainer(model(), config(checkpoint_dir=DIR, checkpoint_every=3 if MODE == "save" else 2,
                            keep_last=10), log=None).fit(x, y)
else:
    resumed = Trainer(model(), config(resume_from=str(Path(DIR) / checkpoint.step_name(3))))
    resumed.fit(x, y)
    mine = resumed.parameters()  # collective: level 3 gathers them
    if context.rank == 0:
        from mpi4py import MPI

        from meta_dist.distributed import DistContext

        alone = DistContext(MPIConnector(MPI.COMM_SELF, abort_on_exception=False), "mpi")
        ref = Trainer(model(), config(), context=alone, log=None)
        ref.fit(x, y)
        worst = max(float(np.max(np.abs(mine[k] - v) / (np.abs(v) + 1e-3)))
                    for k, v in ref.parameters().items())
        print(f"{'match' if worst < 1e-4 else 'DIFFER'} largest relative difference {worst:.2e}",
              flush=True)
        alone.close()
dist.shutdown()
