"""The checkpoint command line without MPI: a failed consolidate keeps the earlier export, and bad
paths and manifests end in one line and exit code 2, not a traceback."""

import json

import numpy as np
import pytest

from meta_dist import checkpoint
from meta_dist.checkpoint.cli import main
from meta_dist.errors import USAGE_EXIT

PARAMS = {"0.Linear.weight": (3, 4), "0.Linear.bias": (4,)}  # 16 elements, end to end


@pytest.fixture
def saved(tmp_path):
    """A checkpoint as 2 ranks at ZeRO level 1 write it: elements [0, 8) and [8, 16)."""
    return write_checkpoint(tmp_path / "ck", {})


def write_checkpoint(directory, buffers):
    """Write the checkpoint of ``saved``, with ``buffers`` as the root rank saves them."""
    tmp = directory / f"{checkpoint.TMP_PREFIX}00000008"
    flat = {"params": np.arange(16, dtype=np.float32), "exp_avg": -np.arange(16, dtype=np.float32)}
    shards = [[[0, 8]], [[8, 16]]]
    sums = {}
    for rank, [(start, stop)] in enumerate(shards):
        sums.update(checkpoint.save_shard(tmp, rank, {k: [a[start:stop]] for k, a in flat.items()}))
    if buffers:
        sums.update(checkpoint.save_buffers(tmp, buffers))
    params, offset = [], 0
    for name, shape in PARAMS.items():
        numel = int(np.prod(shape))
        params.append({"name": name, "shape": list(shape), "dtype": "float32", "offset": offset,
                       "numel": numel})
        offset += numel
    manifest = {"format": checkpoint.FORMAT, "step": 8, "epoch": 0, "epoch_step": 8,
                "world_size": 2, "zero_opt_level": 1, "precision": "fp32", "params": params,
                "shards": shards, "checksums": sums, "scaler": None,
                "buffers": [{"name": n, "shape": list(b.shape), "dtype": str(b.dtype)}
                            for n, b in buffers.items()],
                "optimizer": {"name": "adam", "hyperparameters": {"lr": 0.001}, "step_count": 8,
                              "state": ["exp_avg"]}}
    return checkpoint.commit(tmp, manifest, keep_last=2)


def edit_manifest(step, change):
    path = step / checkpoint.MANIFEST
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def one_line_usage_error(capsys, argv):
    """Run the command line; assert it failed with exit code 2 and one line; return the line."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == USAGE_EXIT, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def test_consolidate_writes_every_parameter(saved, tmp_path, capsys):
    out = tmp_path / "model.npz"
    assert main(["consolidate", str(saved), str(out), "--optimizer"]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    with np.load(out) as merged:
        np.testing.assert_array_equal(merged["0.Linear.weight"],
                                      np.arange(12, dtype=np.float32).reshape(3, 4))
        np.testing.assert_array_equal(merged["optimizer/exp_avg/0.Linear.bias"],
                                      -np.arange(12, 16, dtype=np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.npz"]


def test_consolidate_and_info_include_batchnorm_statistics(tmp_path, capsys):
    """Evaluating an exported model needs BatchNorm's running statistics, as PyTorch's
    state_dict holds them beside the parameters."""
    stats = {"1.BatchNorm.running_mean": np.array([0.5, -1.0], np.float32),
             "1.BatchNorm.running_var": np.array([2.0, 3.0], np.float32)}
    step = write_checkpoint(tmp_path / "ck", stats)
    out = tmp_path / "model.npz"
    assert main(["consolidate", str(step), str(out)]) == 0
    with np.load(out) as merged:
        assert sorted(merged.files) == sorted([*PARAMS, *stats])
        for name, value in stats.items():
            np.testing.assert_array_equal(merged[name], value)
    assert main(["info", str(step)]) == 0
    shown = capsys.readouterr().out
    assert "2 buffers" in shown and "1.BatchNorm.running_var  (2,)  float32" in shown


def test_info_into_a_closed_pipe_ends_quietly(saved):
    """``info ... | head -1``: the reader has gone; one exit code, no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader left before the first line: every write fails
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        for unbuffered in ({}, {"PYTHONUNBUFFERED": "1"}):  # a shell's default, and ours in CI
            done = subprocess.run(
                [sys.executable, "-m", "meta_dist.checkpoint", "info", str(saved)],
                stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                env={**env, **unbuffered})
            assert done.returncode == 1 and done.stderr == "", (unbuffered, done.stderr)
    finally:
        os.close(write)


