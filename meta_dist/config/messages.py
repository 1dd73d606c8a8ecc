"""The wording every config message shares: where a value came from, and an unknown name.

Imports the standard library only; schema, load and world import it, so a key set in a script
dict, a YAML file or on the command line is named the same way in every message.
"""

from __future__ import annotations

import difflib
from pathlib import Path


def source_label(source: str) -> str:
    """Return how a message names ``source`` (a file's path, ``"command line"``, ...)."""
    return "script dict" if source == "script" else source


def unknown_name(kind: str, name: str, valid: list[str], source: str | Path,
                 key: str = "") -> str:
    """Return the message for an unknown key or section, suggesting the closest valid one."""
    close = difflib.get_close_matches(name, valid, n=1)
    tip = f" Did you mean {close[0]!r}?" if close else ""
    shown = f"{name!r} in {key!r}" if kind == "section" and key else repr(key or name)
    return (f"{source_label(str(source))}: unknown {kind} {shown}; valid {kind}s: "
            f"{', '.join(valid)}.{tip}")
