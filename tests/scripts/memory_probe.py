"""Measure one ZeRO level from outside: this rank's peak RSS growth over building and training.

    mpirun -np N python tests/scripts/memory_probe.py LEVEL DIMS BUCKET_MB

DIMS is an MLP's widths (``784-2500-2500-10``). The high-water mark (VmHWM) is reset after MPI,
meta_dist and the data are up (Linux /proc/self/clear_refs), so the growth counts the model's
construction, the trainer and three Adam steps in float32. The model is built inside
``nn.init.deferred()`` (as DeepSpeed's zero.Init): built eagerly, every rank would hold the whole
model for a moment, more than level 3 promises from 4 ranks up. Rank 0 prints one line per rank:
``rank R peak_mib P promise_mib M report_mib T buffers_mib B``, where M is DESIGN.md's model state
for the level, T what ``memory_report`` accounts for (params + grads + optimizer + buffers) and B
its buffers (staging, and level 3's gather buffers: the working set).
"""

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from meta_dist import distributed as dist  # noqa: E402
from meta_dist.config import load_config  # noqa: E402
from meta_dist.nn.init import deferred  # noqa: E402
from meta_dist.nn.layers import Linear, ReLU  # noqa: E402
from meta_dist.nn.model import Sequential  # noqa: E402
from meta_dist.train import Trainer  # noqa: E402

MIB = 2**20


def status_mib(field):
    """Return VmRSS or VmHWM of this process in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main():
    level, dims, bucket_mb = int(sys.argv[1]), [int(d) for d in sys.argv[2].split("-")], \
        float(sys.argv[3])
    context = dist.get_context()
    n, local = context.size, 4
    rng = np.random.default_rng(0)
    x = rng.standard_normal((local * n, dims[0])).astype(np.float32)
    y = rng.integers(0, dims[-1], local * n)
    config = load_config({"batch_size": local * n, "optimizer": "adam", "lr": 1e-3},
                         {"zero_opt_level": level, "bucket_size_mb": bucket_mb,
                          "backend": "mpi", "device": "cpu"})
    # the process's one-time costs before the baseline: BLAS's work buffers (its first product)
    # and MPI's transport (its first collectives), which no ZeRO level holds
    context.connector.allgather(0)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the RSS now
    base = status_mib("VmRSS")
    init = np.random.default_rng(1)
    layers = []
    with deferred():
        for a, b in zip(dims[:-1], dims[1:], strict=False):
            layers += [Linear(a, b, rng=init), ReLU()]
    trainer = Trainer(Sequential(*layers[:-1]), config, context=context, log=None)
    mine = slice(context.rank * local, (context.rank + 1) * local)
    for _ in range(3):
        trainer.train_step(x[mine], y[mine])
    peak = status_mib("VmHWM") - base
    psi = sum(trainer.model.layer_numels()) * 4 / MIB  # P: the parameters' bytes in MiB
    promise = {0: 4 * psi, 1: 2 * psi + 2 * psi / n, 2: psi + 3 * psi / n, 3: 4 * psi / n}[level]
    report = trainer.memory_report()
    held = sum(report[k] for k in ("params", "grads", "optimizer", "buffers")) / MIB
    rows = context.connector.allgather(f"rank {context.rank} peak_mib {peak:.2f} promise_mib "
                                       f"{promise:.2f} report_mib {held:.2f} buffers_mib "
                                       f"{report['buffers'] / MIB:.2f}")
    if context.rank == 0:
        print("\n".join(rows), flush=True)
    dist.shutdown()


if __name__ == "__main__":
    main()
