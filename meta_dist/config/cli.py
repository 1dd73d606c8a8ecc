"""What a user sees at the command line: parse_cli's words, --help's text, format_config.

Imports the sibling module load (for --help, which lists the values a run would use); scripts
import it through the package. ``--config PATH`` and ``KEY=VALUE`` are the only words there are.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meta_dist.config.load import load_config
from meta_dist.errors import UsageError
from meta_dist.launcher import launcher_rank

if TYPE_CHECKING:
    from collections.abc import Sequence

    from meta_dist.config.schema import Config

USAGE = "usage: {prog} [--config PATH] [KEY=VALUE ...]"


def parse_cli(argv: Sequence[str], train_config: dict | None = None,
              meta_dist_config: dict | None = None) -> tuple[str | None, list[str]]:
    """Split command-line words into a config path and ``KEY=VALUE`` overrides.

    Args:
        argv: The words after the script name (``sys.argv[1:]``).
        train_config: The script's train_config dict: ``--help`` then lists the values the
            script would run with (its dicts, the file and the other words applied).
        meta_dist_config: The script's meta_dist_config dict, listed the same way.

    Returns:
        ``(path, overrides)``, ready for ``load_config(train_config, meta_dist_config, *...)``.

    Raises:
        UsageError: A word that is neither ``--config PATH``, ``--config=PATH`` nor ``KEY=VALUE``.
        SystemExit: With code 0 after printing usage, for ``-h`` or ``--help``.
    """
    words = list(argv)
    if "-h" in words or "--help" in words:
        if launcher_rank() in ("0", "?"):  # once for the job, not once per rank
            try:
                print(_usage([w for w in words if w not in ("-h", "--help")], train_config,
                             meta_dist_config))
                sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
            except BrokenPipeError:  # `--help | head` stopped reading: not an error of ours
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                raise SystemExit(1) from None
        raise SystemExit(0)
    return _split_words(words)


def _split_words(words: list[str]) -> tuple[str | None, list[str]]:
    """Return ``(path, overrides)`` from ``words``; raise UsageError for any other word."""
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


def _prog() -> str:
    """The running script's name, as a user would type it."""
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "<script>"


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


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
