"""Optimizers as pure update rules on 1-D arrays: SGD, Adam, AdamW and a by-name factory.

Leaf package: imports numpy and meta_dist.xp only (never comm, connector or nn); imported by zero
and trainer. See ``Optimizer`` for the contract that ZeRO relies on.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

import numpy as np

from meta_dist.optim.adam import Adam, AdamW
from meta_dist.optim.base import Optimizer
from meta_dist.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "make_optimizer"]

OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def make_optimizer(
    name: str, numel: int, *, xp: Any = np, dtype: Any = np.float32, **hyperparameters: Any
) -> Optimizer:
    """Build the optimizer registered as ``name`` (e.g. from a config file).

    Args:
        name: one of "sgd", "adam", "adamw".
        numel: number of parameters it updates (0 for an empty shard).
        xp: array module for state (numpy or cupy).
        dtype: floating-point dtype of state and parameters.
        **hyperparameters: keyword arguments of that optimizer's constructor (lr, momentum, ...).

    Returns:
        The optimizer, its state allocated.

    Raises:
        ValueError: unknown name, unknown or missing hyperparameter, or a bad value.
        TypeError: a hyperparameter of the wrong kind, or a non-floating ``dtype``.
    """
    cls = OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"make_optimizer: unknown optimizer; got {name!r}, expected one of "
            f"{', '.join(sorted(OPTIMIZERS))}{_did_you_mean(name, OPTIMIZERS)}"
        )
    # Checked here rather than left to the call: a raw TypeError from **kwargs names neither
    # the config key nor the valid choices.
    accepted = {
        param.name: param
        for param in inspect.signature(cls).parameters.values()
        if param.kind is inspect.Parameter.KEYWORD_ONLY and param.name not in ("xp", "dtype")
    }
    for key in hyperparameters:
        if key not in accepted:
            raise ValueError(
                f"make_optimizer: unknown hyperparameter for {name!r}; got {key!r}, expected one "
                f"of {', '.join(accepted)}{_did_you_mean(key, accepted)}"
            )
    for key, param in accepted.items():
        if param.default is inspect.Parameter.empty and key not in hyperparameters:
            raise ValueError(
                f"make_optimizer: {name!r} needs hyperparameter {key!r}; got "
                f"{sorted(hyperparameters)}, expected it among them"
            )
    return cls(numel, xp=xp, dtype=dtype, **hyperparameters)


def _did_you_mean(word: Any, choices: Any) -> str:
    """Return "; did you mean 'x'?" for the closest choice, or "" if none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
