"""load_config: the run's configuration, resolved from its layers and checked.

Imports yaml and the sibling modules schema and messages; the package's ``__init__`` and ``cli``
import it. Layers, lowest to highest: defaults in code, the dicts a script passes, a YAML file
(overrides only), then ``KEY=VALUE`` words; each value is checked as it is read and the source
of each is kept in ``Config.sources``. YAML is read as plain data (no tags that build objects),
as UTF-8, with numbers resolved as YAML 1.2 does and a key repeated in a mapping refused.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from meta_dist.config.messages import COMMAND_LINE, source_label, unknown_name
from meta_dist.config.schema import (
    DIST,
    SECTIONS,
    TRAIN,
    TYPES,
    Config,
    check_section,
    check_value,
    owner_of,
)
from meta_dist.errors import UsageError

if TYPE_CHECKING:
    from collections.abc import Sequence


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
            interchangeable), out of range or not among the choices, contradictory values, a
            file that is missing, not UTF-8 or not YAML, a key given twice in one mapping, or
            a malformed override (``KEY=`` with no value included).
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


class _RepeatedKeyError(yaml.constructor.ConstructorError):
    """A key given twice in one mapping, which PyYAML would resolve by keeping the last."""

    def __init__(self, key: Any, first: int, second: int, mark: yaml.Mark) -> None:
        super().__init__(None, None, f"key {key!r} repeated at lines {first} and {second}", mark)
        self.key, self.first, self.second = key, first, second


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads numbers as YAML 1.2 does and refuses a key repeated in a mapping.

    PyYAML follows YAML 1.1, where ``010`` is 8, ``1:30`` is 90 and ``1e-8`` is a string. Here
    integers are decimal digits with an optional sign (``010`` is 10), or ``0x``/``0o`` forms,
    floats include ``1e-8`` and ``-.5``, and sexagesimal and ``0b`` forms stay strings, as in
    the YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution); ``_`` between
    digits is still read as PyYAML reads it (``1_000``).
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        """Return the mapping; raise _RepeatedKeyError for a key given twice in it."""
        seen: dict[Any, int] = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE:
                continue  # a merge (<<) may repeat keys on purpose; other keys fail later
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _RepeatedKeyError(key, seen[key], line, key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


_MERGE = "tag:yaml.org,2002:merge"
_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_INT = re.compile(r"^(?:[-+]?[0-9][0-9_]*|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(
    r"^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    """Return the YAML 1.2 integer ``node`` holds (``010`` is ten)."""
    text = loader.construct_scalar(node)
    if not _INT.match(text):  # an explicit !!int on something else (1:30, 0b11)
        raise yaml.constructor.ConstructorError(
            None, None, f"{text!r} is not a YAML 1.2 integer", node.start_mark)
    return int(text.replace("_", ""), {"0x": 16, "0o": 8}.get(text[:2], 10))


# PyYAML's own int and float rules go (first match wins, so they would shadow ours); int is
# added before float, whose pattern also matches plain digits.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _regexp in ((_INT_TAG, _INT), (_FLOAT_TAG, _FLOAT)):
    _Loader.add_implicit_resolver(_tag, _regexp, list("-+0123456789."))
_Loader.add_constructor(_INT_TAG, _construct_int)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    """Return the file's sections as plain data; raise UsageError naming the file otherwise."""
    if not Path(path).is_file():
        raise UsageError(
            f"load_config: config file not found; got {str(path)!r}, expected an existing YAML "
            f"file (looked in {Path.cwd()}); see configs/ for examples"
        )
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise UsageError(
            _not_yaml_text(path, f"byte 0x{raw[err.start]:02x} at line {line}")) from None
    try:
        data = yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except yaml.reader.ReaderError as err:  # a control character: binary data, not text
        line = text[:err.position].count("\n") + 1
        raise UsageError(
            _not_yaml_text(path, f"character #x{err.character:04x} at line {line}")) from None
    except _RepeatedKeyError as err:
        raise UsageError(
            f"{path}: key {err.key!r} is given twice in one mapping; got it at lines {err.first} "
            f"and {err.second}, expected each key once; merge the two into one (YAML would "
            "silently keep only the last)"
        ) from None
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
            raise UsageError(unknown_name("section", str(section), list(SECTIONS), path,
                                          owner=owner_of(str(section))))
    return data


def _not_yaml_text(path: str | Path, found: str) -> str:
    """Return the message for a config file that is not UTF-8 text (``found``: the first sign)."""
    return (f"{path}: not a UTF-8 YAML file; got {found}, expected UTF-8 text with sections "
            f"{TRAIN}: and {DIST}:; --config takes a YAML file (configs/ has examples): save "
            f"one in another encoding as UTF-8, and give a data file as {TRAIN}.data_path")


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
    if not text.strip():  # as an unset shell variable leaves it: null would turn a feature off
        raise UsageError(
            f"{COMMAND_LINE}: {key} has no value; got {word!r}, expected KEY=VALUE with a VALUE; "
            f"write {name}=null to unset it"
        )
    try:
        value = yaml.load(text, Loader=_Loader)  # safe: _Loader is a SafeLoader
    except _RepeatedKeyError as err:
        raise UsageError(
            f"{COMMAND_LINE}: value of {key} gives key {err.key!r} twice; got {text!r}, expected "
            "each key once"
        ) from None
    except yaml.YAMLError:
        raise UsageError(
            f"command line: value of {key} is not YAML; got {text!r}, expected e.g. 2, true, "
            "adam or [1, 28, 28]; quote it in the shell if it holds spaces"
        ) from None
    return key, value