def test_a_failed_consolidate_leaves_the_earlier_export_as_it_was(saved, tmp_path, capsys):
    """Rank 1's exp_avg is damaged: the error comes after the parameters were written; out.npz
    must still be the good export (it used to hold only the parameters), and no temporary
    file is left."""
    out = tmp_path / "model.npz"
    assert main(["consolidate", str(saved), str(out), "--optimizer"]) == 0
    good = out.read_bytes()
    shard = checkpoint.shard_file(saved, 1, "exp_avg")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(out), "--optimizer"])
    assert "does not match its checksum" in line
    assert out.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "model.npz"]


def test_consolidate_into_a_missing_directory_names_it(saved, tmp_path, capsys):
    out = tmp_path / "nonexistent" / "dir" / "out.npz"
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(out)])
    assert line.startswith(f"consolidate: {out}'s directory {out.parent} does not exist; "), line
    assert not out.parent.exists()


def test_consolidate_onto_a_directory_names_it(saved, tmp_path, capsys):
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(tmp_path)])
    assert line.startswith(f"consolidate: {tmp_path} is a directory; expected the .npz "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(saved.parent)])
    assert line.startswith(f"consolidate: {saved.parent} is a directory; "), line


@pytest.mark.parametrize("manifest, says", [
    ([1, 2, 3], "holds a JSON list, not an object"),
    ({"format": 1, "step": 8}, "has no 'params'"),
    ({"name": "some other tool's manifest"}, "has no 'format'"),
    ({"format": 1, "params": {}, "shards": []}, "'params' is a JSON object, not a list"),
    ({"format": 1, "params": [{"name": "w"}], "shards": [], "optimizer": {"state": []},
      "checksums": {}}, "params[0] is {\"name\": \"w\"}, not an object with 'name', 'shape'"),
])
@pytest.mark.parametrize("command", ["info", "consolidate"])
def test_a_manifest_that_is_not_meta_dist_s_is_named(tmp_path, capsys, manifest, says, command):
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    argv = [command, str(step)] + ([str(tmp_path / "out.npz")] if command == "consolidate" else [])
    line = one_line_usage_error(capsys, argv)
    assert line.startswith(f"checkpoint: {step} is not a meta_dist checkpoint "
                           f"(manifest.json {says}"), line
    assert not (tmp_path / "out.npz").exists()


def test_info_names_a_manifest_without_what_it_shows(saved, capsys):
    edit_manifest(saved, lambda m: {k: v for k, v in m.items() if k != "world_size"})
    line = one_line_usage_error(capsys, ["info", str(saved)])
    assert line.startswith(f"checkpoint: {saved} is not a meta_dist checkpoint (manifest.json "
                           "has no 'world_size')"), line


