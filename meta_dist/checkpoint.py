"""Checkpoints that any world size and ZeRO level can resume, and plain numpy can read.

Imports numpy and the standard library only (no MPI): ``python -m meta_dist.checkpoint info
PATH`` and ``... consolidate PATH OUT.npz`` run anywhere. The trainer writes and reads through
``save_shard``/``commit``/``Reader``.

A checkpoint is a directory ``step-00000042`` under ``checkpoint_dir``:
- ``rank00003.<what>.npy`` for each rank and each of ``params`` (fp32, the master under mixed
  precision) and every optimizer state array: the rank's shard of every bucket, end to end;
- ``buffers.npz`` (rank 0's, when the model has any): BatchNorm's running statistics, one
  array per buffer named like the parameters;
- ``manifest.json``: each parameter's name, shape, dtype and offset in the flat buffer the
  shards were cut from, the shard ranges each rank wrote, world size, ZeRO level, optimizer
  and hyperparameters, step, epoch and position in the epoch, the loss scaler, the resolved
  configuration, and a checksum of every file's data (``Checksum``).
Every rank writes its files into ``.tmp-step-00000042`` at once; rank 0 writes the manifest last
and renames the directory, so a checkpoint either is complete or does not exist, and
``latest`` names the newest complete one (the last saved, which after a resume from an older
one is not the highest step). ``keep_last`` prunes the oldest saves, never the newest. Resuming maps every element through its parameter's
name and index, so the shards may be cut any other way (another world size, level, bucket size).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from meta_dist.errors import UsageError

FORMAT = 1
MANIFEST, LATEST, STEP_PREFIX, TMP_PREFIX = "manifest.json", "latest", "step-", ".tmp-step-"
BUFFERS = "buffers.npz"


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt, or of another model."""


def step_name(step: int) -> str:
    """Return the directory name of the checkpoint after optimizer step ``step``."""
    return f"{STEP_PREFIX}{step:08d}"


def shard_file(directory: Path, rank: int, what: str) -> Path:
    """Return the path of rank ``rank``'s array ``what`` in a checkpoint directory."""
    return directory / f"rank{rank:05d}.{what}.npy"


class Checksum:
    """A checksum of a byte stream fed in pieces, at numpy's summing speed.

    The stream is cut into blocks of BLOCK bytes; each block's little-endian 64-bit words are
    summed (wrapping; the last block padded with zeros), and crc32 folds the block sums and
    the length, so a changed word, a lost or reordered block and a truncation all show. crc32
    over the data itself runs slower than numpy's sum, which runs at memory speed, and cost as
    much as the write (`bench checkpoint`); this is not a defence against deliberate changes,
    only against damage.
    """

    BLOCK = 1 << 20
    NAME = "bsum64"

    def __init__(self) -> None:
        self._sums: list[np.ndarray] = []
        self._partial = bytearray()
        self._length = 0

    def update(self, data: Any) -> None:
        """Add the bytes of ``data`` (a contiguous array or a bytes-like object)."""
        flat = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        self._length += flat.size
        if self._partial:
            take = min(self.BLOCK - len(self._partial), flat.size)
            self._partial += flat[:take].tobytes()
            flat = flat[take:]
            if len(self._partial) == self.BLOCK:
                self._sums.append(_block_sums(np.frombuffer(self._partial, np.uint8)))
                self._partial = bytearray()
        whole = flat.size - flat.size % self.BLOCK
        if whole:
            self._sums.append(_block_sums(flat[:whole]))
        self._partial += flat[whole:].tobytes()

    def hexdigest(self) -> str:
        """Return the checksum as written in a manifest: ``bsum64:<8 hex digits>``."""
        tail = [_block_sums(np.frombuffer(bytes(self._partial), np.uint8))] if self._partial else []
        crc = zlib.crc32(np.uint64(self._length).tobytes())
        for sums in self._sums + tail:
            crc = zlib.crc32(sums.astype("<u8").tobytes(), crc)
        return f"{self.NAME}:{crc:08x}"


