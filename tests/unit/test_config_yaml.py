"""Unit tests for how meta_dist.config reads YAML: encodings, repeated keys, numbers, sections."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_config import raises as raises_any

from meta_dist.config import load_config
from meta_dist.errors import UsageError


def write(tmp_path: Path, data: str | bytes, name: str = "run.yaml") -> str:
    path = tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data, encoding="utf-8")
    return str(path)


def raises(call, *parts: str) -> str:
    """Call, expect UsageError, and check its message holds every part; return the message."""
    return raises_any(UsageError, call, *parts)


# --- encodings -------------------------------------------------------------------------------


def test_latin1_file_is_refused_naming_the_file(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  trace: café\n".encode("latin-1"))
    msg = raises(lambda: load_config(path=path), path, "not a UTF-8 YAML file", "line 2")
    assert msg.startswith(path + ":")


def test_binary_file_is_refused_naming_the_file(tmp_path):
    zipped = tmp_path / "data.npz"
    np.savez_compressed(zipped, x=np.arange(100.0), y=np.arange(100))
    raises(lambda: load_config(path=str(zipped)), str(zipped), "not a UTF-8 YAML file")
    stored = tmp_path / "plain.npz"  # uncompressed small ints: valid UTF-8, full of NULs
    np.savez(stored, x=np.zeros(8, dtype=np.int64))
    raises(lambda: load_config(path=str(stored)), str(stored), "not a UTF-8 YAML file")
    nuls = write(tmp_path, b"train_config:\n  lr: 0.1\x00\x00\n", "nuls.yaml")  # valid UTF-8
    raises(lambda: load_config(path=nuls), nuls, "not a UTF-8 YAML file", "#x0000 at line 2")


def test_utf8_file_with_bom_and_non_ascii_text_is_read(tmp_path):
    path = write(tmp_path, "\ufeffmeta_dist_config:\n  trace: café\n")
    assert load_config(path=path).dist.trace == "café"


# --- repeated keys ---------------------------------------------------------------------------


def test_repeated_section_is_refused(tmp_path):
    path = write(
        tmp_path,
        "meta_dist_config: {zero_opt_level: 3}\n"
        "train_config: {lr: 0.1}\n"
        "meta_dist_config: {seed: 5}\n",
    )
    msg = raises(lambda: load_config(path=path), path, "'meta_dist_config'", "lines 1 and 3")
    assert msg.startswith(path + ":")


def test_repeated_key_in_a_section_is_refused(tmp_path):
    path = write(
        tmp_path, "meta_dist_config:\n  zero_opt_level: 3\n  seed: 1\n  zero_opt_level: 1\n"
    )
    raises(lambda: load_config(path=path), path, "'zero_opt_level'", "lines 2 and 4")


def test_repeated_key_in_a_flow_mapping_on_the_command_line_is_refused():
    raises(lambda: load_config(overrides=["input_shape={a: 1, a: 2}"]), "command line",
           "'a' twice")


def test_merge_key_may_repeat_keys_on_purpose(tmp_path):
    path = write(tmp_path, "train_config:\n  <<: {lr: 0.1, batch_size: 8}\n  lr: 0.2\n")
    cfg = load_config(path=path)
    assert (cfg.train.lr, cfg.train.batch_size) == (0.2, 8)


def test_same_key_in_different_sections_or_repeated_words_is_fine(tmp_path):
    path = write(tmp_path, "train_config:\n  lr: 0.1\nmeta_dist_config:\n  seed: 2\n")
    cfg = load_config(path=path, overrides=["seed=3", "seed=4"])
    assert (cfg.train.lr, cfg.dist.seed) == (0.1, 4)


# --- empty values on the command line --------------------------------------------------------


@pytest.mark.parametrize("word", ["data_path=", "checkpoint_dir=", "train_config.data_path=  "])
def test_empty_override_value_is_refused(word):
    name = word.partition("=")[0]
    raises(lambda: load_config(overrides=[word]), "command line", repr(word), f"{name}=null")


def test_null_and_empty_string_overrides_are_read_as_written():
    """null is None; a quoted '' is the empty string (refused as an empty path, not as a word
    with no value: test_config.py's test_an_empty_path_is_refused)."""
    cfg = load_config(overrides=["checkpoint_dir=null", "trace=null"])
    assert cfg.train.checkpoint_dir is None and cfg.dist.trace is None
    raises(lambda: load_config(overrides=["trace=''"]), "meta_dist_config.trace is empty; got ''")


# --- numbers the YAML 1.2 way ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("010", 10), ("+7", 7), ("-0", 0), ("0", 0), ("1_000", 1000), ("0x10", 16), ("0o17", 15)],
)
def test_integers_are_yaml_1_2(tmp_path, text, value):
    assert load_config(overrides=[f"seed={text}"]).dist.seed == abs(value)
    path = write(tmp_path, f"meta_dist_config:\n  seed: {text}\n")
    assert load_config(path=path).dist.seed == abs(value)


