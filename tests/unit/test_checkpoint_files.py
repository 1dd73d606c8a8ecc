"""Checkpoint files without MPI: the checksum, pruning by save order, cut-off saves cleaned up."""

import json

import numpy as np
import pytest

from meta_dist import checkpoint
from meta_dist.checkpoint import Checksum
from meta_dist.checkpoint.files import _checksum


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 bytes, so that short arrays cross many block boundaries."""
    monkeypatch.setattr(Checksum, "BLOCK", 64)


@pytest.mark.parametrize("sizes", [[1000], [3, 61, 7, 200, 1], [16] * 9, [0, 5, 0, 33]])
def test_pieces_and_the_whole_file_give_one_checksum(small_blocks, sizes):
    """What save_shard computes from the pieces it writes is what a reader computes from the
    file: block boundaries do not depend on where the pieces end."""
    rng = np.random.default_rng(1)
    pieces = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    fed = Checksum()
    for p in pieces:
        fed.update(p)
    assert fed.hexdigest() == _checksum(np.concatenate(pieces))


def test_damage_changes_the_checksum(small_blocks):
    data = np.random.default_rng(2).integers(0, 255, 4096, np.uint8)
    digest = _checksum(data)
    flipped = data.copy()
    flipped[1234] ^= 0x08
    swapped = np.concatenate([data[64:128], data[:64], data[128:]])  # two blocks reordered
    for changed in (flipped, swapped, data[:-1], np.concatenate([data, [0]]).astype(np.uint8)):
        assert _checksum(changed) != digest
    assert digest.startswith("bsum64:") and _checksum(data.copy()) == digest


def test_old_crc32_checksums_still_verify():
    data = np.arange(1000, dtype=np.float32)
    import zlib

    assert _checksum(data, "crc32") == f"crc32:{zlib.crc32(data.tobytes()):08x}"


def save(directory, step, keep_last):
    tmp = directory / f"{checkpoint.TMP_PREFIX}{step:08d}"
    tmp.mkdir(parents=True)
    return checkpoint.commit(tmp, {"step": step}, keep_last)


def test_keep_last_prunes_the_oldest_saves_not_the_lowest_steps(tmp_path):
    """A run resumed from step 10 saves step 15 after steps 10 and 20 exist: the new save is
    the latest and is kept; the oldest saves go (by name, step 15 would have been deleted)."""
    save(tmp_path, 10, keep_last=2)
    save(tmp_path, 20, keep_last=2)
    save(tmp_path, 15, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000015", "step-00000020"]
    assert checkpoint.resolve(tmp_path).name == "step-00000015"
    save(tmp_path, 16, keep_last=1)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-00000016"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000016"


def test_a_completed_save_removes_cut_off_ones(tmp_path):
    (tmp_path / f"{checkpoint.TMP_PREFIX}00000003").mkdir()  # a save killed midway
    (tmp_path / f"{checkpoint.TMP_PREFIX}00000003" / "rank00000.params.npy").write_bytes(b"x")
    save(tmp_path, 4, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000004"]
    assert json.loads((tmp_path / "step-00000004" / "manifest.json").read_text())["saved"] == 1


def test_replacing_a_step_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    """A save of a step that exists (a resumed run) replaces it. The process dying between
    moving the old one away and moving the new one in must still leave a checkpoint that
    ``resolve`` finds: the old one (it used to be deleted first)."""
    save(tmp_path, 8, keep_last=1)
    tmp = tmp_path / f"{checkpoint.TMP_PREFIX}00000008"
    tmp.mkdir()
    real_rename = type(tmp).rename

    def die_moving_the_new_one_in(self, target):
        if self == tmp:
            raise SystemExit("killed before the new checkpoint was moved in")
        return real_rename(self, target)

    monkeypatch.setattr(type(tmp), "rename", die_moving_the_new_one_in)
    with pytest.raises(SystemExit):
        checkpoint.commit(tmp, {"step": 8, "marker": "new"}, keep_last=1)
    monkeypatch.undo()
    found = checkpoint.resolve(tmp_path)
    assert json.loads((found / checkpoint.MANIFEST).read_text()).get("marker") is None  # the old
    tmp.mkdir(exist_ok=True)  # the resumed run saves again, and this time completes
    final = checkpoint.commit(tmp, {"step": 8, "marker": "new"}, keep_last=1)
    assert checkpoint.resolve(tmp_path) == final
    assert json.loads((final / checkpoint.MANIFEST).read_text())["marker"] == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", final.name]


def test_a_damaged_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    """``latest`` that is not text (a disk fault) raised UnicodeDecodeError; like a latest
    naming a checkpoint that is gone, it now leaves the choice to the save order."""
    save(tmp_path, 4, keep_last=3)
    final = save(tmp_path, 6, keep_last=3)
    (tmp_path / "latest").write_bytes(b"\xff\xfe step")
    assert checkpoint.resolve(tmp_path) == final


def test_a_checkpoint_dir_is_held_by_one_job_and_freed_when_it_dies(tmp_path):
    """Two jobs in one checkpoint_dir removed each other's saves under way (a commit removes
    every .tmp-step-N): the second is refused, naming the holder. A holder killed with SIGKILL
    (no cleanup) leaves the lock file but not the lock: the next job goes ahead."""
    import subprocess
    import sys

    code = ("import sys, time\nfrom meta_dist import checkpoint\n"
            "lock = checkpoint.hold(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(300)\n")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "ck")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        with pytest.raises(checkpoint.DirectoryInUse,
                           match=rf"is in use by another job \(pid {other.pid} on host "):
            checkpoint.hold(tmp_path / "ck")
    finally:
        other.kill()
        other.wait(timeout=60)
        other.stdout.close()
    assert (tmp_path / "ck" / checkpoint.LOCK).is_file()
    lock = checkpoint.hold(tmp_path / "ck")
    assert lock is not None and not lock.closed
    lock.close()


def test_a_lock_file_of_other_bytes_still_names_its_holder(tmp_path):
    """Bytes that are not UTF-8 in a held .lock (another tool's, a damaged file) were a
    UnicodeDecodeError on rank 0 before the ranks compared their problems."""
    import subprocess
    import sys

    (tmp_path / checkpoint.LOCK).write_bytes(b"\xff\xfe held")
    code = ("import fcntl, sys, time\nf = open(sys.argv[1], 'rb')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(300)\n")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / checkpoint.LOCK)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "held\n"
        with pytest.raises(checkpoint.DirectoryInUse, match="is in use by another job"):
            checkpoint.hold(tmp_path)
    finally:
        other.kill()
        other.wait(timeout=60)
        other.stdout.close()
