"""Building what a Trainer runs: array module, compute dtype, overlap, the ZeRO stage, names.

Imports config, distributed, nn, optim, xp and zero (never comm: that would start MPI);
trainer.py and checkpointing.py import it, and meta_dist.train exports array_module_for.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from meta_dist import distributed as dist
from meta_dist.config import Config
from meta_dist.nn.init import DeferredValues
from meta_dist.nn.model import Sequential
from meta_dist.optim import make_optimizer
from meta_dist.xp import gpu_count, select_device
from meta_dist.zero import STAGES, FlatModel, Slot, ZeroStage
from meta_dist.zero.flat import broadcast_model

if TYPE_CHECKING:  # the interface only; importing comm would start MPI
    from meta_dist.comm.base import Communicator

OPTIMIZER_KEYS = {"sgd": ("lr", "momentum", "nesterov", "weight_decay"),
                  "adam": ("lr", "betas", "eps", "weight_decay"),
                  "adamw": ("lr", "betas", "eps", "weight_decay")}


def array_module_for(config: Config, context: dist.DistContext | None = None) -> Any:
    """Return numpy or cupy for the configured device, selecting this rank's GPU for cupy.

    ``device: auto`` means cuda when a GPU and CuPy are present on every rank, else cpu.
    Collective for ``auto`` (the ranks agree). Raises RuntimeError for ``cuda`` without a GPU.
    """
    context = context or dist.get_context()
    device = config.dist.device
    if device == "auto":
        device = "cuda" if all(context.connector.allgather(gpu_count() > 0)) else "cpu"
    if device == "cpu":
        return np
    select_device(context.local_rank)  # raises with install advice when there is no GPU
    import cupy

    return cupy


def working_dtype(precision: str, dtype: np.dtype) -> np.dtype:
    """Return the dtype the layers compute in: ``dtype`` for fp32, else float16 or bfloat16.

    numpy has no bfloat16; ml_dtypes supplies the one CuPy 14 uses as well.

    Raises:
        RuntimeError: bf16 without ml_dtypes installed.
    """
    if precision == "fp32":
        return dtype
    if precision == "fp16":
        return np.dtype(np.float16)
    try:
        import ml_dtypes
    except ImportError as error:
        raise RuntimeError(
            "precision bf16 needs the ml_dtypes package (numpy has no bfloat16); got "
            f"ImportError: {error}; pip install ml_dtypes, or use precision: fp16 or fp32"
        ) from None
    return np.dtype(ml_dtypes.bfloat16)


def resolve_overlap(setting: bool | None, xp: Any, context: dist.DistContext) -> bool:
    """Return whether buckets are reduced on a communication thread (overlap_comm).

    ``None`` decides: no on one rank, whose collectives move nothing while the thread's
    hand-offs still cost (an H200, reference MLP, one rank: DP 4.05 ms a step with the thread,
    3.49 without; ZeRO-2 9.82 and 6.09); else yes on a GPU, and on the CPU when every rank has
    a core to spare for the thread (this rank's affinity holds two cores or more, and the node
    has at least two per rank). Collective for ``None``: the ranks must agree, since the choice
    shapes the buckets.
    """
    if setting is not None:
        return setting
    if context.size == 1:
        return False
    if xp is not np:
        spare = True
    else:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        spare = affinity >= 2 and (os.cpu_count() or 1) >= 2 * context.local_size
    return all(context.connector.allgather(spare))



def make_stage(model: Sequential, config: Config, context: dist.DistContext,
               comm: Communicator, *, xp: Any, overlap: bool) -> ZeroStage:
    """Return the stage of the configured ZeRO level over ``model``, with its optimizer.

    The model moves into the stage's flat buffer (in ``working_dtype``, an fp32 master beside
    it under mixed precision) in buckets of ``bucket_size_mb``, and every rank's model becomes
    rank 0's (``share_model``). Collective.
    """
    dcfg, tcfg = config.dist, config.train
    stage_cls = STAGES[dcfg.zero_opt_level]
    dtype = np.dtype(tcfg.dtype)
    work_dtype = working_dtype(tcfg.precision, dtype)
    # bucket_size_mb is any finite float > 0: from about 1.7e302 MiB its bytes are inf, which
    # int() refuses, and no bucket is larger than the model anyway
    cap = max(1, int(min(dcfg.bucket_size_mb * 2**20, 2.0**62)) // work_dtype.itemsize)
    size = stage_cls.bucket_numel(cap, sum(model.layer_numels()), overlap)
    flat = FlatModel(model, size, context.size, xp, work_dtype,
                     master_dtype=dtype, isolate_cut_layers=stage_cls.gathers_params,
                     materialize=not stage_cls.gathers_params)  # level 3 keeps shards only
    share_model(model, flat, comm, context)
    hyper = {k: getattr(tcfg, k) for k in OPTIMIZER_KEYS[tcfg.optimizer]}

    def new_optimizer(numel: int) -> Any:
        return make_optimizer(tcfg.optimizer, numel, xp=xp, dtype=dtype, **hyper)

    stage = stage_cls(flat, comm, new_optimizer, overlap=overlap,
                      accumulate=tcfg.grad_accum_steps,
                      reshard_after_forward=dcfg.reshard_after_forward)
    if not tcfg.decay_biases_and_norms:  # matrices decay; biases and norm weights do not
        stage.optimizer.set_decay_spans(stage.optimizer_spans(lambda s: len(s.shape) >= 2))
    return stage


def share_model(model: Sequential, flat: FlatModel, comm: Communicator,
                context: dist.DistContext) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP and DeepSpeed do on wrapping.

    A per-rank seed (the commonest slip in a hand-written MPI script) would otherwise train
    a different replica on each rank, and ZeRO would stitch shards of different models.
    Collective.
    """
    deferred = [p for layer in model.layers for p in layer.params.values()
                if isinstance(p, DeferredValues)]  # a recipe each: send the root's
    recipes = context.connector.broadcast([p.recipe for p in deferred], context.root_rank)
    for values, recipe in zip(deferred, recipes, strict=True):
        values.adopt(recipe)
    broadcast_model(flat, comm, context.root_rank)
    broadcast_buffers(model, comm, context.root_rank)


def broadcast_buffers(model: Sequential, comm: Communicator, root: int) -> None:
    """Give every rank the root's buffers (BatchNorm's running statistics). Collective."""
    buffers = list(model_buffers(model).values())
    if buffers:
        comm.broadcast(buffers, root, out=buffers)


def model_buffers(model: Sequential) -> dict[str, Any]:
    """Return the model's buffers (BatchNorm's running statistics) by name, live arrays."""
    return {f"{i}.{type(layer).__name__}.{name}": getattr(layer, name)
            for i, layer in enumerate(model.layers) for name in layer.buffer_names}


def param_name(model: Sequential, slot: Slot) -> str:
    """Return the name of the parameter in ``slot``, as ``model.state()`` names it."""
    return f"{slot.layer}.{type(model.layers[slot.layer]).__name__}.{slot.name}"
