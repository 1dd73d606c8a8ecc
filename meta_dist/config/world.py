"""Checks of a loaded config against the launch: the world size fits, every rank agrees.

Imports the sibling modules schema and messages; the trainer and scripts call these on every
rank, after load_config and before the first collective, so all ranks raise together.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from meta_dist.config.messages import source_label
from meta_dist.config.schema import DIST, TRAIN, Config
from meta_dist.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

# Keys whose values may differ from rank to rank; every other key must agree everywhere.
PER_RANK_KEYS: frozenset[str] = frozenset()


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
        where = source_label(config.sources.get(f"{DIST}.enable_data_parallel", "code"))
        raise UsageError(
            f"check_world: {DIST}.enable_data_parallel is false with {size} ranks (set in "
            f"{where}); got enable_data_parallel=False, expected true when size > 1; every rank "
            "would train its own copy, so set enable_data_parallel: true or launch 1 rank"
        )
    batch, micro = config.train.batch_size, config.train.grad_accum_steps
    parts = size * micro
    if batch % parts:
        where = source_label(config.sources.get(f"{TRAIN}.batch_size", "code"))
        below, above = batch - batch % parts, batch - batch % parts + parts
        nearest = f"{below} or {above}" if below else str(above)
        split = f"{size} ranks" + (f" x {micro} micro-batches" if micro > 1 else "")
        raise UsageError(
            f"check_world: {TRAIN}.batch_size does not split across {split} (set in "
            f"{where}); got batch_size={batch}, size={size}"
            + (f", grad_accum_steps={micro}" if micro > 1 else "")
            + f", expected a multiple of {parts}; use batch_size={nearest}, or a rank count "
            + (f"that divides {batch}" if micro == 1 else
               f"whose product with grad_accum_steps={micro} divides {batch}")
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
        f"{key}: " + ", ".join(f"rank {r} {v[key]!r} ({source_label(src.get(key, 'code'))})"
                               for r, (v, src) in enumerate(every)) for key in differ)
    raise UsageError(
        f"config: the ranks resolved different configurations: {listing}; expected one "
        "configuration on every rank (data parallelism would train a different model on each): "
        "make the config file, the command line and the environment the same everywhere")
