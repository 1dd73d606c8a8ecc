"""The config schema: each key of train_config and meta_dist_config, its default and its rule.

Imports meta_dist.errors and the sibling modules coerce and messages; the other config modules
import it. Each section is a frozen dataclass whose fields carry their rule (choices or a check)
and whose ``_check_together`` holds the rules across fields. ``check_section`` applies both, so a
section built directly (``TrainConfig(lr=0.1)``) and one loaded from dicts, a file and
command-line words pass the same checks and read the same messages.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

from meta_dist.config.coerce import BAD, coerce, type_name
from meta_dist.config.messages import source_label, unknown_name
from meta_dist.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

TRAIN = "train_config"
DIST = "meta_dist_config"
# The ZeRO levels there are (zero.STAGES has one class for each; one source for every check).
ZERO_LEVELS = (0, 1, 2, 3)


def _choice(*choices: Any, hints: dict | None = None) -> Any:
    """Return a field that takes one of ``choices``, the first being the default."""
    return field(default=choices[0], metadata={"choices": choices, "hints": hints or {}})


def _rule(default: Any, rule: str, check: Callable[[Any], bool],
          hints: dict | None = None) -> Any:
    """Return a field whose values must pass ``check``, described to users as ``rule``."""
    return field(default=default, metadata={"rule": rule, "check": check, "hints": hints or {}})


def _path(hint: str) -> Any:
    """Return a field holding a path or null (the default); an empty path is refused.

    An empty path names no folder (a run with one silently wrote nothing); ``hint`` says what
    null does instead.
    """
    return _rule(None, "null or a non-empty path", lambda v: v is None or bool(v.strip()),
                 hints={"": hint})


class _Validated:
    """Mixin: check every field, then the combinations, when an instance is built directly."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        label = f"{type(self).__name__}(...)"
        for name, value in check_section(_SECTION_OF[type(self)], values, {}, label).items():
            object.__setattr__(self, name, value)  # lists become tuples, ints become floats

    @staticmethod
    def _check_together(values: dict[str, Any], where: Callable[..., str]) -> None:
        """Raise ValueError for a contradictory combination of valid values."""