@pytest.mark.parametrize("text", ["1:30", "0b11", "1:30.5"])
def test_sexagesimal_and_binary_are_strings(tmp_path, text):
    raises(lambda: load_config(overrides=[f"n_epoch={text}"]), "command line",
           "train_config.n_epoch has the wrong type", repr(text), "expected int")
    path = write(tmp_path, f"train_config:\n  lr: {text}\n")
    raises(lambda: load_config(path=path), path, "train_config.lr has the wrong type", repr(text))


@pytest.mark.parametrize(
    ("text", "value"),
    [("1e-3", 1e-3), ("1E3", 1e3), ("+.5", 0.5), (".5", 0.5), ("2.", 2.0), ("010.5", 10.5),
     ("1_0.5", 10.5), ("+1.5e+2", 150.0)],
)
def test_floats_are_yaml_1_2(tmp_path, text, value):
    assert load_config(overrides=[f"lr={text}"]).train.lr == value
    path = write(tmp_path, f"train_config:\n  lr: {text}\n")
    assert load_config(path=path).train.lr == value


def test_signed_fractions_and_infinity_are_floats():
    raises(lambda: load_config(overrides=["lr=-.5"]), "train_config.lr is out of range", "-0.5")
    raises(lambda: load_config(overrides=["lr=.inf"]), "train_config.lr", "inf")


# --- a known key in the wrong place ----------------------------------------------------------


def test_key_of_the_other_section_in_yaml(tmp_path):
    path = write(tmp_path, "train_config:\n  zero_opt_level: 2\n")
    raises(lambda: load_config(path=path), path, "unknown key 'train_config.zero_opt_level'",
           "'zero_opt_level' is a meta_dist_config key: move it under meta_dist_config")
    path = write(tmp_path, "meta_dist_config:\n  lr: 0.1\n", "lr.yaml")
    raises(lambda: load_config(path=path), path,
           "'lr' is a train_config key: move it under train_config")


def test_key_at_the_top_level_of_yaml(tmp_path):
    path = write(tmp_path, "zero_opt_level: 2\n")
    raises(lambda: load_config(path=path), path, "unknown section 'zero_opt_level'",
           "'zero_opt_level' is a meta_dist_config key: move it under meta_dist_config")


def test_key_of_the_other_section_on_the_command_line():
    raises(lambda: load_config(overrides=["meta_dist_config.lr=0.1"]), "command line",
           "unknown key 'meta_dist_config.lr'", "'lr' is a train_config key",
           "train_config.lr=VALUE", "lr=VALUE")


def test_key_of_the_other_section_in_a_script_dict():
    raises(lambda: load_config(train_config={"seed": 1}), "script dict",
           "'seed' is a meta_dist_config key")


def test_unknown_key_without_an_owner_keeps_its_suggestion(tmp_path):
    path = write(tmp_path, "zero_opt_levle: 2\n")
    msg = raises(lambda: load_config(path=path), path, "unknown section 'zero_opt_levle'")
    assert "is a meta_dist_config key" not in msg
