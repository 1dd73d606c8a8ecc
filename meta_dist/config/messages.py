"""The wording every config message shares: where a value came from, and an unknown name.

Imports the standard library only; schema, load and world import it, so a key set in a script
dict, a YAML file or on the command line is named the same way in every message.
"""

from __future__ import annotations

import difflib
from pathlib import Path

COMMAND_LINE = "command line"  # the source of a KEY=VALUE word


def source_label(source: str) -> str:
    """Return how a message names ``source`` (a file's path, ``"command line"``, ...)."""
    return "script dict" if source == "script" else source


def unknown_name(kind: str, name: str, valid: list[str], source: str | Path,
                 key: str = "", owner: str = "") -> str:
    """Return the message for an unknown key or section, suggesting where it belongs.

    Args:
        kind: ``"key"`` or ``"section"``.
        name: The unknown name, bare (``"lr"``).
        valid: The names valid where it was given.
        source: Where it was given (a file's path, ``"script"``, ``"command line"``).
        key: The dotted key it was given as, when there is one (``"meta_dist_config.lr"``).
        owner: The section that has a key called ``name``, if any: the message then says to
            move it there instead of suggesting the closest valid name.

    Returns:
        ``<source>: unknown <kind> <name>; valid <kind>s: ...`` and a suggestion.
    """
    if owner and str(source) == COMMAND_LINE:
        tip = f" {name!r} is a {owner} key: write {owner}.{name}=VALUE or just {name}=VALUE."
    elif owner:
        tip = f" {name!r} is a {owner} key: move it under {owner}."
    else:
        close = difflib.get_close_matches(name, valid, n=1)
        tip = f" Did you mean {close[0]!r}?" if close else ""
    shown = f"{name!r} in {key!r}" if kind == "section" and key else repr(key or name)
    return (f"{source_label(str(source))}: unknown {kind} {shown}; valid {kind}s: "
            f"{', '.join(valid)}.{tip}")