@dataclass(frozen=True)
class DistConfig(_Validated):
    """How training is distributed (the user-facing dict is ``meta_dist_config``).

    Attributes:
        enable_data_parallel: Split each global batch across ranks and average gradients.
        zero_opt_level: 0 (plain data parallelism), 1 (optimizer state sharded), 2 (gradients
            sharded too) or 3 (parameters sharded too, gathered just in time).
        bucket_size_mb: Gradient bucket size in MiB, as PyTorch DDP's ``bucket_cap_mb``.
        overlap_comm: Reduce full buckets on a communication thread while backward continues;
            null decides per run: off on one rank (nothing to overlap), else on with a GPU
            (NCCL runs on a stream of its own) or when every rank has a spare CPU core for the
            thread, off otherwise (a thread that must share the rank's only core slows the
            step down).
        backend: ``auto``, ``mpi`` or ``nccl``.
        device: ``auto``, ``cpu`` or ``cuda``.
        seed: Seed for parameter init and data order; the same on every rank.
        reshard_after_forward: Level 3: free each layer's gathered parameters after its forward
            and gather them again for backward (FSDP's default); false keeps them (no second
            allgather, the memory of a full copy of the parameters).
        nonfinite: What a non-finite loss or gradient does: ``stop`` the job on every rank
            with a message naming where (default), ``skip`` that step on every rank, or
            ``ignore`` it (no check). Under fp16 an overflow always skips the step and lowers
            the loss scale.
        max_skipped_steps: Skipped steps in a row (fp16: at the loss scale's floor) before the
            run stops: a model that only skips has stopped learning.
        stall_timeout: Seconds a collective may wait for the other ranks; past it the lowest
            waiting rank prints which ranks did not arrive and what they were doing, and the
            job ends (0: wait forever). META_DIST_STALL_TIMEOUT overrides it.
        trace: A folder: each rank writes there a Chrome trace (Perfetto) of its phases and
            communication, ``trace-rank{R}.json``, when fit ends (``meta_dist.trace``; ``python
            -m meta_dist trace merge DIR OUT.json`` joins them); null records nothing (an
            empty path is refused).
    """

    enable_data_parallel: bool = True
    zero_opt_level: int = _choice(*ZERO_LEVELS)
    bucket_size_mb: float = _rule(25.0, "> 0", lambda v: v > 0)
    overlap_comm: bool | None = None
    backend: str = _choice("auto", "mpi", "nccl")
    device: str = _choice("auto", "cpu", "cuda")
    seed: int = _rule(0, ">= 0", lambda v: v >= 0)
    reshard_after_forward: bool = True
    nonfinite: str = _choice("stop", "skip", "ignore")
    max_skipped_steps: int = _rule(10, ">= 1", lambda v: v >= 1)
    stall_timeout: float = _rule(300.0, ">= 0 (0: no limit)", lambda v: v >= 0)
    trace: str | None = _path("trace: null (or no trace) records none; give a folder to "
                              "write the traces in, e.g. traces")

    @staticmethod
    def _check_together(values: dict[str, Any], where: Callable[..., str]) -> None:
        if not values["enable_data_parallel"] and values["zero_opt_level"] > 0:
            raise UsageError(
                f"{where('enable_data_parallel', 'zero_opt_level')}: {DIST}.zero_opt_level needs "
                f"{DIST}.enable_data_parallel; got enable_data_parallel=False, zero_opt_level="
                f"{values['zero_opt_level']}, expected zero_opt_level 0 when "
                "enable_data_parallel is false; ZeRO partitions across data-parallel ranks, so "
                "set enable_data_parallel: true or zero_opt_level: 0"
            )
        if values["backend"] == "nccl" and values["device"] == "cpu":
            raise UsageError(
                f"{where('backend', 'device')}: {DIST}.backend and {DIST}.device contradict; got "
                "backend='nccl', device='cpu', expected device 'cuda' or 'auto' with nccl; NCCL "
                "moves GPU arrays only, so set backend: mpi or device: cuda"
            )


