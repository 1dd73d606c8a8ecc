"""Run configuration: train_config and meta_dist_config as frozen dataclasses, loaded in layers.

Leaf module: imports yaml and the standard library (dataclasses, difflib, pathlib, re, typing),
nothing from meta_dist; scripts and the trainer import it.

Layers, lowest to highest: defaults in code, the dicts a script passes, a YAML file (overrides
only), then ``KEY=VALUE`` words from the command line. Every value is checked when it is set, and
every combination before anything else happens, so a bad config fails on every rank before the
first collective, with the key, the value, the rule and where the value came from.

Environment variables (the one place they are documented):
    META_DIST_MPIRUN: the mpirun launcher used by tests and scripts (default ``mpirun``).
    META_DIST_CHECK: ``0`` compares the ranks' collectives only at barriers, epoch ends and close
        instead of before every call (one 16-byte allreduce per call otherwise).
    META_DIST_CUDA_AWARE_MPI: ``1`` hands CuPy arrays to MPI as they are (a CUDA-aware MPI
        only; the PyPI wheels are not); otherwise they are staged through host memory.
    META_DIST_STALL_TIMEOUT: seconds a collective may wait for the other ranks before the job
        is ended with a report of who did not arrive; overrides ``stall_timeout`` for any
        program (0: no watchdog).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin, get_type_hints

import yaml

from meta_dist.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

TRAIN = "train_config"
DIST = "meta_dist_config"
COMMAND_LINE = "command line"
USAGE = "usage: {prog} [--config PATH] [KEY=VALUE ...]"
# The ZeRO levels there are (zero.STAGES has one class for each; one source for every check).
ZERO_LEVELS = (0, 1, 2, 3)
# Keys whose values may differ from rank to rank; every other key must agree everywhere.
PER_RANK_KEYS: frozenset[str] = frozenset()


def _choice(*choices: Any, hints: dict | None = None) -> Any:
    """Return a field that takes one of ``choices``, the first being the default."""
    return field(default=choices[0], metadata={"choices": choices, "hints": hints or {}})


def _rule(default: Any, rule: str, check: Callable[[Any], bool]) -> Any:
    """Return a field whose values must pass ``check``, described to users as ``rule``."""
    return field(default=default, metadata={"rule": rule, "check": check})


class _Validated:
    """Mixin: check every field, then the combinations, when an instance is built directly."""

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        label = f"{type(self).__name__}(...)"
        for name, value in _check_section(_SECTION_OF[type(self)], values, {}, label).items():
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
            null decides per run: on with a GPU (NCCL runs on a stream of its own) or when
            every rank has a spare CPU core for the thread, off otherwise (a thread that must
            share the rank's only core slows the step down).
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
            -m meta_dist trace merge DIR OUT.json`` joins them); null records nothing.
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
    trace: str | None = None

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
        n_mini_batch: Mini-batches per epoch.
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
            Relative paths are taken from the working directory.
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
        checkpoint_dir: Where checkpoints are written (null: none).
        checkpoint_every: Optimizer steps between checkpoints; 0 saves at each epoch's end.
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
    checkpoint_dir: str | None = None
    checkpoint_every: int = _rule(0, ">= 0", lambda v: v >= 0)
    keep_last: int = _rule(2, ">= 1", lambda v: v >= 1)
    resume_from: str | None = None
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
                "num_classes 10; set them so (configs/digits.yaml does)")
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


_SECTIONS: dict[str, type] = {TRAIN: TrainConfig, DIST: DistConfig}
_SECTION_OF = {cls: name for name, cls in _SECTIONS.items()}
_TYPES = {section: get_type_hints(cls) for section, cls in _SECTIONS.items()}


def load_config(
    train_config: dict | None = None,
    meta_dist_config: dict | None = None,
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Build the run's configuration from defaults, script dicts, a YAML file and overrides.

    Args:
        train_config: The script's train_config dict (bare keys); overrides the defaults.
        meta_dist_config: The script's meta_dist_config dict (bare keys); overrides the defaults.
        path: A YAML file with optional ``train_config:`` and ``meta_dist_config:`` sections;
            overrides the script dicts.
        overrides: ``KEY=VALUE`` strings, KEY dotted (``meta_dist_config.zero_opt_level``) or bare
            (``zero_opt_level``), VALUE parsed as YAML; they override everything else.

    Returns:
        The validated Config, with the source of every value in ``Config.sources``.

    Raises:
        UsageError: An unknown key or section, a value of the wrong type (bool and int are not
            interchangeable), out of range or not among the choices,
            contradictory values, a file that is missing or not YAML, or a malformed override.
        TypeError: A section that is not a dict, or overrides given as one string.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for section, given in ((TRAIN, train_config), (DIST, meta_dist_config)):
        if given is not None and not isinstance(given, dict):
            raise TypeError(
                f"load_config: {section} must be a dict; got {type(given).__name__}, "
                f"expected a dict of {section} keys or None"
            )
        _set_section(values, sources, section, given or {}, "script")
    if path is not None:
        for section, given in _read_yaml(path).items():
            _set_section(values, sources, section, given, str(path))
    if isinstance(overrides, str):
        raise TypeError(
            f"load_config: overrides must be a sequence of strings; got {overrides!r}, "
            "expected e.g. ['zero_opt_level=2']"
        )
    for word in overrides:
        key, value = _parse_override(word)
        values[key] = _check_value(key, value, COMMAND_LINE)
        sources[key] = COMMAND_LINE
    built = {}
    for section, cls in _SECTIONS.items():
        for name in _TYPES[section]:
            sources.setdefault(f"{section}.{name}", "default")
        given = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(section + ".")}
        built[section] = cls(**_check_section(section, given, sources))
    return Config(train=built[TRAIN], dist=built[DIST], sources=sources)


def check_world(config: Config, size: int) -> None:
    """Check that the configuration fits a launch of ``size`` ranks.

    Every rank calls this with the same values before any communication, so all raise together.

    Args:
        config: The loaded configuration.
        size: The number of ranks (MPI world size).

    Raises:
        UsageError: Data parallelism is off with more than one rank, or the global batch does
            not split evenly across ranks.
        ValueError: ``size`` < 1.
        TypeError: ``size`` is not an int.
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"check_world: size is not an int; got {size!r}, expected an int >= 1")
    if size < 1:
        raise ValueError(f"check_world: size is out of range; got {size!r}, expected an int >= 1")
    if not config.dist.enable_data_parallel and size > 1:
        where = _where(config.sources.get(f"{DIST}.enable_data_parallel", "code"))
        raise UsageError(
            f"check_world: {DIST}.enable_data_parallel is false with {size} ranks (set in "
            f"{where}); got enable_data_parallel=False, expected true when size > 1; every rank "
            "would train its own copy, so set enable_data_parallel: true or launch 1 rank"
        )
    batch, micro = config.train.batch_size, config.train.grad_accum_steps
    parts = size * micro
    if batch % parts:
        where = _where(config.sources.get(f"{TRAIN}.batch_size", "code"))
        below, above = batch - batch % parts, batch - batch % parts + parts
        nearest = f"{below} or {above}" if below else str(above)
        split = f"{size} ranks" + (f" x {micro} micro-batches" if micro > 1 else "")
        raise UsageError(
            f"check_world: {TRAIN}.batch_size does not split across {split} (set in "
            f"{where}); got batch_size={batch}, size={size}"
            + (f", grad_accum_steps={micro}" if micro > 1 else "")
            + f", expected a multiple of {parts}; use batch_size={nearest}, or a rank count "
            f"that divides {batch}"
        )