def _block_sums(data: np.ndarray) -> np.ndarray:
    """Return the wrapping sum of each BLOCK-byte block's 64-bit words (uint8 ``data``)."""
    pad = -data.size % Checksum.BLOCK
    if pad:
        data = np.concatenate([data, np.zeros(pad, np.uint8)])
    return data.view("<u8").reshape(-1, Checksum.BLOCK // 8).sum(axis=1, dtype=np.uint64)


def save_shard(directory: Path, rank: int, arrays: dict[str, list[np.ndarray]]) -> dict[str, str]:
    """Write this rank's arrays into ``directory`` (created); return {file name: checksum}.

    Each value is a list of 1-D pieces of one dtype, written end to end as one ``.npy`` file
    straight from the pieces (no concatenated copy); the checksum (``Checksum``, computed as
    it is written) lets a reader find a corrupt or truncated file.
    """
    directory.mkdir(parents=True, exist_ok=True)
    sums = {}
    for what, pieces in arrays.items():
        path = shard_file(directory, rank, what)
        header = {"descr": np.lib.format.dtype_to_descr(pieces[0].dtype), "fortran_order": False,
                  "shape": (sum(int(p.size) for p in pieces),)}
        checksum = Checksum()
        with path.open("wb") as stream:
            np.lib.format.write_array_header_1_0(stream, header)
            for piece in pieces:
                data = np.ascontiguousarray(piece)
                stream.write(memoryview(data).cast("B"))
                checksum.update(data)
        sums[path.name] = checksum.hexdigest()
    return sums


def save_buffers(directory: Path, buffers: dict[str, np.ndarray]) -> dict[str, str]:
    """Write the model's buffers (BatchNorm's running statistics) as ``buffers.npz``.

    Returns {"buffers.npz/<name>": checksum}. One rank (the root) calls it.
    """
    directory.mkdir(parents=True, exist_ok=True)
    np.savez(directory / BUFFERS, **buffers)
    return {f"{BUFFERS}/{name}": _checksum(np.ascontiguousarray(a))
            for name, a in buffers.items()}


def commit(tmp: Path, manifest: dict[str, Any], keep_last: int) -> Path:
    """Write the manifest, make the checkpoint visible, point ``latest`` at it, prune. Rank 0.

    Called once every rank's files are in ``tmp`` (after a barrier). The rename is atomic, so a
    rank killed during the save leaves the previous checkpoint the latest; pruning happens only
    after this one is complete, by the order of the saves (a run resumed from an older
    checkpoint saves lower step numbers than the ones it left behind: those go first), and
    never removes the new one. Temporary directories of saves that were cut off are removed.
    """
    manifest = {**manifest, "saved": _next_save_number(tmp.parent)}
    _write_atomically(tmp / MANIFEST, json.dumps(manifest, indent=1))
    final = tmp.parent / step_name(manifest["step"])
    if final.exists():  # saved again at the same step (a resumed run): replace it
        shutil.rmtree(final)
    tmp.rename(final)
    _write_atomically(tmp.parent / LATEST, final.name + "\n")
    complete = sorted((p for p in tmp.parent.iterdir() if _is_complete(p)), key=_save_number)
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in tmp.parent.glob(f"{TMP_PREFIX}*"):  # every rank has finished this save
        shutil.rmtree(stale, ignore_errors=True)
    return final


def _save_number(path: Path) -> tuple[int, str]:
    """Order of a complete checkpoint's save (older formats: by name, before any newer)."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("saved", -1), path.name
    except (OSError, ValueError):
        return -1, path.name


def _next_save_number(directory: Path) -> int:
    return 1 + max((_save_number(p)[0] for p in directory.iterdir() if _is_complete(p)),
                   default=0)


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
    complete = sorted((p for p in path.iterdir() if _is_complete(p)), key=_save_number)
    if not complete:
        raise CheckpointError(
            f"checkpoint: {path} holds no complete checkpoint (a {STEP_PREFIX}N directory with "
            f"a {MANIFEST}); expected one written by a finished save: a save that was cut off "
            f"leaves only {TMP_PREFIX}N, which is never used")
    return complete[-1]


class Reader:
    """Read any element of a checkpoint by parameter name, whatever shards it was cut into.

    Files are memory-mapped, so a reader touches only what it is asked for, and (``verify``)
    checked against their checksums when first opened.

    Args:
        path: a checkpoint directory (see ``resolve``).
        verify: check each file's checksum when first opened; without it, ``check`` does
            (the trainer shares the files out among its ranks: each is read once).
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.path, self.verify = resolve(path), verify
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
        self._checked: set[tuple[int, str]] = set()
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

    def files(self) -> list[tuple[int, str]]:
        """Return every (rank, what) the checkpoint holds a file for."""
        whats = ["params", *self.manifest["optimizer"]["state"]]
        return [(rank, what) for what in whats for rank in range(len(self.manifest["shards"]))]

    def check(self, rank: int, what: str) -> None:
        """Open rank ``rank``'s file ``what`` and compare it with its checksum now.

        Raises:
            CheckpointError: the file is missing, unreadable or does not match its checksum.
        """
        array = self.open(rank, what)
        path = shard_file(self.path, rank, what)
        want = self.manifest["checksums"].get(path.name)
        if want is not None and _checksum(array, want.split(":")[0]) != want:
            raise CheckpointError(f"checkpoint: {path} does not match its checksum; it is "
                                  "corrupt or was changed after the save: use another "
                                  "checkpoint (the previous one is kept, keep_last)")
        self._checked.add((rank, what))

    def buffers(self) -> dict[str, np.ndarray]:
        """Return the saved buffers ({name: array}; empty for a model without any), checked."""
        if not self.manifest.get("buffers"):
            return {}
        path = self.path / BUFFERS
        try:
            with np.load(path, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files}
        except (ValueError, OSError, KeyError) as error:
            raise CheckpointError(f"checkpoint: {path} is not a readable .npz file ({error}); "
                                  "it is truncated or corrupt") from None
        for name, a in arrays.items():
            want = self.manifest["checksums"].get(f"{BUFFERS}/{name}")
            if want is not None and _checksum(a, want.split(":")[0]) != want:
                raise CheckpointError(f"checkpoint: {path} ({name}) does not match its "
                                      "checksum; it is corrupt or was changed after the save")
        return arrays

    def open(self, rank: int, what: str) -> np.ndarray:
        """Memory-map rank ``rank``'s file ``what`` (its header read; no checksum).

        Raises:
            CheckpointError: the file is missing or not a readable .npy file.
        """
        key = (rank, what)
        if key not in self._files:
            path = shard_file(self.path, rank, what)
            if not path.is_file():
                raise CheckpointError(f"checkpoint: {path} is missing; expected every rank's "
                                      f"files ({len(self.manifest['shards'])} ranks wrote one "
                                      f"each): copy the whole checkpoint directory")
            try:
                self._files[key] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as error:
                if "Python objects" in str(error) or "Object arrays" in str(error):
                    raise CheckpointError(
                        f"checkpoint: {path} holds Python objects (a pickle), which no save "
                        "writes and meta_dist never loads (unpickling could run code); use a "
                        "checkpoint meta_dist wrote") from None
                raise CheckpointError(f"checkpoint: {path} is not a readable .npy file "
                                      f"({error}); it is truncated or corrupt") from None
        return self._files[key]

    def _file(self, rank: int, what: str) -> np.ndarray:
        if self.verify and (rank, what) not in self._checked:
            self.check(rank, what)
        return self.open(rank, what)


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
    ``optimizer/<key>/<parameter>``. The .npz (np.savez's layout: one stored ``.npy`` member per
    array) is written one parameter at a time, so it needs memory for the largest one, not the
    model.
    """
    reader = Reader(path)
    whats = ["params"] + (list(reader.manifest["optimizer"]["state"]) if optimizer else [])
    out = Path(out)
    with zipfile.ZipFile(out, "w", allowZip64=True) as archive:
        for what in whats:
            for name in reader.params:
                key = name if what == "params" else f"optimizer/{what}/{name}"
                with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, reader.whole(what, name),
                                              allow_pickle=False)
    return out


def _is_complete(path: Path) -> bool:
    return path.name.startswith(STEP_PREFIX) and (path / MANIFEST).is_file()


def _checksum(array: np.ndarray, kind: str = Checksum.NAME) -> str:
    """Return an array's checksum (``Checksum``, or crc32 as the first saves wrote), read in
    blocks so that a memory map stays a map."""
    flat, step = array.reshape(-1), (1 << 24) // max(array.itemsize, 1)
    checksum, crc = Checksum(), 0
    for start in range(0, flat.size, step):
        block = np.ascontiguousarray(flat[start : start + step])
        if kind == "crc32":
            crc = zlib.crc32(memoryview(block).cast("B"), crc)
        else:
            checksum.update(block)
    return f"crc32:{crc:08x}" if kind == "crc32" else checksum.hexdigest()


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
