"""ZeRO levels on CuPy arrays (NCCL, and MPI staged through the host) match the CPU result.

The MPI cases need a GPU visible to every rank (ranks may share one); the NCCL cases a GPU per
rank (see test_nccl). Skips are collective. On the CuPy/NCCL stand-in (tests/standin,
tests/standin_tests/test_standin_gpu_side.py) they run everywhere. Tolerance as in test_zero
for float64 (rtol 1e-9): cuBLAS sums in another order than numpy's BLAS, which is the same kind
of difference as splitting the batch.
"""

import dataclasses

import numpy as np
import pytest
from conftest import same_on_every_rank
from mpi4py import MPI
from test_nccl import any_gpu, cp, skip_unless_nccl_per_rank  # noqa: F401  (fixtures)
from test_zero import GLOBAL_BATCH, MODELS, STEPS, data, make_config

from meta_dist import MPIConnector
from meta_dist.distributed import DistContext
from meta_dist.train import Trainer
from meta_dist.xp import select_device


def gpu_config(level, backend, **extra):
    """test_zero's config, on CuPy through ``backend`` (it used to say mpi and cpu: the NCCL
    cases never ran NCCL)."""
    config = make_config(level, "adam", "float64", **extra)
    return dataclasses.replace(config, dist=dataclasses.replace(config.dist, backend=backend,
                                                                device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "mpi"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_gpu_training_matches_cpu(connector, any_gpu, backend, level):  # noqa: F811
    if backend == "nccl":
        skip_unless_nccl_per_rank(connector)
    cupy = any_gpu
    select_device(connector.local_rank)
    world = DistContext(MPIConnector(abort_on_exception=False), backend=backend)
    alone = DistContext(MPIConnector(MPI.COMM_SELF, abort_on_exception=False), backend="mpi")
    try:
        x, y, loss_fn = data("classifier", "float64")
        build = MODELS["classifier"][0]
        # the same host-drawn initial values, moved to the device
        model = build(np.random.default_rng(7), "float64")
        for layer in model.layers:
            for name in list(layer.params):
                layer.params[name] = cupy.asarray(layer.params[name])
                layer.grads[name] = cupy.zeros_like(layer.params[name])
        on_gpu = Trainer(model, gpu_config(level, backend, bucket_mb=1e-4), context=world,
                         loss_fn=loss_fn, log=None)
        assert on_gpu.xp is cupy
        assert on_gpu.comm.backend_name == backend
        ref = Trainer(build(np.random.default_rng(7), "float64"), make_config(0, "adam",
                      "float64"), context=alone, loss_fn=loss_fn, log=None)
        b, r = GLOBAL_BATCH // world.size, world.rank
        for step in range(STEPS):
            ref.train_step(x[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH],
                           y[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH])
            mine = slice(step * GLOBAL_BATCH + r * b, step * GLOBAL_BATCH + (r + 1) * b)
            on_gpu.train_step(cupy.asarray(x[mine]), cupy.asarray(y[mine]))
            assert same_on_every_rank(connector, cupy.asnumpy(on_gpu.stage.full_params()))
            for (name, got), want in zip(on_gpu.parameters().items(),
                                         ref.parameters().values(), strict=True):
                np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-9, atol=1e-12,
                                           err_msg=f"{name} after step {step + 1}")
        report = on_gpu.memory_report()
        # measured (the allocator's bytes) against accounted: the GPU holds at least the state
        held = sum(report[k] for k in ("params", "grads", "optimizer", "buffers"))
        assert report["peak"] >= held, report
        if level == 3 and world.size > 1:  # only this rank's shard of the parameters
            assert report["params"] < sum(a.nbytes for a in ref.parameters().values())
    finally:
        world.close()
        alone.close()