def check_same_everywhere(config: Config, allgather: Callable[[Any], list[Any]]) -> None:
    """Raise ValueError on every rank unless every rank resolved the same configuration.

    A per-rank environment or a stale file on one node can give one rank another ``lr`` or
    ``seed``; data parallelism then trains a different model on each rank without a word. The
    ranks compare a digest first (one small exchange) and, only if it differs, every value.

    Args:
        config: this rank's configuration.
        allgather: returns the list of every rank's object (``MPIConnector.allgather``).

    Raises:
        UsageError: naming each key that differs, with each rank's value and where it came from.
    """
    values = {f"{section}.{name}": value for section, given in config.as_dicts().items()
              for name, value in given.items() if f"{section}.{name}" not in PER_RANK_KEYS}
    digest = hashlib.sha256(repr(sorted(values.items())).encode()).hexdigest()
    if len(set(allgather(digest))) == 1:
        return
    every = allgather((values, config.sources))
    differ = [k for k in values if len({repr(v[k]) for v, _ in every}) > 1]
    listing = "; ".join(
        f"{key}: " + ", ".join(f"rank {r} {v[key]!r} ({_where(src.get(key, 'code'))})"
                               for r, (v, src) in enumerate(every)) for key in differ)
    raise UsageError(
        f"config: the ranks resolved different configurations: {listing}; expected one "
        "configuration on every rank (data parallelism would train a different model on each): "
        "make the config file, the command line and the environment the same everywhere")


def parse_cli(argv: Sequence[str], train_config: dict | None = None,
              meta_dist_config: dict | None = None) -> tuple[str | None, list[str]]:
    """Split command-line words into a config path and ``KEY=VALUE`` overrides.

    Args:
        argv: The words after the script name (``sys.argv[1:]``).
        train_config, meta_dist_config: the script's dicts: ``--help`` then lists the values
            the script would run with (its dicts, the file and the other words applied).

    Returns:
        ``(path, overrides)``, ready for ``load_config(train_config, meta_dist_config, *...)``.

    Raises:
        UsageError: A word that is neither ``--config PATH``, ``--config=PATH`` nor ``KEY=VALUE``.
        SystemExit: With code 0 after printing usage, for ``-h`` or ``--help``.
    """
    words = list(argv)
    if "-h" in words or "--help" in words:
        print(_usage([w for w in words if w not in ("-h", "--help")], train_config,
                     meta_dist_config))
        raise SystemExit(0)
    return _split_words(words)


