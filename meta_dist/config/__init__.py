"""Run configuration: train_config and meta_dist_config as frozen dataclasses, loaded in layers.

Leaf package: imports yaml and the standard library, and from meta_dist only meta_dist.errors;
scripts, the trainer and meta_dist.distributed import it. Public names only; no logic.

Layers, lowest to highest: defaults in code, the dicts a script passes, a YAML file (overrides
only), then ``KEY=VALUE`` words from the command line. Every value is checked when it is set, and
every combination before anything else happens, so a bad config fails on every rank before the
first collective, with the key, the value, the rule and where the value came from.

Modules, each importing only those above it:
    coerce: a given value turned into a field's type (int to float, list to tuple), or refused.
    messages: the wording every message shares (where a value came from, unknown names).
    schema: the sections' dataclasses, every key's default and rule, and the checks that apply
        them; the one place to add a key.
    load: load_config, reading each layer (script dicts, a YAML file, ``KEY=VALUE`` words).
    world: check_world and check_same_everywhere, the checks against the launch.
    cli: parse_cli, --help's listing and format_config.

Environment variables (the one place they are documented):
    META_DIST_MPIRUN: the mpirun launcher used by tests and scripts (default ``mpirun``).
    META_DIST_CHECK: ``0`` compares the ranks' collectives only at barriers, epoch ends and close
        instead of before every call (one 16-byte allreduce per call otherwise).
    META_DIST_CUDA_AWARE_MPI: ``1`` hands CuPy arrays to MPI as they are (a CUDA-aware MPI
        only; the PyPI wheels are not); otherwise they are staged through host memory.
    META_DIST_STALL_TIMEOUT: seconds a collective may wait for the other ranks before the job
        is ended with a report of who did not arrive; overrides ``stall_timeout`` for any
        program (0: no watchdog).
"""

from meta_dist.config.cli import USAGE, format_config, parse_cli
from meta_dist.config.load import COMMAND_LINE, load_config
from meta_dist.config.schema import DIST, TRAIN, ZERO_LEVELS, Config, DistConfig, TrainConfig
from meta_dist.config.world import PER_RANK_KEYS, check_same_everywhere, check_world

__all__ = ["COMMAND_LINE", "DIST", "PER_RANK_KEYS", "TRAIN", "USAGE", "ZERO_LEVELS", "Config",
           "DistConfig", "TrainConfig", "check_same_everywhere", "check_world", "format_config",
           "load_config", "parse_cli"]
