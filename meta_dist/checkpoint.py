"""Checkpoints that any world size and ZeRO level can resume, and plain numpy can read.

Imports numpy and the standard library only (no MPI): ``python -m meta_dist.checkpoint info
PATH`` and ``... consolidate PATH OUT.npz`` run anywhere. The trainer writes and reads through
``save_shard``/``commit``/``Reader``.

A checkpoint is a directory ``step-00000042`` under ``checkpoint_dir``:
- ``rank00003.<what>.npy`` for each rank and each of ``params`` (fp32, the master under mixed
  precision) and every optimizer state array: the rank's shard of every bucket, end to end;
- ``manifest.json``: each parameter's name, shape, dtype and offset in the flat buffer the
  shards were cut from, the shard ranges each rank wrote, world size, ZeRO level, optimizer
  and hyperparameters, step, epoch and position in the epoch, the loss scaler, the resolved
  configuration, and a checksum (crc32) of every file's data.
Every rank writes its files into ``.tmp-step-00000042`` at once; rank 0 writes the manifest last
and renames the directory, so a checkpoint either is complete or does not exist, and
``latest`` names the newest complete one. Resuming maps every element through its parameter's
name and index, so the shards may be cut any other way (another world size, level, bucket size).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 1
MANIFEST, LATEST, STEP_PREFIX, TMP_PREFIX = "manifest.json", "latest", "step-", ".tmp-step-"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model."""


def step_name(step: int) -> str:
    """Return the directory name of the checkpoint after optimizer step ``step``."""
    return f"{STEP_PREFIX}{step:08d}"


def shard_file(directory: Path, rank: int, what: str) -> Path:
    """Return the path of rank ``rank``'s array ``what`` in a checkpoint directory."""
    return directory / f"rank{rank:05d}.{what}.npy"


def save_shard(directory: Path, rank: int, arrays: dict[str, list[np.ndarray]]) -> dict[str, str]:
    """Write this rank's arrays into ``directory`` (created); return {file name: checksum}.

    Each value is a list of 1-D pieces of one dtype, written end to end as one ``.npy`` file
    straight from the pieces (no concatenated copy); the checksum (crc32 of the data, computed
    as it is written) lets a reader find a corrupt or truncated file.
    """
    directory.mkdir(parents=True, exist_ok=True)
    sums = {}
    for what, pieces in arrays.items():
        path = shard_file(directory, rank, what)
        header = {"descr": np.lib.format.dtype_to_descr(pieces[0].dtype), "fortran_order": False,
                  "shape": (sum(int(p.size) for p in pieces),)}
        crc = 0
        with path.open("wb") as stream:
            np.lib.format.write_array_header_1_0(stream, header)
            for piece in pieces:
                data = memoryview(np.ascontiguousarray(piece)).cast("B")
                stream.write(data)
                crc = zlib.crc32(data, crc)
        sums[path.name] = f"crc32:{crc:08x}"
    return sums


def commit(tmp: Path, manifest: dict[str, Any], keep_last: int) -> Path:
    """Write the manifest, make the checkpoint visible, point ``latest`` at it, prune. Rank 0.

    Called once every rank's files are in ``tmp`` (after a barrier). The rename is atomic, so a
    rank killed during the save leaves the previous checkpoint the latest; pruning happens only
    after this one is complete.
    """
    _write_atomically(tmp / MANIFEST, json.dumps(manifest, indent=1))
    final = tmp.parent / step_name(manifest["step"])
    if final.exists():  # saved again at the same step (a resumed run): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _write_atomically(tmp.parent / LATEST, final.name + "\n")
    complete = sorted(p for p in tmp.parent.iterdir() if _is_complete(p))
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(path: str | Path) -> Path:
    """Return the checkpoint ``path`` names: itself, or a checkpoint_dir's latest complete one.

    Raises:
        CheckpointError: nothing complete there.
    """
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} does not exist; expected a checkpoint "
                              f"directory ({STEP_PREFIX}N) or a checkpoint_dir holding some")
    named = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else ""
    if named and _is_complete(path / named):
        return path / named
    complete = sorted(p for p in path.iterdir() if _is_complete(p))
    if not complete:
        raise CheckpointError(
            f"checkpoint: {path} holds no complete checkpoint (a {STEP_PREFIX}N directory with "
            f"a {MANIFEST}); expected one written by a finished save: a save that was cut off "
            f"leaves only {TMP_PREFIX}N, which is never used")
    return complete[-1]