def _split_words(words: list[str]) -> tuple[str | None, list[str]]:
    usage = USAGE.format(prog=_prog())
    path: str | None = None
    overrides: list[str] = []
    while words:
        word = words.pop(0)
        if word == "--config" or word.startswith("--config="):
            given = word.partition("=")[2] if "=" in word else (words.pop(0) if words else "")
            if not given or given.startswith("-"):
                raise UsageError(f"parse_cli: --config needs a PATH; got {given!r}; {usage}")
            if path is not None:
                raise UsageError(
                    f"parse_cli: --config given twice; got {path!r} and {given!r}, expected one "
                    f"file; {usage}"
                )
            path = given
        elif "=" in word and not word.startswith("-"):
            overrides.append(word)
        else:
            hint = "; write overrides without dashes" if word.startswith("--") else ""
            raise UsageError(
                f"parse_cli: unknown argument; got {word!r}, expected --config PATH or "
                f"KEY=VALUE{hint}; {usage}"
            )
    return path, overrides


def format_config(config: Config) -> str:
    """Return a readable listing of every key, its value and its source (rank 0 prints it)."""
    lines = []
    sections = config.as_dicts()
    width = max(len(name) for values in sections.values() for name in values)
    for section, values in sections.items():
        lines.append(f"{section}:")
        for name, value in values.items():
            shown = _show(value)
            source = config.sources.get(f"{section}.{name}", "code")
            lines.append(f"  {name:<{width}} = {shown:<12} [{source}]")
    return "\n".join(lines)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-8`` as a float, as YAML 1.2 does (PyYAML reads a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    if not Path(path).is_file():
        raise UsageError(
            f"load_config: config file not found; got {str(path)!r}, expected an existing YAML "
            f"file (looked in {Path.cwd()}); see configs/ for examples"
        )
    try:
        with Path(path).open() as stream:
            data = yaml.load(stream, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        if "python/" in problem:  # a tag that would build a Python object: never run
            raise UsageError(
                f"{path}: a YAML tag that builds a Python object{at} ({problem}); config files "
                "are read as plain data and never run code: write plain values (numbers, "
                "strings, lists) instead") from None
        raise UsageError(
            f"{path}: cannot parse YAML; got {problem}{at}, expected a mapping with sections "
            f"{TRAIN}: and {DIST}: holding KEY: VALUE lines"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: top level is not a mapping; got {type(data).__name__} {data!r}, expected "
            f"sections {TRAIN}: and {DIST}: holding KEY: VALUE lines"
        )
    for section in data:
        if section not in _SECTIONS:
            raise UsageError(_unknown("section", str(section), list(_SECTIONS), path))
    return data


def _set_section(values: dict, sources: dict, section: str, given: Any, source: str) -> None:
    if given is None:  # an empty section in YAML
        return
    if not isinstance(given, dict):
        raise UsageError(
            f"{_where(source)}: section {section!r} is not a mapping; got {given!r}, expected "
            f"KEY: VALUE pairs with keys from {', '.join(_TYPES[section])}"
        )
    for name, value in given.items():
        key = f"{section}.{name}"
        values[key] = _check_value(key, value, source)
        sources[key] = source


def _parse_override(word: str) -> tuple[str, Any]:
    name, eq, text = str(word).partition("=")
    name = name.strip()
    if not eq or not name:
        raise UsageError(
            f"command line: override is not KEY=VALUE; got {word!r}, expected e.g. "
            "zero_opt_level=2 or meta_dist_config.zero_opt_level=2 (no spaces around '=')"
        )
    if "." in name:
        key = name
    else:
        owners = [section for section, types in _TYPES.items() if name in types]
        key = f"{owners[0]}.{name}" if owners else name
    try:
        value = yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except yaml.YAMLError:
        raise UsageError(
            f"command line: value of {key} is not YAML; got {text!r}, expected e.g. 2, true, "
            "adam or [1, 28, 28]; quote it in the shell if it holds spaces"
        ) from None
    return key, value


def _check_value(key: str, value: Any, source: str) -> Any:
    """Return ``value`` coerced to the field's type; raise if the key, type or value is bad."""
    section, dot, name = key.partition(".")
    if not dot:  # a bare override naming no field of either section
        names = [n for types in _TYPES.values() for n in types]
        raise UsageError(_unknown("key", key, names, source))
    if section not in _SECTIONS:
        raise UsageError(_unknown("section", section, list(_SECTIONS), source, key))
    if name not in _TYPES[section]:
        raise UsageError(_unknown("key", name, list(_TYPES[section]), source, key))
    hint = _TYPES[section][name]
    meta = _SECTIONS[section].__dataclass_fields__[name].metadata
    choices = meta.get("choices", ())
    rule = f"one of {', '.join(map(repr, choices))}" if choices else meta.get("rule", "")
    coerced = _coerce(value, hint)
    if coerced is _BAD:
        raise UsageError(
            f"{_where(source)}: {key} has the wrong type; got {value!r} "
            f"({type(value).__name__}), expected {_type_name(hint)}{', ' + rule if rule else ''}"
        )
    if (choices and coerced not in choices) or ("check" in meta and not meta["check"](coerced)):
        hint_text = meta.get("hints", {}).get(coerced, "")
        wrong = "is not a valid choice" if choices else "is out of range"
        raise UsageError(
            f"{_where(source)}: {key} {wrong}; got {value!r}, expected {rule}"
            + (f"; {hint_text}" if hint_text else "")
        )
    return coerced


def _check_section(section: str, given: dict, sources: dict, label: str = "") -> dict[str, Any]:
    """Return the section's complete, coerced values; check each and then their combinations."""
    cls = _SECTIONS[section]

    def where(*names: str) -> str:
        found = [label or _where(sources.get(f"{section}.{n}", "default")) for n in names]
        return " and ".join(dict.fromkeys(found))

    values = {}
    for name, spec in cls.__dataclass_fields__.items():
        raw = given.get(name, spec.default)
        key = f"{section}.{name}"
        values[name] = _check_value(key, raw, label or sources.get(key, "default"))
    cls._check_together(values, where)
    return values


_BAD = object()


def _coerce(value: Any, hint: Any) -> Any:
    """Return ``value`` as type ``hint`` (int to float, list to tuple), or ``_BAD``."""
    args = get_args(hint)
    if type(None) in args:
        return None if value is None else _coerce(value, args[0])
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            return _BAD
        kinds = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(kinds) != len(value):
            return _BAD
        items = tuple(_coerce(v, k) for v, k in zip(value, kinds, strict=True))
        return _BAD if any(item is _BAD for item in items) else items
    if args and get_origin(hint) is not tuple:  # a union such as float | str: the first fit
        return next((c for c in (_coerce(value, a) for a in args) if c is not _BAD), _BAD)
    if isinstance(value, bool) and hint is not bool:  # bool is an int subclass: reject it
        return _BAD
    if hint is float and isinstance(value, (int, float)):
        return float(value) if value - value == 0 else _BAD  # inf and nan are not allowed
    return value if isinstance(value, hint) else _BAD


def _type_name(hint: Any) -> str:
    args = get_args(hint)
    if type(None) in args:
        return f"{_type_name(args[0])} or null"
    if get_origin(hint) is tuple:
        if args[-1] is Ellipsis:
            return f"a list of {_type_name(args[0])}"
        return f"a list of {len(args)} {_type_name(args[0])}s"
    if args:
        return " or ".join(_type_name(a) for a in args)
    return {bool: "bool (true/false)", float: "finite float"}.get(hint, hint.__name__)


def _unknown(kind: str, name: str, valid: list[str], source: str | Path, key: str = "") -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    tip = f" Did you mean {close[0]!r}?" if close else ""
    shown = f"{name!r} in {key!r}" if kind == "section" and key else repr(key or name)
    return f"{_where(str(source))}: unknown {kind} {shown}; valid {kind}s: {', '.join(valid)}.{tip}"


def _where(source: str) -> str:
    return "script dict" if source == "script" else source


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _prog() -> str:
    """The running script's name, as a user would type it."""
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "<script>"


def _usage(words: list[str], train_config: dict | None, meta_dist_config: dict | None) -> str:
    """Return --help's text: how to call, then every key with the value this run would use."""
    lines = [
        USAGE.format(prog=_prog()),
        "  --config PATH  YAML file with train_config: and meta_dist_config: sections (overrides)",
        "  KEY=VALUE      override one key; VALUE is YAML, e.g. zero_opt_level=2 lr=0.1",
        "  -h, --help     show this help and exit",
        "",
    ]
    try:
        config = load_config(train_config, meta_dist_config, *_split_words(list(words)))
    except (ValueError, TypeError) as error:  # still say what the keys are
        lines += [f"(these arguments do not resolve: {error})", ""]
        config = load_config(train_config, meta_dist_config)
    lines.append("keys (the value this run would use [where it comes from]):")
    for section, values in config.as_dicts().items():
        for name, value in values.items():
            source = config.sources.get(f"{section}.{name}", "default")
            lines.append(f"  {section}.{name} = {_show(value)}  [{source}]")
    return "\n".join(lines)