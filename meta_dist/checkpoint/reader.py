"""Reading a checkpoint by parameter name, whatever shards it was cut into; checking its model.

Imports numpy and files.py; cli.py and the package's ``__init__`` (which the trainer uses)
import it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from meta_dist.checkpoint.files import (
    BUFFERS,
    FORMAT,
    MANIFEST,
    CheckpointError,
    _checksum,
    resolve,
    shard_file,
)


class Reader:
    """Read any element of a checkpoint by parameter name, whatever shards it was cut into.

    Files are memory-mapped, so a reader touches only what it is asked for, and (``verify``)
    checked against their checksums when first opened.

    Args:
        path: a checkpoint directory (see ``resolve``).
        verify: check each file's checksum when first opened; without it, ``check`` does
            (the trainer shares the files out among its ranks: each is read once).

    Raises:
        CheckpointError: no checkpoint there, or its manifest is not a meta_dist manifest or
            its shards leave some element of a parameter out.
    """

    def __init__(self, path: str | Path, verify: bool = True) -> None:
        self.path, self.verify = resolve(path), verify
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"checkpoint: {self.path / MANIFEST} is not readable JSON "
                                  f"({error}); expected the manifest a save wrote") from None
        _check_manifest(self.path, self.manifest)
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
        for name, pieces in self._pieces.items():
            _check_covered(self.path, name, self.params[name]["numel"], pieces)

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
        """Return parameter ``name``'s ``what`` in its shape.

        Raises:
            CheckpointError: the manifest's shape of ``name`` does not hold its ``numel``.
        """
        p = self.params[name]
        if math.prod(p["shape"]) != p["numel"]:  # checked here: the trainer compares shapes
            raise CheckpointError(f"checkpoint: {self.path / MANIFEST} gives {name} shape "
                                  f"{tuple(p['shape'])} and {p['numel']} elements; expected "
                                  "as many elements as the shape holds: it was edited or "
                                  "damaged, use another checkpoint")
        return self.read(what, name).reshape(p["shape"])

    def files(self) -> list[tuple[int, str]]:
        """Return every (rank, what) the checkpoint holds a file for."""
        whats = ["params", *self.manifest["optimizer"]["state"]]
        return [(rank, what) for what in whats for rank in range(len(self.manifest["shards"]))]

    def check_files(self) -> None:
        """Check that every rank's file is there and whole: its header read, its length counted.

        No checksum (that reads every byte: ``check``); a file cut short, or one of another
        length, is found from its header and size alone against the manifest's shard ranges.

        Raises:
            CheckpointError: a file is missing, unreadable, or not the length the manifest gives.
        """
        for rank, what in self.files():
            array = self.open(rank, what)
            want = sum(stop - start for start, stop in self.manifest["shards"][rank])
            if array.size != want:
                path = shard_file(self.path, rank, what)
                raise CheckpointError(
                    f"checkpoint: {path} holds {array.size} elements; expected {want} (rank "
                    f"{rank}'s shards in {MANIFEST}): it was cut or replaced after the save: "
                    "use another checkpoint")

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
        """Return the saved buffers ({name: array}; empty for a model without any), checked.

        Raises:
            CheckpointError: buffers.npz is unreadable, lacks a buffer the manifest lists, or
                does not match its checksums.
        """
        if not self.manifest.get("buffers"):
            return {}
        path = self.path / BUFFERS
        try:
            saved = np.load(path, allow_pickle=False)
            if not isinstance(saved, np.lib.npyio.NpzFile):  # an .npy file loads as an array
                raise ValueError("a single .npy array, not a zip archive")
            with saved:
                arrays = {name: saved[name] for name in saved.files}
        except (ValueError, OSError, KeyError) as error:
            raise CheckpointError(f"checkpoint: {path} is not a readable .npz file ({error}); "
                                  "it is truncated or corrupt") from None
        listed = [b.get("name") for b in self.manifest["buffers"] if isinstance(b, dict)]
        missing = [str(name) for name in listed if name not in arrays]
        if missing:
            raise CheckpointError(f"checkpoint: {path} lacks {', '.join(missing)}, which "
                                  f"{MANIFEST} lists; it was cut or replaced after the save: "
                                  "use another checkpoint")
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
            self._files[key] = _map_npy(path)
        return self._files[key]

    def _file(self, rank: int, what: str) -> np.ndarray:
        if self.verify and (rank, what) not in self._checked:
            self.check(rank, what)
        return self.open(rank, what)


def _map_npy(path: Path) -> np.ndarray:
    """Memory-map the .npy file ``path``.

    Raises:
        CheckpointError: it is not a readable .npy file (truncated, a zip archive, a pickle).
    """
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        if not isinstance(array, np.ndarray):  # a zip (.npz) loads as an NpzFile
            array.close()
            raise ValueError("a zip archive, as an .npz file is")
    except (ValueError, OSError) as error:
        if "Python objects" in str(error) or "Object arrays" in str(error):
            raise CheckpointError(
                f"checkpoint: {path} holds Python objects (a pickle), which no save writes and "
                "meta_dist never loads (unpickling could run code); use a checkpoint meta_dist "
                "wrote") from None
        raise CheckpointError(f"checkpoint: {path} is not a readable .npy file ({error}); it "
                              "is truncated or corrupt") from None
    return array


def _check_manifest(path: Path, manifest: object) -> None:
    """Raise CheckpointError unless ``manifest`` is a meta_dist manifest a Reader can use."""
    def wrong(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint: {path} is not a meta_dist checkpoint ({MANIFEST} "
                               f"{what}); expected the manifest a save wrote")

    if not isinstance(manifest, dict):
        raise wrong(f"holds a JSON {_json_kind(manifest)}, not an object")
    if "format" not in manifest:
        raise wrong("has no 'format'")
    if manifest["format"] != FORMAT:
        raise CheckpointError(f"checkpoint: {path / MANIFEST} has format "
                              f"{manifest['format']!r}; expected {FORMAT}")
    for key, kind in (("params", list), ("shards", list), ("optimizer", dict),
                      ("checksums", dict)):
        if key not in manifest:
            raise wrong(f"has no '{key}'")
        if not isinstance(manifest[key], kind):
            raise wrong(f"'{key}' is a JSON {_json_kind(manifest[key])}, not "
                        + ("a list" if kind is list else "an object"))
    if not isinstance(manifest["optimizer"].get("state"), list):
        raise wrong("'optimizer' has no list 'state'")
    fields = {"name": str, "shape": list, "dtype": str, "offset": int, "numel": int}
    for i, param in enumerate(manifest["params"]):
        if not isinstance(param, dict) or not all(isinstance(param.get(k), t)
                                                  for k, t in fields.items()):
            raise wrong(f"params[{i}] is {json.dumps(param)[:80]}, not an object with "
                        + ", ".join(f"'{k}'" for k in fields))
        if not all(isinstance(n, int) for n in param["shape"]):
            raise wrong(f"params[{i}] ({param['name']}) has shape {param['shape']}, not a list "
                        "of integers")
    for rank, ranges in enumerate(manifest["shards"]):
        if not isinstance(ranges, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(isinstance(i, int) for i in r)
                for r in ranges):
            raise wrong(f"shards[{rank}] is {json.dumps(ranges)[:80]}, not a list of "
                        "[start, stop] ranges")


def _json_kind(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def _check_covered(path: Path, name: str, numel: int,
                   pieces: list[tuple[int, int, int, int]]) -> None:
    """Raise CheckpointError unless ``pieces`` hold every element of parameter ``name``."""
    covered = 0
    for lo, hi, _, _ in sorted(pieces):
        if lo > covered:
            break
        covered = max(covered, hi)
    if covered < numel:
        gap = min((lo for lo, _, _, _ in pieces if lo > covered), default=numel)
        raise CheckpointError(
            f"checkpoint: {path} holds no rank's shard of elements [{covered}, {gap}) of "
            f"parameter {name} ({numel} elements); expected the shards in {MANIFEST} to cover "
            "every element: it was edited or damaged, use another checkpoint")


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
