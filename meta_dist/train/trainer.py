"""Trainer: config → context → communicator → flat model → ZeRO stage → loop.

The glue: may import anything (build.py makes the stage, checkpointing.py saves and resumes);
meta_dist.train exports it. It never branches on the ZeRO level: the stage class build.py
picks from ``STAGES`` is the whole difference.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

import meta_dist.failfast as failfast
from meta_dist import distributed as dist
from meta_dist.config import Config, check_same_everywhere, check_world
from meta_dist.errors import UsageError
from meta_dist.nn.dropout import dropouts, number_forward, set_dropout_rank
from meta_dist.nn.init import DeferredValues
from meta_dist.nn.losses import softmax_cross_entropy
from meta_dist.nn.model import Sequential
from meta_dist.trace import Trace
from meta_dist.train import checkpointing
from meta_dist.train.build import make_stage, param_name, resolve_overlap
from meta_dist.train.data import DistributedSampler, check_same_data
from meta_dist.train.guard import StepGuard
from meta_dist.train.memory import PeakMeter
from meta_dist.train.scaler import LossScaler
from meta_dist.train.schedule import learning_rate
from meta_dist.train.signals import StopSignals, TrainingStopped
from meta_dist.xp import is_cupy_array
from meta_dist.zero.memory import predict

LossFn = Callable[[Any, Any], tuple[Any, Any]]


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
        self.context.set_stall_timeout(config.dist.stall_timeout)  # the environment wins
        self.context.enable_data_parallel = config.dist.enable_data_parallel
        self.context.zero_opt_level = config.dist.zero_opt_level
        first = next(iter(p for layer in model.layers for p in layer.params.values()), None)
        if first is None:
            raise ValueError("Trainer: the model has no parameters; expected at least one layer "
                             "with parameters (Linear, Conv2d, BatchNorm)")
        if isinstance(first, DeferredValues):  # built in nn.init.deferred(): a recipe
            self.xp, first = first.xp, first.xp.zeros(1, first.dtype)
        else:
            self.xp = sys.modules["cupy"] if is_cupy_array(first) else np
        backend = config.dist.backend  # "auto": by array kind (CuPy: NCCL where usable)
        self.comm = (self.context.communicator_for(first) if backend == "auto"
                     else self.context.communicator(backend))
        del first  # the flat buffer replaces every parameter array; none may outlive the copy
        self.trace = (Trace(config.dist.trace, self.context.rank, self.context.connector.host)
                      if config.dist.trace else None)  # fit records into it and writes it
        if self.xp is not np and self.log is not None:
            self.log.write(self.context.device_route(self.comm) + "\n")
        self.overlap = resolve_overlap(config.dist.overlap_comm, self.xp, self.context)
        self.memory = PeakMeter(self.xp)  # a GPU's pool peak counts from the first meter
        self.stage = make_stage(model, config, self.context, self.comm, xp=self.xp,
                                overlap=self.overlap)
        self.work_dtype = self.stage.flat.dtype  # the layers compute in it (working_dtype)
        self.stage.attach()
        set_dropout_rank(model.layers, self.context.rank)  # ranks drop different elements
        self._dropouts = dropouts(model.layers)
        tcfg, dcfg = config.train, config.dist
        self.scaler = None if tcfg.precision != "fp16" else LossScaler(
            2.0**16 if tcfg.loss_scale == "dynamic" else tcfg.loss_scale,
            dynamic=tcfg.loss_scale == "dynamic", max_skipped_steps=dcfg.max_skipped_steps)
        self.signals = StopSignals()  # caught while fit() runs; every rank votes in the guard
        self.guard = StepGuard(self.comm, self._param_at, mode=dcfg.nonfinite,
                               clip=tcfg.clip_grad_norm, scaler=self.scaler,
                               max_skipped_steps=dcfg.max_skipped_steps,
                               stop_vote=lambda: self.signals.pending())
        self.steps_done = 0  # optimizer steps taken
        self.total_steps: int | None = None  # for the schedule; fit() sets it
        self.position = (0, 0)  # (epoch, steps done in it): where a checkpoint resumes
        self.last_checkpoint: Path | None = None  # saved or loaded last (save_once: not again)
        self._evaluate: Callable[[int], None] | None = None  # fit's, while it runs

    def parameters(self) -> dict[str, Any]:
        """Return {name: the parameter's current values} (``model.state()``'s names).

        At level 3 the parameters are sharded: this gathers them (collective) into a new
        array; at levels 0-2 the values are views of the live parameters.
        """
        full = self.stage.full_params()
        return {param_name(self.model, slot): self.stage.flat.view(full, slot)
                for slot in self.stage.flat.slots}

    def _param_at(self, offset: int) -> str:
        """Return the name of the parameter at flat ``offset`` (``i.Layer.name``)."""
        for slot in self.stage.flat.slots:
            if slot.offset <= offset < slot.offset + slot.numel:
                return param_name(self.model, slot)
        return "padding"

    def train_step(self, x: Any, y: Any, where: str | None = None) -> Any:
        """Run one optimizer step on this rank's part of a global batch; return its mean loss.

        The part is split into ``grad_accum_steps`` micro-batches: forward and backward for
        each (their gradients add up; buckets are reduced once, with the last), then one
        update. Under fp16 each micro-batch's loss gradient is multiplied by the loss scale
        over the micro-batches, so their float16 sum is the scaled mean (as one batch's), and
        the update divides the scale out again.

        Raises:
            NonFiniteError: on every rank when the loss or the gradients were not finite
                (``meta_dist_config.nonfinite: stop``); ``where`` names the step.
            ValueError: the part does not split into the micro-batches.
        """
        k = self.config.train.grad_accum_steps
        if len(x) % k:
            raise ValueError(f"train_step: this rank's batch of {len(x)} does not split into "
                             f"{k} micro-batches (grad_accum_steps); expected a multiple of {k}")
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._schedule()
        total, n = self.xp.zeros((), np.float64), len(x) // k
        # the guard reports non-finite numbers itself (fp16 overflows are routine): no warnings
        quiet = (np.errstate(over="ignore", invalid="ignore") if self.guard.measures
                 else nullcontext())
        # fp16 takes the mean over micro-batches before float16 holds the sum: a sum of k
        # scaled gradients overflowed where one batch's did not (as DeepSpeed divides the loss
        # by its accumulation steps); otherwise the update divides once
        fold = self.scaler is not None
        with quiet:
            self._micro_batches(x, y, k, n, scale / k if fold else 1.0, total)
        loss = total / k
        self.guard.watch(loss)
        trace = self.trace
        start = trace.begin() if trace is not None else 0.0
        self.stage.step(self.guard, grad_scale=1.0 / scale if fold else 1.0 / k)
        if trace is not None:
            trace.end("step", "phase", start)
        self.steps_done += 1
        self.guard.settle(where or f"step {self.steps_done}")
        return loss

    def _micro_batches(self, x: Any, y: Any, k: int, n: int, scale: float, total: Any) -> None:
        """Forward and backward for each of ``k`` micro-batches of ``n``; add the losses up."""
        trace = self.trace
        for i in range(k):
            start = trace.begin() if trace is not None else 0.0
            self.stage.begin_micro(i)
            if self._dropouts:  # masks by step and micro-batch: a resumed run draws the same
                number_forward(self._dropouts, self.steps_done * k + i)
            inputs = x[i * n : (i + 1) * n]
            if inputs.dtype.kind == "f" and inputs.dtype != self.work_dtype:
                inputs = inputs.astype(self.work_dtype)  # the layers compute in the precision
            output = self.model.forward(inputs)
            loss, dout = self.loss_fn(output, y[i * n : (i + 1) * n])
            if trace is not None:
                trace.end("forward", "phase", start)
                start = trace.begin()
            if scale != 1.0:  # in float32, rounded once: 2**16 itself is inf in float16
                dout = (dout.astype(np.float32) * np.float32(scale)).astype(output.dtype)
            elif dout.dtype != output.dtype:  # a loss taken in float32 (softmax_cross_entropy)
                dout = dout.astype(output.dtype)
            self.model.backward(dout)
            self.stage.end_micro()
            if trace is not None:
                trace.end("backward", "phase", start)
            total += loss

    def _schedule(self) -> None:
        """Set the optimizer's learning rate for the step about to be taken."""
        tcfg = self.config.train
        if tcfg.lr_schedule == "constant" and tcfg.warmup_steps == 0:
            return
        if self.total_steps is None:
            raise RuntimeError(f"train_step: lr_schedule {tcfg.lr_schedule!r} with warmup "
                               f"{tcfg.warmup_steps} needs the run's length; set "
                               "trainer.total_steps (fit() does) before the first step")
        self.stage.optimizer.lr = learning_rate(tcfg.lr_schedule, tcfg.lr, self.steps_done,
                                                self.total_steps, tcfg.warmup_steps)

    def fit(self, x: np.ndarray, y: np.ndarray,
            evaluate: Callable[[int], None] | None = None) -> list[float]:
        """Train for ``n_epoch`` epochs on host arrays (x, y); return the mean loss per epoch.

        Each rank takes its part of every global batch; the epoch loss (the mean over steps
        and micro-batches) is averaged over all ranks with one small allreduce per epoch.
        With ``resume_from`` the run continues where the checkpoint left off (the very next
        batch), and returns the losses of the epochs it ran; with ``checkpoint_dir`` it saves
        every ``checkpoint_every`` steps and after the last (0: at each epoch's end). With
        ``max_steps`` the run is that many optimizer steps instead (as many epochs as they
        take, the last cut short). ``evaluate(step)`` (collective: every rank calls it at the
        same steps) runs before the first step, every ``eval_every`` steps and after the last.

        Raises:
            UsageError: the ranks hold different data; x and y differ in length; fewer
                samples than one batch; the warmup is longer than the run; checkpoint_dir or
                trace cannot be written; checkpoint_dir holds another run's checkpoints and
                resume_from is not set, or another job trains in it (checked before the first
                step; rank 0 holds checkpoint_dir's ``.lock`` until fit returns).
            CheckpointError: the checkpoint to resume from cannot be used.
            TrainingStopped: on every rank after the step at which some rank caught SIGTERM
                or SIGINT (a checkpoint written first where ``checkpoint_dir`` is set); it
                prints ``stopped by SIGTERM after step N``.
        """
        tcfg = self.config.train
        check_same_data(x, y, self.context.connector.allgather)
        if len(y) != len(x):  # the same data on every rank: every rank says it
            raise UsageError(f"fit: x and y differ in length; got {len(x)} samples and "
                             f"{len(y)} labels, expected one label per sample")
        if len(x) < tcfg.batch_size:  # the same data on every rank: every rank says it
            where = self.config.sources.get("train_config.batch_size", "code")
            raise UsageError(
                f"fit: the data has {len(x)} samples, fewer than one global batch "
                f"(train_config.batch_size {tcfg.batch_size}, set in {where}); set batch_size "
                f"to at most {len(x)} (a multiple of the ranks) or give more samples")
        sampler = DistributedSampler(len(x), tcfg.batch_size, self.context.rank,
                                     self.context.size, seed=self.config.dist.seed,
                                     max_steps=tcfg.n_mini_batch)
        self.total_steps = tcfg.max_steps or tcfg.n_epoch * sampler.steps_per_epoch
        if tcfg.warmup_steps > self.total_steps:
            where = self.config.sources.get("train_config.warmup_steps", "code")
            run = (f"max_steps={tcfg.max_steps}" if tcfg.max_steps else
                   f"n_epoch={tcfg.n_epoch} x {sampler.steps_per_epoch} steps")
            raise UsageError(
                f"fit: train_config.warmup_steps is longer than the run (set in {where}); got "
                f"warmup_steps={tcfg.warmup_steps}, expected at most {self.total_steps} "
                f"({run}); shorten the warmup or train longer")
        with checkpointing.check_directories(self):  # rank 0 holds checkpoint_dir's lock
            return self._fit(x, y, sampler, evaluate)

    def _fit(self, x: np.ndarray, y: np.ndarray, sampler: DistributedSampler,
             evaluate: Callable[[int], None] | None) -> list[float]:
        """Run fit from its resume (if any) to its end, once its inputs are checked."""
        tcfg = self.config.train
        first_epoch, skip = checkpointing.resume(self, sampler.steps_per_epoch)
        self.model.train()
        self.signals = StopSignals()
        self._evaluate = evaluate
        self.comm.set_trace(self.trace)  # the communicator is shared: record only while fit runs
        try:
            self._evaluate_now()
            with self.signals:
                history = self._epochs(x, y, sampler, first_epoch, skip)
                if tcfg.checkpoint_dir and tcfg.checkpoint_every:  # the last step, saved
                    checkpointing.save_once(self, tcfg.checkpoint_dir)
            if not tcfg.eval_every or self.steps_done % tcfg.eval_every:  # the last step's
                self._evaluate_now()
            # a signal after the last step's vote (in the epoch's end, its checkpoint) still
            # stops
            if any(self.context.connector.allgather(self.signals.received)):
                self._stop_on_signal(None)
        finally:
            self.comm.set_trace(None)
            if self.trace is not None:
                self.trace.write()
        return history

    def _epochs(self, x: np.ndarray, y: np.ndarray, sampler: DistributedSampler,
                first_epoch: int, skip: int) -> list[float]:
        """Run fit's epochs from ``first_epoch`` (its first ``skip`` steps done already)."""
        tcfg = self.config.train
        history = []
        n_epoch = -(-self.total_steps // sampler.steps_per_epoch)
        if self.steps_done >= self.total_steps:  # resumed from a finished run's last checkpoint
            self._print(f"the run is complete: {self.steps_done} of {self.total_steps} steps "
                        "taken; nothing to train")
            return history
        for epoch in range(first_epoch, n_epoch):
            start, total, ran = time.perf_counter(), self.xp.zeros((), np.float64), 0
            for step, index in enumerate(sampler.epoch(epoch), 1):
                if epoch == first_epoch and step <= skip:
                    continue  # done before the checkpoint: the same batches, in order
                total += self.train_step(self.xp.asarray(x[index]), self.xp.asarray(y[index]),
                                         f"epoch {epoch + 1} step {step}")
                ran += 1
                self.position = (epoch, step)
                if step % tcfg.log_every == 0:
                    self._progress(epoch, step, ran, sampler, start, total)
                saved = None
                if tcfg.checkpoint_dir and tcfg.checkpoint_every and (
                        self.steps_done % tcfg.checkpoint_every == 0):
                    saved = self.save_checkpoint(tcfg.checkpoint_dir)
                if self.guard.stop_agreed:
                    self._stop_on_signal(saved)
                if tcfg.eval_every and self.steps_done % tcfg.eval_every == 0:
                    self._evaluate_now()
                if self.steps_done >= self.total_steps:
                    break
            mean = self.comm.allreduce(total.reshape(1) / max(ran, 1), "avg")
            self.comm.verify_calls()  # with META_DIST_CHECK=0, the epoch's calls compared here
            history.append(float(mean[0]))
            seconds = time.perf_counter() - start
            skipped = self.guard.skipped
            self._print(f"epoch {epoch + 1}/{n_epoch}  loss {history[-1]:.4f}  "
                        f"{ran * tcfg.batch_size / seconds:,.0f} samples/s"
                        + (f"  skipped steps {skipped}" if skipped else "")
                        + (f"  loss scale {self.scaler.scale:g}" if self.scaler else ""))
            if tcfg.checkpoint_dir and not tcfg.checkpoint_every:
                self.save_checkpoint(tcfg.checkpoint_dir)
        return history

    def _evaluate_now(self) -> None:
        """Run fit's ``evaluate`` (if any) at this step, the model in eval mode (no dropout)."""
        if self._evaluate is not None:
            self.model.eval()
            try:
                self._evaluate(self.steps_done)
            finally:
                self.model.train()

    def _stop_on_signal(self, saved: Path | None) -> None:
        """Stop every rank after this step (a rank caught SIGTERM or SIGINT). Collective.

        Writes a checkpoint first when ``checkpoint_dir`` is set (unless this step's was just
        written), says so once, and raises TrainingStopped (exit code 128 + the signal).
        """
        tcfg = self.config.train
        if tcfg.checkpoint_dir and saved is None:  # this step's, unless it was just written
            saved = checkpointing.save_once(self, tcfg.checkpoint_dir)
        caught = [n for n in self.context.connector.allgather(self.signals.received) if n]
        number = caught[0] if caught else signal.SIGTERM
        self._print(f"stopped by {signal.Signals(number).name} after step {self.steps_done}"
                    + (f"; checkpoint {saved} (resume_from: latest continues from it)" if saved
                       else "; no checkpoint written (checkpoint_dir is not set)"))
        failfast.leave_together(128 + number)  # every rank stops here: MPI finalizes
        raise TrainingStopped(128 + number)

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str | Path) -> Path:
        """Write a checkpoint of this step into directory ``path``; return it. Collective.

        Every rank writes its shard at once; the checkpoint appears (``step-N``) only when
        all have, and ``latest`` then names it. See ``meta_dist.checkpoint``.
        """
        return checkpointing.save(self, path)

    def load_checkpoint(self, path: str | Path) -> tuple[int, int]:
        """Continue from a checkpoint (or a checkpoint_dir's latest); return (epoch, step).

        Any world size, ZeRO level and bucket size may resume any checkpoint: elements are
        matched by parameter name. Every rank checks what it reads first, and all raise the
        same CheckpointError (naming the file and what differs) before any value changes.
        Collective.
        """
        self._print(checkpointing.load(self, path))  # it sets steps_done and position
        return self.position

    def _progress(self, epoch: int, step: int, ran: int, sampler: DistributedSampler,
                  start: float, total: Any) -> None:
        """Print the running loss of the ``ran`` steps this epoch has taken (rank 0)."""
        if self.log is None or step == sampler.steps_per_epoch:
            return  # the epoch line follows at once
        rate = ran * sampler.batch_size / (time.perf_counter() - start)
        self._print(f"  epoch {epoch + 1} step {step}/{sampler.steps_per_epoch}  "
                    f"loss {float(total) / ran:.4f} (rank 0)  {rate:,.0f} samples/s")

    def _print(self, line: str) -> None:
        if self.log is not None:
            print(line, file=self.log, flush=True)

    def memory_report(self) -> dict[str, int]:
        """Bytes of params, grads, optimizer state and buffers this rank holds, and its peak.

        ``peak`` is measured, not derived (``train.memory.PeakMeter``): on the CPU the
        process's resident high-water mark (VmHWM), on a GPU the most bytes the CuPy memory
        pool has had in use since the first meter (this Trainer's, or one made before it).
        """
        return {**self.stage.memory_report(), "peak": self.memory.peak()}

    def predicted_memory(self) -> dict[str, int]:
        """Bytes of params, grads, optimizer state and buffers this rank should hold.

        From the partition plan and DESIGN.md's formulas (``zero.memory.predict``).
        """
        return predict(self.stage)

