"""meta_dist's on/off switches in the environment, all read by one rule.

Imports os only (failfast reads one before anything else is imported). The switches:
META_DIST_CHECK (the per-call cross-rank check, on by default), META_DIST_DEBUG (tracebacks
for a user's mistakes), META_DIST_CUDA_AWARE_MPI (device pointers straight to MPI).
"""

import os

OFF_WORDS = ("", "0", "false", "no", "off")


def env_flag(name: str, default: bool = False) -> bool:
    """Return whether switch ``name`` is on.

    Unset gives ``default``; empty, 0, false, no and off (any case, spaces ignored) are off;
    any other value is on.

    META_DIST_DEBUG=false once turned debugging on, and META_DIST_CHECK=off left the check on:
    each switch read its own words.
    """
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in OFF_WORDS
