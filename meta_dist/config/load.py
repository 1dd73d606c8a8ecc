"""load_config: the run's configuration, resolved from its layers and checked.

Imports yaml and the sibling modules schema and messages; the package's ``__init__`` and ``cli``
import it. Layers, lowest to highest: defaults in code, the dicts a script passes, a YAML file
(overrides only), then ``KEY=VALUE`` words; each value is checked as it is read and the source
of each is kept in ``Config.sources``. YAML is read as plain data (no tags that build objects).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meta_dist.config.messages import source_label, unknown_name
from meta_dist.config.schema import (
    DIST,
    SECTIONS,
    TRAIN,
    TYPES,
    Config,
    check_section,
    check_value,
)
from meta_dist.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence

COMMAND_LINE = "command line"


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
        values[key] = check_value(key, value, COMMAND_LINE)
        sources[key] = COMMAND_LINE
    built = {}
    for section, cls in SECTIONS.items():
        for name in TYPES[section]:
            sources.setdefault(f"{section}.{name}", "default")
        given = {k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(section + ".")}
        built[section] = cls(**check_section(section, given, sources))
    return Config(train=built[TRAIN], dist=built[DIST], sources=sources)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-8`` as a float, as YAML 1.2 does (PyYAML reads a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """Return the file's sections as plain data; raise UsageError naming the file otherwise."""
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
        if section not in SECTIONS:
            raise UsageError(unknown_name("section", str(section), list(SECTIONS), path))
    return data


def _set_section(values: dict, sources: dict, section: str, given: Any, source: str) -> None:
    """Check each value of one section's layer and record it, with its source, by dotted key."""
    if given is None:  # an empty section in YAML
        return
    if not isinstance(given, dict):
        raise UsageError(
            f"{source_label(source)}: section {section!r} is not a mapping; got {given!r}, "
            f"expected KEY: VALUE pairs with keys from {', '.join(TYPES[section])}"
        )
    for name, value in given.items():
        key = f"{section}.{name}"
        values[key] = check_value(key, value, source)
        sources[key] = source


def _parse_override(word: str) -> tuple[str, Any]:
    """Return ``(dotted key, value)`` for a ``KEY=VALUE`` word; a bare KEY finds its section."""
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
        owners = [section for section, types in TYPES.items() if name in types]
        key = f"{owners[0]}.{name}" if owners else name
    try:
        value = yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except yaml.YAMLError:
        raise UsageError(
            f"command line: value of {key} is not YAML; got {text!r}, expected e.g. 2, true, "
            "adam or [1, 28, 28]; quote it in the shell if it holds spaces"
        ) from None
    return key, value

