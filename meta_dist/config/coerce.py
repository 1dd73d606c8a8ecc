"""Coercion of a given value to a field's type hint, and the hint's name for messages.

Imports typing and numpy only; ``schema.check_value`` imports it. A YAML file, a script dict
and a ``KEY=VALUE`` word all hand over plain values (int, float, str, bool, None, list; a script
dict may hold numpy numbers, taken as the Python ones); ``coerce`` turns one into the field's
type or says it cannot, and ``type_name`` words the hint the same way.
"""

from __future__ import annotations

from typing import Any, get_args, get_origin

import numpy as np

BAD = object()  # what coerce returns for a value that does not fit (None is a valid value)


def coerce(value: Any, hint: Any) -> Any:
    """Return ``value`` as type ``hint`` (int to float, list to tuple), or ``BAD``."""
    if isinstance(value, np.generic):  # np.int64(64) from a script's arithmetic: 64
        value = value.item()
    args = get_args(hint)
    if type(None) in args:
        return None if value is None else coerce(value, args[0])
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            return BAD
        kinds = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        if len(kinds) != len(value):
            return BAD
        items = tuple(coerce(v, k) for v, k in zip(value, kinds, strict=True))
        return BAD if any(item is BAD for item in items) else items
    if args and get_origin(hint) is not tuple:  # a union such as float | str: the first fit
        return next((c for c in (coerce(value, a) for a in args) if c is not BAD), BAD)
    if isinstance(value, bool) and hint is not bool:  # bool is an int subclass: reject it
        return BAD
    if hint is float and isinstance(value, (int, float)):
        return float(value) if value - value == 0 else BAD  # inf and nan are not allowed
    return value if isinstance(value, hint) else BAD


def type_name(hint: Any) -> str:
    """Return how a message names type ``hint`` (``"a list of int"``, ``"float or null"``)."""
    args = get_args(hint)
    if type(None) in args:
        return f"{type_name(args[0])} or null"
    if get_origin(hint) is tuple:
        if args[-1] is Ellipsis:
            return f"a list of {type_name(args[0])}"
        return f"a list of {len(args)} {type_name(args[0])}s"
    if args:
        return " or ".join(type_name(a) for a in args)
    return {bool: "bool (true/false)", float: "finite float"}.get(hint, hint.__name__)