def test_info_of_a_manifest_file_reads_its_checkpoint(saved, capsys):
    assert main(["info", str(saved / checkpoint.MANIFEST)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint {saved}\n  step 8 "), out
    assert "saved by 2 ranks at ZeRO level 1" in out


def test_info_of_another_file_says_to_pass_its_directory(saved, capsys):
    shard = checkpoint.shard_file(saved, 0, "params")
    line = one_line_usage_error(capsys, ["info", str(shard)])
    assert line == (f"checkpoint: {shard} is a file; expected a checkpoint directory (step-N) or "
                    f"a checkpoint_dir holding some; pass its directory, {saved}")


def cut_short(shard):
    shard.write_bytes(shard.read_bytes()[:-7])  # a copy or a disk that ran out


@pytest.mark.parametrize("damage, says", [
    (lambda shard: shard.unlink(), "is missing; expected every rank's files (2 ranks wrote one "
                                   "each): copy the whole checkpoint directory"),
    (cut_short, "is not a readable .npy file ("),  # numpy's words follow
    (lambda shard: np.save(shard, np.zeros(7, np.float32)),  # whole, but not rank 1's 8
     "holds 7 elements; expected 8 (rank 1's shards in manifest.json): it was cut or replaced "
     "after the save: use another checkpoint"),
])
def test_info_finds_a_shard_that_is_missing_or_not_whole(saved, capsys, damage, says):
    """info read the manifest alone: a checkpoint with a shard missing or cut short was
    summarised with exit code 0, and failed only when a job resumed from it. Every file the
    manifest names is now opened and its length counted (no checksum: that reads every byte)."""
    assert main(["info", str(saved)]) == 0
    good = capsys.readouterr().out
    shard = checkpoint.shard_file(saved, 1, "exp_avg")
    damage(shard)
    line = one_line_usage_error(capsys, ["info", str(saved)])
    assert line.startswith(f"checkpoint: {shard} {says}"), line
    assert line.endswith(("copy the whole checkpoint directory", "truncated or corrupt",
                          "use another checkpoint")), line
    assert capsys.readouterr().out == ""
    with pytest.raises(checkpoint.CheckpointError, match=says[:20]):
        checkpoint.info(saved.parent)  # through the checkpoint_dir's latest too
    assert good.startswith(f"checkpoint {saved}\n  step 8 ")


def test_info_finds_batchnorm_statistics_missing(tmp_path, capsys):
    stats = {"1.BatchNorm.running_mean": np.zeros(2, np.float32),
             "1.BatchNorm.running_var": np.ones(2, np.float32)}
    step = write_checkpoint(tmp_path / "ck", stats)
    np.savez(step / checkpoint.BUFFERS, **{"1.BatchNorm.running_mean": np.zeros(2, np.float32)})
    line = one_line_usage_error(capsys, ["info", str(step)])
    assert line == (f"checkpoint: {step / checkpoint.BUFFERS} lacks 1.BatchNorm.running_var, "
                    "which manifest.json lists; it was cut or replaced after the save: use "
                    "another checkpoint"), line
    # consolidate read buffers.npz as it found it: the model's .npz lacked running_var, exit 0
    line = one_line_usage_error(capsys, ["consolidate", str(step), str(tmp_path / "m.npz")])
    assert "lacks 1.BatchNorm.running_var, which manifest.json lists" in line, line
    assert not (tmp_path / "m.npz").exists()
    (step / checkpoint.BUFFERS).unlink()
    line = one_line_usage_error(capsys, ["info", str(step)])
    assert line.startswith(f"checkpoint: {step / checkpoint.BUFFERS} is not a readable .npz "
                           "file ("), line


def test_shards_that_leave_elements_out_are_refused(saved, tmp_path, capsys):
    """Rank 1's entry deleted from "shards": elements [8, 12) of the weight and all of the bias
    are in no file. consolidate used to write np.empty's garbage there, with exit code 0."""
    edit_manifest(saved, lambda m: {**m, "shards": m["shards"][:1]})
    out = tmp_path / "model.npz"
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(out)])
    assert line.startswith(f"checkpoint: {saved} holds no rank's shard of elements [8, 12) of "
                           "parameter 0.Linear.weight (12 elements); "), line
    assert not out.exists()
    with pytest.raises(checkpoint.CheckpointError, match=r"\[8, 12\) of parameter 0.Linear"):
        checkpoint.Reader(saved)


def test_shards_that_leave_a_gap_inside_a_parameter_are_refused(saved):
    edit_manifest(saved, lambda m: {**m, "shards": [[[0, 5]], [[8, 16]]]})
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"elements \[5, 8\) of parameter 0.Linear.weight"):
        checkpoint.Reader(saved)


def test_a_shape_that_does_not_hold_numel_is_named(saved, tmp_path, capsys):
    edit_manifest(saved, lambda m: {**m, "params": [{**m["params"][0], "shape": [9, 9]},
                                                    *m["params"][1:]]})
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(tmp_path / "m.npz")])
    assert line.startswith(f"checkpoint: {saved / 'manifest.json'} gives 0.Linear.weight shape "
                           "(9, 9) and 12 elements; "), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_consolidate_through_a_link_replaces_the_file_it_names(saved, tmp_path):
    (tmp_path / "exports").mkdir()
    real = tmp_path / "exports" / "model.npz"
    real.write_bytes(b"an older export")
    link = tmp_path / "model.npz"
    link.symlink_to(real)
    assert main(["consolidate", str(saved), str(link)]) == 0
    assert link.is_symlink() and sorted(p.name for p in real.parent.iterdir()) == ["model.npz"]
    with np.load(real) as merged:
        assert merged["0.Linear.bias"].shape == (4,)


