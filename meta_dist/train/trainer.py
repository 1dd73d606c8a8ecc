"""Trainer: config → context → communicator → flat model → ZeRO stage → loop.

The only module that imports everything. It never branches on the ZeRO level: the stage class
chosen from ``STAGES`` is the whole difference.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meta_dist import distributed as dist
from meta_dist.config import Config, check_same_everywhere, check_world
from meta_dist.nn.losses import softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.optim import make_optimizer
from meta_dist.train.data import DistributedSampler
from meta_dist.train.guard import FiniteGuard
from meta_dist.xp import gpu_count, is_cupy_array, select_device
from meta_dist.zero import STAGES, FlatModel, ZeroStage

LossFn = Callable[[Any, Any], tuple[Any, Any]]
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


def resolve_overlap(setting: bool | None, xp: Any, context: dist.DistContext) -> bool:
    """Return whether buckets are reduced on a communication thread (overlap_comm).

    ``None`` decides: yes on a GPU, and on the CPU when every rank has a core to spare for the
    thread (this rank's affinity holds two cores or more, and the node has at least two per
    rank). Collective for ``None``: the ranks must agree, since the choice shapes the buckets.
    """
    if setting is not None:
        return setting
    if xp is not np:
        spare = True
    else:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        spare = affinity >= 2 and (os.cpu_count() or 1) >= 2 * context.local_size
    return all(context.connector.allgather(spare))


class Trainer:
    """Data-parallel training of a Sequential model at the configured ZeRO level.

    Args:
        model: the model, built with the array module from ``array_module_for`` and the same
            seed on every rank (so every replica starts identical).
        config: from ``load_config``; checked against the world size before any work.
        context: the distributed context (default: ``dist.get_context()``).
        loss_fn: ``loss_fn(output, labels) -> (loss, doutput)``; mean over the local batch.
        log: where rank 0 writes progress (None: silent).
    """

    def __init__(self, model: Sequential, config: Config, *,
                 context: dist.DistContext | None = None,
                 loss_fn: LossFn = softmax_cross_entropy, log: Any = sys.stdout) -> None:
        self.context = context or dist.get_context()
        check_world(config, self.context.size)
        check_same_everywhere(config, self.context.connector.allgather)
        self.config, self.model, self.loss_fn = config, model, loss_fn
        self.log = log if self.context.rank == self.context.root_rank else None
        self.context.enable_data_parallel = config.dist.enable_data_parallel
        self.context.zero_opt_level = config.dist.zero_opt_level
        first = next(iter(p for layer in model.layers for p in layer.params.values()), None)
        if first is None:
            raise ValueError("Trainer: the model has no parameters; expected at least one layer "
                             "with parameters (Linear, Conv2d, BatchNorm)")
        self.xp = sys.modules["cupy"] if is_cupy_array(first) else np
        backend = config.dist.backend  # "auto": by array kind (CuPy: NCCL where usable)
        self.comm = (self.context.communicator_for(first) if backend == "auto"
                     else self.context.communicator(backend))
        del first  # the flat buffer replaces every parameter array; none may outlive the copy
        self.overlap = resolve_overlap(config.dist.overlap_comm, self.xp, self.context)
        self.stage = self._make_stage(STAGES[config.dist.zero_opt_level])
        self._one_model()
        self.stage.attach()
        mode = config.dist.nonfinite
        self.guard = None if mode == "ignore" else FiniteGuard(mode, self.comm, self._param_at)
        self.steps_done = 0

    def _one_model(self) -> None:
        """Give every rank rank 0's parameters and buffers, as DDP and DeepSpeed do on wrapping.

        A per-rank seed (the commonest slip in a hand-written MPI script) would otherwise train
        a different replica on each rank, and ZeRO would stitch shards of different models.
        """
        self.stage.broadcast_params(self.context.root_rank)
        buffers = [getattr(layer, name) for layer in self.model.layers
                   for name in layer.buffer_names]
        if buffers:
            self.comm.broadcast(buffers, self.context.root_rank, out=buffers)

    def _param_at(self, offset: int) -> str:
        """Return the name of the parameter at flat ``offset`` (``i.Layer.name``)."""
        for slot in self.stage.flat.slots:
            if slot.offset <= offset < slot.offset + slot.numel:
                layer = self.model.layers[slot.layer]
                return f"{slot.layer}.{type(layer).__name__}.{slot.name}"
        return "padding"

    def _make_stage(self, stage_cls: type[ZeroStage]) -> ZeroStage:
        dcfg, tcfg = self.config.dist, self.config.train
        dtype = np.dtype(tcfg.dtype)
        cap = max(1, int(dcfg.bucket_size_mb * 2**20) // dtype.itemsize)
        size = stage_cls.bucket_numel(cap, sum(self.model.layer_numels()), self.overlap)
        flat = FlatModel(self.model, size, self.context.size, self.xp, dtype)
        hyper = {k: getattr(tcfg, k) for k in OPTIMIZER_KEYS[tcfg.optimizer]}

        def new_optimizer(numel: int) -> Any:
            return make_optimizer(tcfg.optimizer, numel, xp=self.xp, dtype=dtype, **hyper)

        return stage_cls(flat, self.comm, new_optimizer, overlap=self.overlap)

    def train_step(self, x: Any, y: Any, where: str | None = None) -> Any:
        """Run forward, backward (buckets reduced as they fill) and the update; return the loss.

        Raises NonFiniteError on every rank when the loss or the gradients were not finite
        (``meta_dist_config.nonfinite: stop``); ``where`` names the step in that message.
        """
        output = self.model.forward(x)
        loss, dout = self.loss_fn(output, y)
        self.model.backward(dout)
        self.steps_done += 1
        if self.guard is not None:
            self.guard.watch(loss)
        self.stage.step(self.guard)
        if self.guard is not None:
            self.guard.settle(where or f"step {self.steps_done}")
        return loss

    def fit(self, x: np.ndarray, y: np.ndarray) -> list[float]:
        """Train for ``n_epoch`` epochs on host arrays (x, y); return the mean loss per epoch.

        Each rank takes its part of every global batch; the epoch loss is averaged over all
        ranks and steps with one small allreduce per epoch.
        """
        tcfg = self.config.train
        sampler = DistributedSampler(len(x), tcfg.batch_size, self.context.rank,
                                     self.context.size, seed=self.config.dist.seed,
                                     max_steps=tcfg.n_mini_batch)
        self.model.train()
        history = []
        for epoch in range(tcfg.n_epoch):
            start, total = time.perf_counter(), self.xp.zeros((), np.float64)
            for step, index in enumerate(sampler.epoch(epoch), 1):
                total += self.train_step(self.xp.asarray(x[index]), self.xp.asarray(y[index]),
                                         f"epoch {epoch + 1} step {step}")
                if step % tcfg.log_every == 0:
                    self._progress(epoch, step, sampler, start, total)
            mean = self.comm.allreduce(total.reshape(1) / sampler.steps_per_epoch, "avg")
            self.comm.verify_calls()  # with META_DIST_CHECK=0, the epoch's calls compared here
            history.append(float(mean[0]))
            seconds = time.perf_counter() - start
            self._print(f"epoch {epoch + 1}/{tcfg.n_epoch}  loss {history[-1]:.4f}  "
                        f"{sampler.steps_per_epoch * tcfg.batch_size / seconds:,.0f} samples/s")
        return history

    def _progress(self, epoch: int, step: int, sampler: DistributedSampler, start: float,
                  total: Any) -> None:
        if self.log is None or step == sampler.steps_per_epoch:
            return  # the epoch line follows at once
        rate = step * sampler.batch_size / (time.perf_counter() - start)
        self._print(f"  epoch {epoch + 1} step {step}/{sampler.steps_per_epoch}  "
                    f"loss {float(total) / step:.4f} (rank 0)  {rate:,.0f} samples/s")

    def _print(self, line: str) -> None:
        if self.log is not None:
            print(line, file=self.log, flush=True)

    def memory_report(self) -> dict[str, int]:
        """Bytes of params, grads, optimizer state and buffers this rank holds, and its peak.

        ``peak`` is measured, not derived: on the CPU the process's resident high-water mark
        (VmHWM, which ``/proc/self/clear_refs`` can reset), on a GPU the bytes the CuPy memory
        pool holds now (blocks in use and cached free ones).
        """
        report = self.stage.memory_report()
        if self.xp is np:
            report["peak"] = resident_peak()
        else:
            report["peak"] = int(self.xp.get_default_memory_pool().total_bytes())
        return report


def resident_peak() -> int:
    """Return this process's peak resident memory in bytes (VmHWM; ru_maxrss off Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