@dataclass(frozen=True)
class TrainConfig(_Validated):
    """What is trained and how (the user-facing dict is ``train_config``).

    Attributes:
        n_epoch: Number of epochs.
        n_mini_batch: Mini-batches per epoch, at most: an epoch ends sooner where the data
            holds fewer full global batches (the progress lines show step k/n).
        batch_size: Global batch size, split evenly across ranks.
        input_shape: Shape of one sample (YAML lists are accepted).
        num_classes: Number of output classes.
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: Learning rate.
        momentum: SGD momentum.
        nesterov: Use Nesterov momentum (SGD).
        weight_decay: L2 penalty (sgd, adam) or decoupled decay (adamw).
        decay_biases_and_norms: Apply weight_decay to 1-D parameters (biases, norm weights)
            too, as one PyTorch parameter group does; false decays matrices only (nanoGPT).
        betas: Adam's moment decay rates.
        eps: Adam's denominator term.
        dtype: ``float32`` or ``float64`` for parameters, gradients and optimizer state.
        data_path: An ``.npz`` file with arrays ``x`` and ``y``; None means ``dataset``.
            Relative paths are taken from the working directory; dist_example holds 20% out,
            as it does of ``dataset`` (unless the rest would hold less than one batch).
        dataset: Without data_path: ``synthetic`` (images labelled by a reference model of
            the same shape) or ``digits`` (1797 real handwritten 8x8 digits; input_shape
            [1, 8, 8]); dist_example holds 20% out and reports the accuracy on them.
        log_every: Print the loss every this many mini-batches.
        precision: ``fp32``, or ``fp16``/``bf16`` mixed precision: the layers compute with
            16-bit working copies of the parameters, the optimizer updates fp32 master copies
            (sharded as the ZeRO level says). Needs ``dtype: float32``.
        loss_scale: fp16's loss scale: ``dynamic`` (halved on overflow, doubled after 2000
            good steps) or a fixed number > 0.
        grad_accum_steps: Micro-batches per optimizer step; ``batch_size`` stays the global
            batch of one step, split into size x grad_accum_steps micro-batches.
        clip_grad_norm: Clip the gradients to this global L2 norm (null: no clipping).
        lr_schedule: ``constant`` or ``cosine`` (decay to 0 at the last step).
        warmup_steps: Optimizer steps of linear warmup first.
        checkpoint_dir: Where checkpoints are written (null: none; an empty path is refused).
        checkpoint_every: Optimizer steps between checkpoints; 0 saves at each epoch's end.
            Above 0 it needs checkpoint_dir (it would save nothing).
        keep_last: Complete checkpoints kept (older ones are removed after a save).
        resume_from: ``latest`` (the newest in checkpoint_dir), a checkpoint's path, or null.
        max_steps: Optimizer steps of a run counted in steps (train_gpt.py); null: n_epoch.
        eval_every: Steps between validation evaluations (train_gpt.py; 0: at the end only).
        n_layer, n_head, n_embd, block_size, dropout: the GPT's shape (``models.gpt``; n_head
            must divide n_embd), for train_gpt.py.
    """

    n_epoch: int = _rule(3, ">= 1", lambda v: v >= 1)
    n_mini_batch: int = _rule(8, ">= 1", lambda v: v >= 1)
    batch_size: int = _rule(64, ">= 1", lambda v: v >= 1)
    input_shape: tuple[int, ...] = _rule(
        (3, 28, 28), "a non-empty list of sizes > 0", lambda v: len(v) > 0 and min(v) > 0
    )
    num_classes: int = _rule(10, ">= 2", lambda v: v >= 2)
    optimizer: str = _choice("sgd", "adam", "adamw")
    lr: float = _rule(0.05, ">= 0", lambda v: v >= 0)
    momentum: float = _rule(0.9, ">= 0", lambda v: v >= 0)
    nesterov: bool = False
    weight_decay: float = _rule(0.0, ">= 0", lambda v: v >= 0)
    decay_biases_and_norms: bool = True
    betas: tuple[float, float] = _rule(
        (0.9, 0.999), "each in [0, 1)", lambda v: all(0 <= b < 1 for b in v)
    )
    eps: float = _rule(1e-8, ">= 0", lambda v: v >= 0)
    dtype: str = _choice("float32", "float64")
    data_path: str | None = None
    dataset: str = _choice("synthetic", "digits")
    log_every: int = _rule(1, ">= 1", lambda v: v >= 1)
    precision: str = _choice("fp32", "fp16", "bf16")
    loss_scale: str | float = _rule(
        "dynamic", "'dynamic' or a number > 0",
        lambda v: v == "dynamic" if isinstance(v, str) else v > 0)
    grad_accum_steps: int = _rule(1, ">= 1", lambda v: v >= 1)
    clip_grad_norm: float | None = _rule(None, "null or > 0", lambda v: v is None or v > 0)
    lr_schedule: str = _choice("constant", "cosine")
    warmup_steps: int = _rule(0, ">= 0", lambda v: v >= 0)
    checkpoint_dir: str | None = _path("checkpoint_dir: null (or no checkpoint_dir) writes no "
                                       "checkpoints; give a directory to write them in, e.g. "
                                       "checkpoints")
    checkpoint_every: int = _rule(0, ">= 0", lambda v: v >= 0)
    keep_last: int = _rule(2, ">= 1", lambda v: v >= 1)
    resume_from: str | None = _path("resume_from: null (or no resume_from) starts a new run; "
                                    "latest continues from checkpoint_dir's newest checkpoint")
    max_steps: int | None = _rule(None, "null or >= 1", lambda v: v is None or v >= 1)
    eval_every: int = _rule(0, ">= 0", lambda v: v >= 0)
    n_layer: int = _rule(2, ">= 1", lambda v: v >= 1)
    n_head: int = _rule(2, ">= 1", lambda v: v >= 1)
    n_embd: int = _rule(64, ">= 1", lambda v: v >= 1)
    block_size: int = _rule(32, ">= 1", lambda v: v >= 1)
    dropout: float = _rule(0.0, "in [0, 1)", lambda v: 0 <= v < 1)

    @staticmethod
    def _check_together(values: dict[str, Any], where: Callable[..., str]) -> None:
        if values["precision"] != "fp32" and values["dtype"] != "float32":
            raise UsageError(
                f"{where('precision', 'dtype')}: {TRAIN}.precision {values['precision']} needs "
                f"a float32 model; got dtype={values['dtype']!r}, expected dtype 'float32' with "
                f"fp16 or bf16 (its fp32 copy is the master); set dtype: float32 or precision: "
                "fp32")
        if values["precision"] != "fp16" and values["loss_scale"] != "dynamic":
            raise UsageError(
                f"{where('loss_scale', 'precision')}: {TRAIN}.loss_scale is for fp16 only; got "
                f"loss_scale={values['loss_scale']!r} with precision={values['precision']!r}, "
                "expected precision fp16 or loss_scale dynamic (the default, unused outside "
                "fp16)")
        if values["resume_from"] == "latest" and values["checkpoint_dir"] is None:
            raise UsageError(
                f"{where('resume_from', 'checkpoint_dir')}: {TRAIN}.resume_from 'latest' needs "
                f"{TRAIN}.checkpoint_dir; got checkpoint_dir=None, expected the directory to "
                "look in; set checkpoint_dir, or resume_from: a checkpoint's path")
        _check_checkpoint_keys(values, where)
        if values["optimizer"] == "sgd" and values["nesterov"] and values["momentum"] == 0:
            raise UsageError(
                f"{where('nesterov', 'momentum')}: {TRAIN}.nesterov needs {TRAIN}.momentum; got "
                "nesterov=True, momentum=0.0, expected momentum > 0 with nesterov and sgd; set "
                "momentum or nesterov: false"
            )
        if values["dataset"] == "digits" and values["data_path"] is None and (
                tuple(values["input_shape"]) != (1, 8, 8) or values["num_classes"] != 10):
            raise UsageError(
                f"{where('dataset', 'input_shape', 'num_classes')}: {TRAIN}.dataset digits holds "
                f"8x8 grey images of 10 digits; got input_shape={list(values['input_shape'])}, "
                f"num_classes={values['num_classes']}, expected input_shape [1, 8, 8] and "
                "num_classes 10; set them so, or dataset synthetic (or data_path) for other "
                "images")
        if values["n_embd"] % values["n_head"]:
            raise UsageError(
                f"{where('n_embd', 'n_head')}: {TRAIN}.n_head must divide {TRAIN}.n_embd; got "
                f"n_embd={values['n_embd']}, n_head={values['n_head']}, expected n_embd a "
                "multiple of n_head (each head takes n_embd / n_head channels)")
        path = values["data_path"]
        if path is not None and not Path(path).is_file():
            raise UsageError(
                f"{where('data_path')}: train_config.data_path file not found; got {path!r}, "
                f"expected an existing .npz file with arrays x, y (looked in {Path.cwd()}); "
                "fix the path or set data_path: null for synthetic data"
            )