def test_a_shard_that_is_a_zip_archive_is_named(saved, tmp_path, capsys):
    """A shard replaced by an .npz (np.load returns an NpzFile for a zip): one line and exit
    code 2, as for any unreadable .npy file, not AttributeError: 'NpzFile' object has no
    attribute 'reshape'. Opened without its checksum (a resuming trainer's ranks open every
    file first) it is refused too, not returned."""
    shard = checkpoint.shard_file(saved, 0, "params")
    np.savez(tmp_path / "z.npz", a=np.zeros(3))
    shard.write_bytes((tmp_path / "z.npz").read_bytes())
    line = one_line_usage_error(capsys, ["consolidate", str(saved), str(tmp_path / "m.npz")])
    assert line.startswith(f"checkpoint: {shard} is not a readable .npy file (a zip archive, "
                           "as an .npz file is); it is truncated or corrupt"), line
    with pytest.raises(checkpoint.CheckpointError, match="is not a readable .npy file"):
        checkpoint.Reader(saved, verify=False).open(0, "params")


def test_buffers_that_are_not_a_zip_archive_are_named(tmp_path, capsys):
    """buffers.npz replaced by a plain .npy file (np.load returns an array, no archive)."""
    step = write_checkpoint(tmp_path / "ck", {"1.BatchNorm.running_mean": np.zeros(2)})
    np.save(step / checkpoint.BUFFERS, np.zeros(2))  # np.save adds .npy: move it in place
    (step / f"{checkpoint.BUFFERS}.npy").replace(step / checkpoint.BUFFERS)
    line = one_line_usage_error(capsys, ["consolidate", str(step), str(tmp_path / "m.npz")])
    assert line.startswith(f"checkpoint: {step / checkpoint.BUFFERS} is not a readable .npz "
                           "file (a single .npy array, not a zip archive); it is truncated or "
                           "corrupt"), line


@pytest.mark.parametrize("read, out", [
    ("step", "step/manifest.json"),  # the checkpoint read: it was overwritten, exit code 0
    ("dir", "step/rank00000.params.npy"),  # read through its checkpoint_dir's latest
    ("link", "link/new.npz"),  # a link to the checkpoint read
    ("step", "dir/latest"),  # the file naming it (a resume then failed on its bytes)
    ("step", "dir/step-00000004/manifest.json"),  # another checkpoint beside it
])
def test_consolidate_never_writes_into_a_checkpoint(saved, tmp_path, capsys, read, out):
    """consolidate read every array first and then replaced the file it was told to write:
    given a file of a checkpoint, it destroyed it. Refused, whichever path leads there, before
    anything is written (not even its temporary file); beside the checkpoints is fine."""
    older = write_checkpoint(tmp_path / "other", {}).rename(saved.parent / "step-00000004")
    (tmp_path / "link").symlink_to(saved)
    paths = {"step": saved, "dir": saved.parent, "link": tmp_path / "link"}
    target = paths[out.split("/")[0]].joinpath(*out.split("/")[1:])
    before = {p: p.read_bytes() for p in saved.parent.rglob("*") if p.is_file()}
    line = one_line_usage_error(capsys, ["consolidate", str(paths[read]), str(target)])
    assert line.startswith(f"consolidate: {target} is "), line
    assert ("; writing it would damage the checkpoints; expected a path outside every "
            f"checkpoint and latest, e.g. {saved.parent}/model.npz") in line
    assert {p: p.read_bytes() for p in saved.parent.rglob("*") if p.is_file()} == before
    assert older.is_dir()
    assert main(["consolidate", str(paths[read]), str(saved.parent / "model.npz")]) == 0


def test_consolidate_guards_a_checkpoint_dir_whose_step_is_a_link(saved, tmp_path, capsys):
    """A step directory linked to another disk: the checkpoint_dir beside the link keeps its
    latest (only the link target's folder was looked at, and latest was overwritten)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / saved.name).symlink_to(saved)
    (home / "latest").write_bytes((saved.parent / "latest").read_bytes())
    before = (home / "latest").read_bytes()
    line = one_line_usage_error(capsys, ["consolidate", str(home), str(home / "latest")])
    assert line.startswith(f"consolidate: {home / 'latest'} is {home}'s latest"), line
    assert (home / "latest").read_bytes() == before
