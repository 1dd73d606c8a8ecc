"""Saving and resuming a Trainer: its shards and manifest out, every rank's state back in.

Imports meta_dist.checkpoint (the file format) and build.py (names, buffers); trainer.py imports
it (Trainer.save_checkpoint, load_checkpoint, fit and a stop on a signal call it).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from meta_dist import checkpoint
from meta_dist.config import Config
from meta_dist.errors import UsageError
from meta_dist.nn.model import Sequential
from meta_dist.train.build import broadcast_buffers, model_buffers, param_name
from meta_dist.xp import to_numpy

if TYPE_CHECKING:  # annotations only: trainer.py imports this module
    from meta_dist.train.trainer import Trainer


def save(trainer: Trainer, path: str | Path) -> Path:
    """Write a checkpoint of ``trainer``'s step into directory ``path``; return it. Collective.

    See ``Trainer.save_checkpoint``.
    """
    context, stage = trainer.context, trainer.stage
    root = Path(path)
    tmp = root / f"{checkpoint.TMP_PREFIX}{trainer.steps_done:08d}"
    if context.rank == context.root_rank:
        checkpoint.clear(tmp)
    context.connector.barrier()  # no rank writes into what rank 0 is still removing
    sums = checkpoint.save_shard(tmp, context.rank, stage.export_shard())
    buffers = model_buffers(trainer.model)
    if buffers and context.rank == context.root_rank:  # rank 0's, as DDP keeps
        sums.update(checkpoint.save_buffers(tmp, {n: to_numpy(b) for n, b in buffers.items()}))
    everyone = context.connector.allgather((sums, stage.shard_ranges()))
    final = root / checkpoint.step_name(trainer.steps_done)
    if context.rank == context.root_rank:
        checkpoint.commit(tmp, _manifest(trainer, everyone), trainer.config.train.keep_last)
    context.connector.barrier()  # nobody goes on before the checkpoint exists
    trainer.last_checkpoint = final
    return final


def save_once(trainer: Trainer, directory: str) -> Path:
    """Return this step's checkpoint in ``directory``, saved unless it holds this state. Collective.

    It does when this trainer saved it, or loaded it and took no step since
    (``trainer.last_checkpoint``, the same on every rank). A checkpoint of this step number
    that another run left there (a run resumed from an older step, with other settings) is
    replaced: it holds another state.
    """
    step = Path(directory) / checkpoint.step_name(trainer.steps_done)
    last = trainer.last_checkpoint
    if last is not None and last.resolve() == step.resolve():
        return step
    return trainer.save_checkpoint(directory)


def _manifest(trainer: Trainer,
              everyone: list[tuple[dict[str, str], list[tuple[int, int]]]]) -> dict:
    config, stage, opt = trainer.config, trainer.stage, trainer.stage.optimizer
    epoch, step = trainer.position
    return {
        "format": checkpoint.FORMAT, "step": trainer.steps_done, "epoch": epoch,
        "epoch_step": step, "world_size": trainer.context.size,
        "zero_opt_level": config.dist.zero_opt_level,
        "precision": config.train.precision,
        "params": [{"name": param_name(trainer.model, slot), "shape": list(slot.shape),
                    "dtype": str(np.dtype(config.train.dtype)), "offset": slot.offset,
                    "numel": slot.numel} for slot in stage.flat.slots],
        "shards": [ranges for _, ranges in everyone],
        "optimizer": {"name": opt.name, "hyperparameters": _plain(opt.hyperparameters),
                      "step_count": opt.step_count, "state": sorted(opt.state)},
        "buffers": [{"name": n, "shape": list(b.shape), "dtype": str(b.dtype)}
                    for n, b in model_buffers(trainer.model).items()],
        "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "schedule": {"steps_done": trainer.steps_done, "total_steps": trainer.total_steps},
        "config": config.as_dicts(),
        "checksums": {name: digest for sums, _ in everyone for name, digest in sums.items()},
    }


def check_directories(trainer: Trainer) -> contextlib.AbstractContextManager:
    """Raise UsageError on every rank if fit could not write its files, or would replace others.

    Collective, before any step. A checkpoint_dir another job trains in is refused: each would
    remove the other's saves under way. A new run (no resume_from) in a checkpoint_dir that
    holds complete checkpoints would replace those of its step numbers and prune the rest:
    refused, not lost. A checkpoint_dir or trace folder that is a file or not writable would
    fail only at the first save, after the steps before it.

    Returns:
        What holds checkpoint_dir's lock (``checkpoint.hold``) until it is closed (fit's end; a
        killed job's lock goes with its process): on the root rank, where flock is supported;
        else a context that holds nothing.
    """
    config = trainer.config
    folders = {"train_config.checkpoint_dir": config.train.checkpoint_dir,
               "meta_dist_config.trace": config.dist.trace}
    problems = []
    for key, folder in folders.items():
        where = config.sources.get(key, "code")
        if folder is None:
            continue
        path = Path(folder)
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():  # the folder, or one above it
            what = "is a file" if existing == path else f"is inside a file, {existing}"
            problems.append(f"{key} {folder} (set in {where}) {what}; expected a directory "
                            "(it is made if missing); choose another path")
        elif existing is not None and (refused := _cannot_create_in(existing)):
            problems.append(f"{key} {folder} (set in {where}): nothing can be made in "
                            f"{existing} here (mkdir: {refused}); choose a writable path")
    directory, lock = config.train.checkpoint_dir, None
    if not problems and directory is not None and trainer.context.rank == trainer.context.root_rank:
        lock, problem = _lock(directory, config.sources.get("train_config.checkpoint_dir", "code"))
        problems += [problem] if problem else []
    try:  # an interrupt in the allgather below must not leave the lock held in this process
        return _agree(trainer, problems, lock)
    except BaseException:
        if lock is not None:
            lock.close()
        raise


def _agree(trainer: Trainer, problems: list[str],
           lock: TextIO | None) -> contextlib.AbstractContextManager:
    """Add a new run's refusal, then raise every rank's first problem on every rank. Collective."""
    config, directory = trainer.config, trainer.config.train.checkpoint_dir
    if not problems and directory is not None and config.train.resume_from is None:
        root = Path(directory)
        found = sorted(p.name for p in root.glob(f"{checkpoint.STEP_PREFIX}*")
                       if (p / checkpoint.MANIFEST).is_file()) if root.is_dir() else []
        if found:
            where = config.sources.get("train_config.checkpoint_dir", "code")
            problems.append(
                f"train_config.checkpoint_dir {directory} (set in {where}) holds another run's "
                f"checkpoints ({', '.join(found[-3:])}); a new run would replace and prune "
                "them; expected resume_from: latest to continue that run, or another (or an "
                "emptied) checkpoint_dir to start a new one")
    every = trainer.context.connector.allgather(problems[0] if problems else None)
    mine = next((p for p in every if p), None)
    if mine is not None:
        ranks = [r for r, p in enumerate(every) if p]
        seen = ("" if len(ranks) == len(every) else
                f" (seen on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})")
        raise UsageError(f"fit: {mine}{seen}")
    return lock if lock is not None else contextlib.nullcontext()


def _lock(directory: str, where: str) -> tuple[TextIO | None, str | None]:
    """Hold checkpoint_dir ``directory`` (rank 0); return (its lock, None) or (None, why not)."""
    try:
        return checkpoint.hold(directory), None
    except checkpoint.DirectoryInUse as error:
        return None, (f"train_config.checkpoint_dir {directory} (set in {where}) is in use by "
                      f"another job ({error.holder} holds {error.directory / checkpoint.LOCK}); "
                      "expected one job per checkpoint_dir: choose another checkpoint_dir, or "
                      "wait for that job to end")
    except OSError as error:
        return None, (f"train_config.checkpoint_dir {directory} (set in {where}): cannot make "
                      f"its lock file {checkpoint.LOCK} ({error.strerror or error}); choose a "
                      "writable path")


def _cannot_create_in(folder: Path) -> str | None:
    """Return why nothing can be made in ``folder`` (tried: a folder made and removed), or None.

    Trying is the one answer that holds: access() lets root through any mode bits, and a folder
    such as /proc grants them yet refuses every mkdir; such a path failed only at the first save.
    """
    try:
        Path(tempfile.mkdtemp(prefix=".meta_dist-probe-", dir=folder)).rmdir()
    except OSError as error:
        return error.strerror or type(error).__name__
    return None


def resume(trainer: Trainer, steps_per_epoch: int) -> tuple[int, int]:
    """Load ``resume_from`` (if set); return the (epoch, steps done in it) to go on from.

    Collective.

    Raises:
        CheckpointError: the checkpoint cannot be used; the message names the key that led there.
    """
    tcfg = trainer.config.train
    if tcfg.resume_from is None:
        return 0, 0
    path = tcfg.checkpoint_dir if tcfg.resume_from == "latest" else tcfg.resume_from
    try:
        epoch, skip = trainer.load_checkpoint(path)
    except checkpoint.CheckpointError as error:  # say which key led there
        where = trainer.config.sources.get("train_config.resume_from", "code")
        raise checkpoint.CheckpointError(
            f"train_config.resume_from {tcfg.resume_from!r} (set in {where}): {error}"
        ) from error
    if skip >= steps_per_epoch:  # saved at an epoch's end: the next one
        return epoch + 1, 0
    return epoch, skip


def load(trainer: Trainer, path: str | Path) -> str:
    """Restore ``trainer`` from the checkpoint at ``path``; return the line that says so.

    See ``Trainer.load_checkpoint``. Collective.
    """
    reader, buffers = _open_checked(trainer, path)
    model, context, stage = trainer.model, trainer.context, trainer.stage
    names = {s: param_name(model, s) for s in stage.flat.slots}
    stage.import_values(reader.read, names.__getitem__)
    if context.rank == context.root_rank:  # it read and checked them
        for name, array in model_buffers(model).items():
            array[...] = trainer.xp.asarray(buffers[name])
    broadcast_buffers(model, trainer.comm, context.root_rank)
    m = reader.manifest
    stage.optimizer.step_count = m["optimizer"]["step_count"]
    if trainer.scaler is not None and m["scaler"] is not None:
        trainer.scaler.load_state_dict(m["scaler"])
    trainer.steps_done = m["step"]
    trainer.position = (m["epoch"], m["epoch_step"])
    trainer.last_checkpoint = reader.path
    return _resumed(reader, trainer.config, context.size)


def _open_checked(trainer: Trainer,
                  path: str | Path) -> tuple[checkpoint.Reader, dict[str, Any] | None]:
    """Open the checkpoint and check it; return it and its buffers (the root rank; else None).

    Every rank checks what it reads (each checksum is read by one rank). Collective.

    Raises:
        CheckpointError: on every rank (the first problem found), before any value changes.
    """
    problem, reader, buffers = None, None, None
    context, stage = trainer.context, trainer.stage
    try:
        reader = checkpoint.Reader(path, verify=False)
        checkpoint.check_same_model(reader, {param_name(trainer.model, s): s.shape
                                             for s in stage.flat.slots})
        _check_optimizer(reader, stage.optimizer)
        reader.check_files()  # every file there and whole, on every rank
        me, size = context.rank, context.size
        for rank, what in reader.files()[me::size]:  # each checksum read once, shared out
            reader.check(rank, what)
        buffers = reader.buffers() if me == context.root_rank else None
        _check_buffers(reader, trainer.model, buffers)
    except checkpoint.CheckpointError as error:
        problem = str(error)
    problems = [p for p in context.connector.allgather(problem) if p]
    if problems:
        raise checkpoint.CheckpointError(problems[0])
    return reader, buffers


def _check_optimizer(reader: checkpoint.Reader, optimizer: Any) -> None:
    """Raise CheckpointError unless the checkpoint was saved with this optimizer (and state)."""
    saved = reader.manifest["optimizer"]
    if saved["name"] != optimizer.name or set(saved["state"]) != set(optimizer.state):
        raise checkpoint.CheckpointError(
            f"checkpoint: {reader.path} was saved with optimizer {saved['name']} "
            f"(state {', '.join(saved['state']) or 'none'}); this run uses "
            f"{optimizer.name} (state "
            f"{', '.join(sorted(optimizer.state)) or 'none'}); expected the "
            "same optimizer: set optimizer (and momentum) as the saved run did")


def _check_buffers(reader: checkpoint.Reader, model: Sequential,
                   saved: dict[str, Any] | None) -> None:
    """Raise CheckpointError unless the checkpoint's buffers are this model's (names, shapes).

    ``saved``: the buffers as read (the root rank; None elsewhere, which checks the
    manifest's list only).
    """
    mine = {n: tuple(b.shape) for n, b in model_buffers(model).items()}
    listed = {b["name"]: tuple(b["shape"]) for b in reader.manifest.get("buffers", [])}
    if saved is not None:
        listed = {n: tuple(a.shape) for n, a in saved.items()}
    if listed != mine and (listed or "buffers" in reader.manifest):
        raise checkpoint.CheckpointError(
            f"checkpoint: {reader.path} holds buffers {sorted(listed.items())}; this model "
            f"has {sorted(mine.items())}; expected the same (BatchNorm layers): build the "
            "model the checkpoint was saved from")


def _resumed(reader: checkpoint.Reader, config: Config, world_size: int) -> str:
    """Return the line that says where the run resumed, and what changed since the save."""
    m = reader.manifest
    mine = config.as_dicts()
    changed = [f"{section}.{key}: {m['config'][section].get(key)!r} -> {value!r}"
               for section, values in mine.items() for key, value in values.items()
               if m["config"].get(section, {}).get(key) != value and key != "resume_from"]
    if m["world_size"] != world_size:
        changed.append(f"world size: {m['world_size']} -> {world_size}")
    return (f"resumed from {reader.path} at epoch {m['epoch'] + 1} step "
            f"{m['epoch_step']}" + (f" (changed: {'; '.join(changed)})" if changed else ""))


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Return hyperparameters as JSON can hold them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
