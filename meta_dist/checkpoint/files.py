"""A checkpoint's files: their names, checksums, writing them, and finding the newest complete one.

Leaf module: imports numpy, the standard library and meta_dist.errors; reader.py, cli.py and the
package's ``__init__`` (which the trainer uses) import it. The layout is described there.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from meta_dist.errors import UsageError

FORMAT = 1
MANIFEST, LATEST, STEP_PREFIX, TMP_PREFIX = "manifest.json", "latest", "step-", ".tmp-step-"
REPLACED_SUFFIX = ".replaced"  # a checkpoint being replaced by a save of the same step
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


def clear(path: Path) -> None:
    """Remove what is at ``path``, if anything: a save cut off earlier left it (any world size).

    Rank 0 calls it before the ranks write a save's temporary directory, so that the
    checkpoint holds only the files its manifest names, and a file in the way is no error.
    """
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()


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
    replaced = final.with_name(final.name + REPLACED_SUFFIX)
    if final.exists():  # saved again at the same step (a resumed run): replace it
        # aside first, still complete to ``resolve``: a crash between the renames loses nothing
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    tmp.rename(final)
    _write_atomically(tmp.parent / LATEST, final.name + "\n")
    shutil.rmtree(replaced, ignore_errors=True)
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

    A checkpoint's ``manifest.json`` names the checkpoint it is in.

    Raises:
        CheckpointError: nothing complete there, or ``path`` is another file.
    """
    path = Path(path)
    if path.name == MANIFEST and path.is_file():
        path = path.parent
    if (path / MANIFEST).is_file():
        return path
    if path.is_file():
        hint = f"; pass its directory, {path.parent}" if _is_complete(path.parent) else ""
        raise CheckpointError(f"checkpoint: {path} is a file; expected a checkpoint directory "
                              f"({STEP_PREFIX}N) or a checkpoint_dir holding some{hint}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: {path} does not exist; expected a checkpoint "
                              f"directory ({STEP_PREFIX}N) or a checkpoint_dir holding some")
    named = _latest_name(path)
    if named and _is_complete(path / named):
        return path / named
    complete = sorted((p for p in path.iterdir() if _is_complete(p)), key=_save_number)
    if not complete:
        raise CheckpointError(
            f"checkpoint: {path} holds no complete checkpoint (a {STEP_PREFIX}N directory with "
            f"a {MANIFEST}); expected one written by a finished save: a save that was cut off "
            f"leaves only {TMP_PREFIX}N, which is never used")
    return complete[-1]


def _latest_name(directory: Path) -> str:
    """Return the checkpoint ``latest`` names ("" if none, or if it is damaged: not text)."""
    try:
        return (directory / LATEST).read_text().strip() if (directory / LATEST).is_file() else ""
    except UnicodeDecodeError:  # then the newest complete checkpoint is found by its manifest
        return ""


def _is_complete(path: Path) -> bool:
    return path.name.startswith(STEP_PREFIX) and (path / MANIFEST).is_file()


def _checksum(array: np.ndarray, kind: str = Checksum.NAME) -> str:
    """Return an array's checksum (``Checksum``, or crc32 as the first saves wrote).

    Read in blocks, so that a memory map stays a map.
    """
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