def _check_checkpoint_keys(values: dict[str, Any], where: Callable[..., str]) -> None:
    """Raise UsageError if checkpoint_every asks for checkpoints without checkpoint_dir.

    Its default (0) asks for none, also written out (a resolved config saved as YAML,
    ``Config.as_dicts``, holds every key). keep_last needs no checkpoint_dir: it prunes after
    ``Trainer.save_checkpoint`` too.
    """
    if values["checkpoint_every"] == 0 or values["checkpoint_dir"] is not None:
        return
    raise UsageError(
        f"{where('checkpoint_every', 'checkpoint_dir')}: {TRAIN}.checkpoint_every needs "
        f"{TRAIN}.checkpoint_dir; got checkpoint_every={values['checkpoint_every']} with "
        "checkpoint_dir=None, expected a directory to write the checkpoints in; set "
        "checkpoint_dir, or leave checkpoint_every out (no checkpoints)")


@dataclass(frozen=True)
class Config:
    """The resolved configuration of one run.

    Attributes:
        train: What is trained and how.
        dist: How it is distributed.
        sources: Where each value came from, by dotted key (``"meta_dist_config.backend"``):
            ``"default"``, ``"script"``, the YAML file's path or ``"command line"``.
    """

    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    sources: dict[str, str] = field(default_factory=dict)

    def as_dicts(self) -> dict[str, dict[str, Any]]:
        """Return ``{"train_config": {...}, "meta_dist_config": {...}}`` as plain Python (lists)."""
        return {
            TRAIN: _plain(dataclasses.asdict(self.train)),
            DIST: _plain(dataclasses.asdict(self.dist)),
        }


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    """Return ``values`` with tuples as lists, as YAML and JSON write them."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


# The sections by their user-facing names, and each one's field types (resolved once, here).
SECTIONS: dict[str, type] = {TRAIN: TrainConfig, DIST: DistConfig}
_SECTION_OF = {cls: name for name, cls in SECTIONS.items()}
TYPES = {section: get_type_hints(cls) for section, cls in SECTIONS.items()}


def owner_of(name: str) -> str:
    """Return the section that has a key called ``name``, or ``""`` (names are unique)."""
    return next((section for section, types in TYPES.items() if name in types), "")


def check_value(key: str, value: Any, source: str) -> Any:
    """Return ``value`` coerced to the field's type; raise if the key, type or value is bad."""
    section, dot, name = key.partition(".")
    if not dot:  # a bare override naming no field of either section
        names = [n for types in TYPES.values() for n in types]
        raise UsageError(unknown_name("key", key, names, source))
    if section not in SECTIONS:
        raise UsageError(unknown_name("section", section, list(SECTIONS), source, key))
    if name not in TYPES[section]:
        raise UsageError(
            unknown_name("key", name, list(TYPES[section]), source, key, owner_of(name)))
    hint = TYPES[section][name]
    meta = SECTIONS[section].__dataclass_fields__[name].metadata
    choices = meta.get("choices", ())
    rule = f"one of {', '.join(map(repr, choices))}" if choices else meta.get("rule", "")
    coerced = coerce(value, hint)
    if coerced is BAD:
        raise UsageError(
            f"{source_label(source)}: {key} has the wrong type; got {value!r} "
            f"({type(value).__name__}), expected {type_name(hint)}{', ' + rule if rule else ''}"
        )
    if (choices and coerced not in choices) or ("check" in meta and not meta["check"](coerced)):
        empty = isinstance(coerced, str) and not coerced.strip()
        hint_text = meta.get("hints", {}).get("" if empty else coerced, "")
        wrong = ("is not a valid choice" if choices else "is empty" if empty
                 else "is out of range")
        raise UsageError(
            f"{source_label(source)}: {key} {wrong}; got {value!r}, expected {rule}"
            + (f"; {hint_text}" if hint_text else "")
        )
    return coerced


def check_section(section: str, given: dict, sources: dict, label: str = "") -> dict[str, Any]:
    """Return the section's complete, coerced values; check each and then their combinations."""
    cls = SECTIONS[section]

    def where(*names: str) -> str:
        found = [label or source_label(sources.get(f"{section}.{n}", "default")) for n in names]
        return " and ".join(dict.fromkeys(found))

    values = {}
    for name, spec in cls.__dataclass_fields__.items():
        raw = given.get(name, spec.default)
        key = f"{section}.{name}"
        values[name] = check_value(key, raw, label or sources.get(key, "default"))
    cls._check_together(values, where)
    return values