class Reader:
    """Read any element of a checkpoint by parameter name, whatever shards it was cut into.

    Files are memory-mapped and checked against their checksums when first opened, so a
    reader touches only what it is asked for.

    Args:
        path: a checkpoint directory (see ``resolve``).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = resolve(path)
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint: {self.path / MANIFEST} is not readable JSON "
                                  f"({error}); expected the manifest a save wrote") from None
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint: {self.path / MANIFEST} has format "
                                  f"{self.manifest.get('format')!r}; expected {FORMAT}")
        self.params = {p["name"]: p for p in self.manifest["params"]}
        self._files: dict[tuple[int, str], np.ndarray] = {}
        # per parameter: (first element, end, rank, offset in that rank's files), by element
        self._pieces: dict[str, list[tuple[int, int, int, int]]] = {n: [] for n in self.params}
        for rank, ranges in enumerate(self.manifest["shards"]):
            at = 0
            for start, stop in ranges:
                for p in self.params.values():
                    lo, hi = max(start, p["offset"]), min(stop, p["offset"] + p["numel"])
                    if lo < hi:
                        self._pieces[p["name"]].append(
                            (lo - p["offset"], hi - p["offset"], rank, at + lo - start))
                at += stop - start

    def read(self, what: str, name: str, first: int = 0, stop: int | None = None) -> np.ndarray:
        """Return elements ``[first, stop)`` of parameter ``name``'s ``what`` (flat).

        ``what`` is "params" or an optimizer state key ("exp_avg", ...).
        """
        p = self.params[name]
        stop = p["numel"] if stop is None else stop
        out = np.empty(stop - first, np.dtype(p["dtype"]))
        for lo, hi, rank, at in self._pieces[name]:
            a, b = max(lo, first), min(hi, stop)
            if a < b:
                out[a - first : b - first] = self._file(rank, what)[at + a - lo : at + b - lo]
        return out

    def whole(self, what: str, name: str) -> np.ndarray:
        """Return parameter ``name``'s ``what`` in its shape."""
        return self.read(what, name).reshape(self.params[name]["shape"])

    def _file(self, rank: int, what: str) -> np.ndarray:
        key = (rank, what)
        if key not in self._files:
            path = shard_file(self.path, rank, what)
            if not path.is_file():
                raise CheckpointError(f"checkpoint: {path} is missing; expected every rank's "
                                      f"files ({len(self.manifest['shards'])} ranks wrote one "
                                      f"each): copy the whole checkpoint directory")
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as error:
                raise CheckpointError(f"checkpoint: {path} is not a readable .npy file "
                                      f"({error}); it is truncated or corrupt") from None
            want = self.manifest["checksums"].get(path.name)
            if want is not None and _checksum(array) != want:
                raise CheckpointError(f"checkpoint: {path} does not match its checksum; it is "
                                      "corrupt or was changed after the save: use another "
                                      "checkpoint (the previous one is kept, keep_last)")
            self._files[key] = array
        return self._files[key]


def check_same_model(reader: Reader, params: dict[str, tuple[int, ...]]) -> None:
    """Raise CheckpointError unless the checkpoint holds exactly these parameters and shapes."""
    saved = {n: tuple(p["shape"]) for n, p in reader.params.items()}
    if saved == params:
        return
    missing = sorted(set(params) - set(saved))
    extra = sorted(set(saved) - set(params))
    shapes = sorted(f"{n}: saved {saved[n]}, model {params[n]}" for n in set(saved) & set(params)
                    if saved[n] != params[n])
    raise CheckpointError(
        f"checkpoint: {reader.path} holds another model; "
        + "; ".join(part for part in (f"missing from it: {', '.join(missing)}" if missing else "",
                                       f"not in this model: {', '.join(extra)}" if extra else "",
                                       f"shapes differ: {'; '.join(shapes)}" if shapes else "")
                    if part)
        + "; expected the same layers and shapes: build the model the checkpoint was saved from")


def info(path: str | Path) -> str:
    """Return a human-readable summary of a checkpoint."""
    reader = Reader(path)
    m = reader.manifest
    numel = sum(p["numel"] for p in m["params"])
    lines = [f"checkpoint {reader.path}",
             f"  step {m['step']} (epoch {m['epoch'] + 1}, {m['epoch_step']} steps into it)",
             f"  saved by {m['world_size']} ranks at ZeRO level {m['zero_opt_level']}, "
             f"precision {m['precision']}",
             f"  optimizer {m['optimizer']['name']} {m['optimizer']['hyperparameters']}",
             f"  {len(m['params'])} parameters, {numel:,} elements"]
    lines += [f"    {p['name']}  {tuple(p['shape'])}  {p['dtype']}" for p in m["params"]]
    return "\n".join(lines)


def consolidate(path: str | Path, out: str | Path, optimizer: bool = False) -> Path:
    """Write one .npz with one array per parameter (and, asked, per optimizer state array).

    Parameter arrays are named as the model names them (``model.state()``); optimizer state
    ``optimizer/<key>/<parameter>``. Reads one parameter at a time, so it needs memory for the
    largest one, not the model.
    """
    reader = Reader(path)
    whats = ["params"] + (list(reader.manifest["optimizer"]["state"]) if optimizer else [])
    out = Path(out)
    arrays = {}
    for what in whats:
        for name in reader.params:
            key = name if what == "params" else f"optimizer/{what}/{name}"
            arrays[key] = reader.whole(what, name)
    np.savez(out, **arrays)
    return out


def _is_complete(path: Path) -> bool:
    return path.name.startswith(STEP_PREFIX) and (path / MANIFEST).is_file()


def _checksum(array: np.ndarray) -> str:
    """Return the crc32 of an array's data, read in blocks (a memory map stays a map)."""
    crc, flat, step = 0, array.reshape(-1), (1 << 24) // max(array.itemsize, 1)
    for start in range(0, flat.size, step):
        crc = zlib.crc32(memoryview(np.ascontiguousarray(flat[start : start + step])).cast("B"),
                         crc)
    return f"crc32:{crc:08x}"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``info`` or ``consolidate`` from the command line; return the exit code."""
    parser = argparse.ArgumentParser(prog="python -m meta_dist.checkpoint",
                                     description="Inspect or consolidate a meta_dist checkpoint "
                                                 "(plain Python: no mpirun, no MPI).")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("info", help="summarise a checkpoint")
    show.add_argument("path", help="a checkpoint, or a checkpoint_dir (its latest)")
    merge = sub.add_parser("consolidate", help="write one .npz, one array per parameter")
    merge.add_argument("path", help="a checkpoint, or a checkpoint_dir (its latest)")
    merge.add_argument("out", help="the .npz to write")
    merge.add_argument("--optimizer", action="store_true", help="add the optimizer state")
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print(info(args.path))
        else:
            written = consolidate(args.path, args.out, args.optimizer)
            print(f"wrote {written}")
    except CheckpointError as error:
        print(error, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
