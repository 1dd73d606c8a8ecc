"""Unit tests for meta_dist.config: layering, sources, validation messages, CLI and world checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from meta_dist.config import (
    Config,
    DistConfig,
    TrainConfig,
    check_world,
    format_config,
    load_config,
    parse_cli,
)
from meta_dist.errors import UsageError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def raises(exc: type, call, *parts: str) -> str:
    """Call, expect exc, and check its message holds every part; return the message."""
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


# --- defaults and layering -------------------------------------------------------------------


def test_defaults():
    cfg = load_config()
    assert cfg.train == TrainConfig()
    assert cfg.dist == DistConfig()
    assert cfg.dist.zero_opt_level == 0 and cfg.dist.enable_data_parallel is True
    assert cfg.dist.bucket_size_mb == 25.0 and cfg.dist.overlap_comm is None
    assert (cfg.dist.backend, cfg.dist.device, cfg.dist.seed) == ("auto", "auto", 0)
    assert cfg.train.input_shape == (3, 28, 28) and cfg.train.betas == (0.9, 0.999)
    assert cfg.train.batch_size == 64 and cfg.train.optimizer == "sgd"
    assert cfg.train.data_path is None
    assert set(cfg.sources.values()) == {"default"}
    n_keys = len(dataclasses.fields(TrainConfig)) + len(dataclasses.fields(DistConfig))
    assert len(cfg.sources) == n_keys


def test_bare_names_are_unique_across_sections():
    train = {f.name for f in dataclasses.fields(TrainConfig)}
    dist = {f.name for f in dataclasses.fields(DistConfig)}
    assert not train & dist


def test_configs_are_frozen():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dist.zero_opt_level = 2


def test_each_layer_overrides_the_one_below(tmp_path):
    path = write(
        tmp_path,
        "meta_dist_config:\n  zero_opt_level: 1\n  seed: 7\ntrain_config:\n  lr: 0.1\n",
    )
    cfg = load_config(
        train_config={"lr": 0.01, "batch_size": 32},
        meta_dist_config={"zero_opt_level": 2, "seed": 3, "backend": "mpi"},
        path=path,
        overrides=["seed=11", "train_config.batch_size=16"],
    )
    assert cfg.dist.backend == "mpi"
    assert cfg.sources["meta_dist_config.backend"] == "script"
    assert cfg.dist.zero_opt_level == 1
    assert cfg.sources["meta_dist_config.zero_opt_level"] == path
    assert cfg.train.lr == 0.1
    assert cfg.sources["train_config.lr"] == path
    assert cfg.dist.seed == 11
    assert cfg.sources["meta_dist_config.seed"] == "command line"
    assert cfg.train.batch_size == 16
    assert cfg.sources["train_config.batch_size"] == "command line"
    assert cfg.sources["train_config.n_epoch"] == "default"


def test_empty_yaml_and_empty_sections(tmp_path):
    assert load_config(path=write(tmp_path, "")).dist == DistConfig()
    assert load_config(path=write(tmp_path, "# nothing\n")).dist == DistConfig()
    cfg = load_config(path=write(tmp_path, "meta_dist_config:\ntrain_config:\n"))
    assert cfg.train == TrainConfig()


def test_override_values_are_yaml(tmp_path):
    cfg = load_config(
        overrides=[
            "overlap_comm=false",
            "input_shape=[1, 28, 28]",
            "optimizer=adam",
            "lr=1e-3",
            "meta_dist_config.bucket_size_mb=4",
        ]
    )
    assert cfg.dist.overlap_comm is False
    assert cfg.train.input_shape == (1, 28, 28)
    assert cfg.train.optimizer == "adam"
    assert cfg.train.lr == 1e-3
    assert cfg.dist.bucket_size_mb == 4.0 and isinstance(cfg.dist.bucket_size_mb, float)


def test_yaml_lists_become_tuples_and_exponents_are_floats(tmp_path):
    text = "train_config:\n  input_shape: [784]\n  betas: [0.8, 0.99]\n  eps: 1e-6\n"
    path = write(tmp_path, text)
    cfg = load_config(path=path)
    assert cfg.train.input_shape == (784,)
    assert cfg.train.betas == (0.8, 0.99)
    assert cfg.train.eps == 1e-6


def test_as_dicts_is_plain_and_round_trips(tmp_path):
    cfg = load_config(overrides=["zero_opt_level=2"])
    dicts = cfg.as_dicts()
    assert list(dicts) == ["train_config", "meta_dist_config"]
    assert dicts["train_config"]["input_shape"] == [3, 28, 28]
    assert dicts["meta_dist_config"]["zero_opt_level"] == 2
    path = write(tmp_path, yaml.safe_dump(dicts))
    again = load_config(path=path)
    assert (again.train, again.dist) == (cfg.train, cfg.dist)


def test_format_config_lists_values_and_sources(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: 2\n")
    text = format_config(load_config(path=path, overrides=["lr=0.5"]))
    assert text.splitlines()[0] == "train_config:"
    assert "meta_dist_config:" in text
    line = next(ln for ln in text.splitlines() if "zero_opt_level" in ln)
    assert "= 2" in line and f"[{path}]" in line
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("lr "))
    assert "0.5" in line and "[command line]" in line
    assert "input_shape" in text and "[3, 28, 28]" in text


@pytest.mark.parametrize(("name", "level"), [("dp", 0), ("zero1", 1), ("zero2", 2)])
def test_shipped_configs(name, level):
    path = REPO / "configs" / f"{name}.yaml"
    cfg = load_config(path=str(path))
    assert cfg.dist.zero_opt_level == level
    assert cfg.dist.enable_data_parallel is True
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and f"--config configs/{name}.yaml" in first


def test_direct_construction_is_validated():
    assert TrainConfig(input_shape=[1, 2]).input_shape == (1, 2)
    assert isinstance(DistConfig(bucket_size_mb=1).bucket_size_mb, float)
    raises(ValueError, lambda: DistConfig(zero_opt_level=5), "zero_opt_level", "5", "DistConfig")
    assert Config().dist == DistConfig()


# --- unknown keys ----------------------------------------------------------------------------


def test_unknown_key_in_yaml_suggests_closest(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_levle: 2\n", "zero2.yaml")
    msg = raises(
        ValueError,
        lambda: load_config(path=path),
        path,
        "unknown key 'meta_dist_config.zero_opt_levle'",
        "valid keys:",
        "bucket_size_mb",
        "Did you mean 'zero_opt_level'?",
    )
    assert msg.startswith(path + ":")


def test_unknown_section_in_yaml(tmp_path):
    path = write(tmp_path, "meta_dist_cfg:\n  zero_opt_level: 2\n")
    raises(
        ValueError,
        lambda: load_config(path=path),
        path,
        "unknown section 'meta_dist_cfg'",
        "train_config",
        "Did you mean 'meta_dist_config'?",
    )


def test_unknown_key_in_script_dict():
    raises(
        ValueError,
        lambda: load_config(train_config={"n_epochs": 2}),
        "script dict",
        "'train_config.n_epochs'",
        "Did you mean 'n_epoch'?",
    )


def test_unknown_override_keys():
    raises(
        ValueError,
        lambda: load_config(overrides=["zero_opt_levl=2"]),
        "command line",
        "'zero_opt_levl'",
        "Did you mean 'zero_opt_level'?",
    )
    raises(
        ValueError,
        lambda: load_config(overrides=["train_config.zero_opt_level=2"]),
        "command line",
        "'train_config.zero_opt_level'",
        "valid keys:",
    )
    raises(
        ValueError,
        lambda: load_config(overrides=["trian_config.lr=2"]),
        "command line",
        "unknown section 'trian_config'",
        "Did you mean 'train_config'?",
    )


# --- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("meta_dist_config", "zero_opt_level", True, "int"),  # bool is not an int here
        ("train_config", "batch_size", 64.0, "int"),
        ("train_config", "n_epoch", "3", "int"),
        ("meta_dist_config", "enable_data_parallel", 1, "bool"),  # nor is an int a bool
        ("meta_dist_config", "overlap_comm", "yes please", "bool"),
        ("train_config", "lr", True, "float"),
        ("train_config", "lr", "fast", "float"),
        ("train_config", "input_shape", 784, "list of int"),
        ("train_config", "input_shape", [1, 2.5], "list of int"),
        ("train_config", "betas", [0.9], "list of 2"),
        ("train_config", "betas", [0.9, 0.99, 0.999], "list of 2"),
        ("train_config", "batch_size", None, "int"),
        ("train_config", "data_path", 3, "str or null"),
        ("meta_dist_config", "backend", 1, "str"),
    ],
)
def test_wrong_type_from_yaml(tmp_path, section, key, value, expected):
    path = write(tmp_path, yaml.safe_dump({section: {key: value}}))
    raises(
        UsageError,
        lambda: load_config(path=path),
        path,
        f"{section}.{key}",
        repr(value),
        expected,
    )


def test_wrong_type_names_allowed_values_and_source():
    raises(
        UsageError,
        lambda: load_config(overrides=["zero_opt_level=true"]),
        "command line",
        "meta_dist_config.zero_opt_level",
        "True",
        "(bool)",
        "one of 0, 1, 2",
    )
    raises(
        UsageError,
        lambda: load_config(meta_dist_config={"overlap_comm": 0}),
        "script dict",
        "meta_dist_config.overlap_comm",
        "0",
        "bool (true/false)",
    )


def test_numpy_numbers_in_a_script_dict_are_their_python_values():
    """A script's arithmetic gives numpy numbers (np.int64 from len(x) // 10): they were
    refused as the wrong type."""
    config = load_config({"batch_size": np.int64(64), "lr": np.float32(0.5),
                          "input_shape": [np.int64(28)]},
                         {"zero_opt_level": np.int32(2), "overlap_comm": np.bool_(False)})
    assert config.train.batch_size == 64 and type(config.train.batch_size) is int
    assert config.train.lr == 0.5 and type(config.train.lr) is float
    assert config.dist.zero_opt_level == 2 and config.dist.overlap_comm is False
    raises(UsageError, lambda: load_config({"batch_size": np.float64(64.5)}),
           "train_config.batch_size has the wrong type; got", "64.5")


def test_ints_accepted_for_floats_and_inf_rejected():
    assert load_config(train_config={"lr": 1, "weight_decay": 0}).train.lr == 1.0
    raises(UsageError, lambda: load_config(overrides=["lr=.inf"]), "train_config.lr", "inf")


def test_script_dict_must_be_a_dict():
    raises(TypeError, lambda: load_config(train_config=[("lr", 1)]), "train_config", "dict")
    raises(TypeError, lambda: load_config(overrides="lr=1"), "overrides", "'lr=1'")


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value", "rule"),
    [
        ("meta_dist_config", "zero_opt_level", -1, "one of 0, 1, 2"),
        ("meta_dist_config", "zero_opt_level", 4, "one of 0, 1, 2"),
        ("meta_dist_config", "bucket_size_mb", 0, "> 0"),
        ("meta_dist_config", "backend", "gloo", "one of 'auto', 'mpi', 'nccl'"),
        ("meta_dist_config", "device", "tpu", "one of 'auto', 'cpu', 'cuda'"),
        ("meta_dist_config", "seed", -3, ">= 0"),
        ("train_config", "n_epoch", 0, ">= 1"),
        ("train_config", "n_mini_batch", 0, ">= 1"),
        ("train_config", "batch_size", -8, ">= 1"),
        ("train_config", "input_shape", [3, 0, 28], "sizes > 0"),
        ("train_config", "input_shape", [], "non-empty"),
        ("train_config", "num_classes", 1, ">= 2"),
        ("train_config", "optimizer", "lamb", "one of 'sgd', 'adam', 'adamw'"),
        ("train_config", "lr", -0.1, ">= 0"),
        ("train_config", "betas", [0.9, 1.0], "[0, 1)"),
        ("train_config", "dtype", "float16", "one of 'float32', 'float64'"),
        ("train_config", "log_every", 0, ">= 1"),
    ],
)
def test_value_out_of_range(tmp_path, section, key, value, rule):
    path = write(tmp_path, yaml.safe_dump({section: {key: value}}))
    raises(ValueError, lambda: load_config(path=path), path, f"{section}.{key}", repr(value), rule)
    word = f"{key}={yaml.safe_dump(value, default_flow_style=True).splitlines()[0]}"
    raises(ValueError, lambda: load_config(overrides=[word]), "command line", key, rule)


def test_zero_levels_have_one_source(tmp_path):
    """config.ZERO_LEVELS decides what the config, the context and the stages accept."""
    from meta_dist.config import ZERO_LEVELS
    from meta_dist.zero import STAGES

    assert tuple(STAGES) == ZERO_LEVELS == (0, 1, 2, 3)
    assert load_config(meta_dist_config={"zero_opt_level": 3}).dist.zero_opt_level == 3
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: 4\n")
    raises(ValueError, lambda: load_config(path=path), path, "meta_dist_config.zero_opt_level",
           "got 4", "one of 0, 1, 2, 3")


def test_bad_value_in_a_lower_layer_is_still_an_error(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: 7\n")
    raises(ValueError, lambda: load_config(path=path, overrides=["zero_opt_level=1"]), path)


# --- contradictions --------------------------------------------------------------------------


def test_zero_needs_data_parallel(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: 2\n")
    raises(
        ValueError,
        lambda: load_config(path=path, overrides=["enable_data_parallel=false"]),
        "meta_dist_config.enable_data_parallel",
        "meta_dist_config.zero_opt_level",
        "zero_opt_level=2",
        path,
        "command line",
        "ZeRO partitions across data-parallel ranks",
    )
    cfg = load_config(meta_dist_config={"enable_data_parallel": False})
    assert cfg.dist.enable_data_parallel is False and cfg.dist.zero_opt_level == 0


def test_nccl_needs_a_gpu():
    raises(
        ValueError,
        lambda: load_config(meta_dist_config={"backend": "nccl", "device": "cpu"}),
        "script dict",
        "meta_dist_config.backend",
        "backend='nccl'",
        "device='cpu'",
        "NCCL moves GPU arrays only",
    )
    assert load_config(meta_dist_config={"backend": "nccl"}).dist.device == "auto"


def test_nesterov_needs_momentum():
    raises(
        ValueError,
        lambda: load_config(overrides=["nesterov=true", "momentum=0"]),
        "command line",
        "nesterov",
        "momentum",
    )


def test_checkpoint_every_needs_a_checkpoint_dir(tmp_path):
    """checkpoint_every set without checkpoint_dir asked for checkpoints that no run wrote
    (silently). Its default stays quiet, also when written out (a resolved config saved as YAML
    holds every key: test_as_dicts_is_plain_and_round_trips); keep_last prunes after
    Trainer.save_checkpoint too, so it needs no checkpoint_dir."""
    raises(ValueError, lambda: load_config(overrides=["checkpoint_every=2", "keep_last=5"]),
           "command line and default: train_config.checkpoint_every needs "
           "train_config.checkpoint_dir",
           "checkpoint_every=2 with checkpoint_dir=None", "set checkpoint_dir")
    path = write(tmp_path, "train_config:\n  checkpoint_every: 3\n")
    raises(ValueError, lambda: load_config(path=path), f"{path} and default: train_config.")
    assert load_config(overrides=["keep_last=5"]).train.keep_last == 5
    raises(ValueError, lambda: load_config({"checkpoint_every": 4}), "script dict",
           "checkpoint_every=4")
    raises(ValueError, lambda: TrainConfig(checkpoint_every=3), "TrainConfig(...)",
           "checkpoint_every=3")
    assert load_config(overrides=["checkpoint_every=2", "checkpoint_dir=ck"]).train.keep_last == 2
    assert load_config({"checkpoint_every": 0, "keep_last": 2}).train.checkpoint_dir is None


@pytest.mark.parametrize(("section", "key"), [("train_config", "checkpoint_dir"),
                                              ("train_config", "resume_from"),
                                              ("meta_dist_config", "trace")])
def test_an_empty_path_is_refused(tmp_path, section, key):
    """An empty path is no path: checkpoint_dir "" (with checkpoint_every) wrote nothing and
    trace "" recorded nothing, without a word; null is how to ask for none."""
    path = write(tmp_path, f'{section}:\n  {key}: ""\n')
    raises(ValueError, lambda: load_config(path=path), f"{path}: {section}.{key} is empty; got "
           "'', expected null or a non-empty path", f"{key}: null")
    raises(ValueError, lambda: load_config(overrides=[f"{key}=' '"]), "command line",
           f"{section}.{key} is empty")


# --- files -----------------------------------------------------------------------------------


def test_yaml_that_does_not_parse(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: [2\n")
    raises(ValueError, lambda: load_config(path=path), path, "cannot parse YAML", "line 3")


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- zero_opt_level: 2\n")
    raises(ValueError, lambda: load_config(path=path), path, "not a mapping", "list")
    path = write(tmp_path, "meta_dist_config: 2\n", "section.yaml")
    raises(ValueError, lambda: load_config(path=path), path, "'meta_dist_config'", "not a mapping")


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    raises(ValueError, lambda: load_config(path=missing), missing, "not found")


def test_data_path(tmp_path):
    missing = str(tmp_path / "missing.npz")
    raises(
        ValueError,
        lambda: load_config(overrides=[f"data_path={missing}"]),
        "command line",
        "train_config.data_path",
        missing,
        ".npz",
    )
    present = tmp_path / "data.npz"
    present.write_bytes(b"")
    assert load_config(train_config={"data_path": str(present)}).train.data_path == str(present)
    path = write(tmp_path, f"train_config:\n  data_path: {missing}\n")
    cfg = load_config(path=path, overrides=["data_path=null"])  # only the final value must exist
    assert cfg.train.data_path is None


# --- overrides -------------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["zero_opt_level", "=2", " =2"])
def test_override_without_key_value_form(word):
    raises(
        ValueError, lambda: load_config(overrides=[word]), "command line", repr(word), "KEY=VALUE"
    )


def test_override_value_that_is_not_yaml():
    raises(
        ValueError,
        lambda: load_config(overrides=["input_shape=[1, 2"]),
        "command line",
        "train_config.input_shape",
        "'[1, 2'",
    )


def test_override_value_may_contain_equals(tmp_path):
    data = tmp_path / "a=b.npz"
    data.write_bytes(b"")
    assert load_config(overrides=[f"data_path={data}"]).train.data_path == str(data)


# --- check_world -----------------------------------------------------------------------------


def test_check_world_accepts_divisible_batch():
    cfg = load_config(train_config={"batch_size": 12})
    for size in (1, 2, 3, 4, 6, 12):
        check_world(cfg, size)


def test_check_world_batch_not_divisible(tmp_path):
    path = write(tmp_path, "train_config:\n  batch_size: 30\n")
    cfg = load_config(path=path)
    raises(
        ValueError,
        lambda: check_world(cfg, 4),
        "train_config.batch_size",
        "30",
        "4 ranks",
        path,
        "28 or 32",
    )
    small = load_config(overrides=["batch_size=3"])
    msg = raises(ValueError, lambda: check_world(small, 4), "command line", "batch_size=4")
    assert "0 or" not in msg


def test_check_world_data_parallel_off():
    cfg = load_config({"batch_size": 7}, {"enable_data_parallel": False})
    check_world(cfg, 1)
    raises(
        ValueError,
        lambda: check_world(cfg, 2),
        "enable_data_parallel",
        "2 ranks",
        "script dict",
        "own copy",
        "launch 1 rank",
    )


@pytest.mark.parametrize(
    ("size", "exc"), [(0, ValueError), (-1, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_check_world_bad_size(size, exc):
    raises(exc, lambda: check_world(load_config(), size), "check_world", repr(size), ">= 1")


# --- parse_cli -------------------------------------------------------------------------------


def test_parse_cli_forms():
    assert parse_cli([]) == (None, [])
    assert parse_cli(["--config", "c.yaml"]) == ("c.yaml", [])
    assert parse_cli(["--config=c.yaml", "lr=0.1"]) == ("c.yaml", ["lr=0.1"])
    assert parse_cli(["zero_opt_level=2", "--config", "c.yaml", "meta_dist_config.seed=3"]) == (
        "c.yaml",
        ["zero_opt_level=2", "meta_dist_config.seed=3"],
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--lr=0.1"],
        ["zero_opt_level"],
        ["--config"],
        ["--config", "--verbose"],
        ["--config="],
        ["--config", "a.yaml", "--config", "b.yaml"],
        ["-v"],
    ],
)
def test_parse_cli_errors(argv):
    raises(ValueError, lambda: parse_cli(argv), "parse_cli", "usage:", "--config PATH")


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_parse_cli_help(flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_cli(["lr=1", "--bogus", flag])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "meta_dist_config.zero_opt_level" in out


def test_help_shows_what_this_run_would_use_and_the_scripts_name(tmp_path, capsys,
                                                                  monkeypatch):
    """--help lists each key with the value the script would run with (its dicts, then the
    file, then the words beside --help) and where it comes from; the usage line names the
    script, not a placeholder."""
    monkeypatch.setattr("sys.argv", ["/x/scripts/distributed/dist_example.py"])
    path = write(tmp_path, "train_config:\n  lr: 0.5\n")
    with pytest.raises(SystemExit):
        parse_cli(["--config", str(path), "zero_opt_level=2", "--help"], {"n_epoch": 4},
                  {"seed": 3})
    out = capsys.readouterr().out
    assert out.startswith("usage: dist_example.py [--config PATH]")
    for line in ("train_config.n_epoch = 4  [script]", f"train_config.lr = 0.5  [{path}]",
                 "meta_dist_config.zero_opt_level = 2  [command line]",
                 "meta_dist_config.seed = 3  [script]", "train_config.batch_size = 64  [default]"):
        assert f"\n  {line}\n" in out, line


def test_help_into_a_closed_pipe_ends_quietly():
    """``dist_example.py --help | head``: the reader has gone; exit 1, no BrokenPipeError
    traceback (there was one, from the print of the usage)."""
    import os
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "scripts" / "distributed" / "dist_example.py"
    read, write = os.pipe()
    os.close(read)  # the reader left before the first line: every write fails
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        for unbuffered in ({}, {"PYTHONUNBUFFERED": "1"}):  # a shell's default, and ours in CI
            done = subprocess.run([sys.executable, str(script), "--help"], stdout=write,
                                  stderr=subprocess.PIPE, text=True, timeout=120,
                                  env={**env, **unbuffered})
            assert done.returncode == 1 and done.stderr == "", (unbuffered, done.stderr)
    finally:
        os.close(write)


def test_parse_cli_feeds_load_config(tmp_path):
    path = write(tmp_path, "meta_dist_config:\n  zero_opt_level: 1\n")
    cfg = load_config({"lr": 0.2}, {"seed": 1}, *parse_cli(["--config", path, "seed=5"]))
    assert (cfg.dist.zero_opt_level, cfg.dist.seed, cfg.train.lr) == (1, 5, 0.2)
