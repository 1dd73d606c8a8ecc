"""meta_dist.env: the one rule for the on/off switches in the environment."""

import pytest

from meta_dist import failfast
from meta_dist.env import env_flag


@pytest.mark.parametrize(("value", "on"), [
    ("1", True), ("yes", True), ("on", True), ("TRUE", True),
    ("0", False), ("false", False), ("No", False), (" off ", False), ("", False),
])
def test_every_switch_reads_the_same_words(monkeypatch, value, on):
    """META_DIST_DEBUG=false turned debugging on (only empty and 0 were off), and
    META_DIST_CHECK=off left the check on: each switch had its own words."""
    for name in ("META_DIST_DEBUG", "META_DIST_CHECK", "META_DIST_CUDA_AWARE_MPI"):
        monkeypatch.setenv(name, value)
        assert env_flag(name) is on and env_flag(name, default=True) is on
    assert failfast._debug() is on


def test_an_unset_switch_takes_its_default(monkeypatch):
    monkeypatch.delenv("META_DIST_CHECK", raising=False)
    assert env_flag("META_DIST_CHECK", default=True) and not env_flag("META_DIST_CHECK")
