"""Files never run code: data files, checkpoints and configs are read as plain data; a pickle or
a Python-object YAML tag planted in one is refused with a message naming the file."""

import json

import numpy as np
import pytest

from meta_dist import checkpoint
from meta_dist.config import load_config
from meta_dist.train import load_npz

BOOBY_TRAP = "the planted object was built"


class Trap:
    def __reduce__(self):  # unpickling this would call RuntimeError(BOOBY_TRAP)... and raise
        return (RuntimeError, (BOOBY_TRAP,))


def test_a_pickled_array_in_a_data_file_is_refused(tmp_path):
    path = tmp_path / "data.npz"
    np.savez(path, x=np.array([Trap(), Trap()], dtype=object), y=np.array([0, 1]))
    with pytest.raises(ValueError, match=rf"{path}: an array holds Python objects .* np\.savez"):
        load_npz(path)


@pytest.mark.parametrize("content, words", [
    (b"1,2,3\n4,5,6\n", "not a readable .npz file"),
    (b"PK\x03\x04 damaged", "not a readable .npz file"),
])
def test_a_data_file_that_is_not_an_npz_says_so(tmp_path, content, words):
    path = tmp_path / "data.npz"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}: {words}.*np.savez"):
        load_npz(path)


def test_a_npy_given_as_data_says_it_holds_one_array(tmp_path):
    path = tmp_path / "data.npy"
    np.save(path, np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"holds one array \(a .npy file\); expected an .npz"):
        load_npz(path)


def test_a_python_object_tag_in_a_config_is_refused(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train_config:\n  lr: !!python/object/apply:os.system ['echo ran']\n")
    with pytest.raises(ValueError, match=rf"{path}: a YAML tag that builds a Python object "
                                         r"at line 2.*never run code"):
        load_config(path=path)


def test_a_pickle_planted_in_a_checkpoint_is_refused(tmp_path):
    step = tmp_path / "step-00000001"
    step.mkdir()
    np.save(step / "rank00000.params.npy", np.array([Trap()], dtype=object), allow_pickle=True)
    manifest = {"format": checkpoint.FORMAT, "step": 1, "params": [], "shards": [[]],
                "optimizer": {"state": []}, "checksums": {}}
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    reader = checkpoint.Reader(step)
    with pytest.raises(checkpoint.CheckpointError, match="holds Python objects .* never loads"):
        reader.open(0, "params")
