"""Datasets and the per-rank sampler.

Imports numpy only. Data stays on the host; the trainer moves each batch to the device.
"""

from __future__ import annotations

import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from meta_dist.errors import UsageError


def synthetic_classification(num_samples: int, input_shape: tuple[int, ...], num_classes: int,
                             seed: int, dtype: str = "float32",
                             teacher: Callable[[np.ndarray], np.ndarray] | None = None,
                             ) -> tuple[np.ndarray, np.ndarray]:
    """Return random inputs labelled by a fixed reference model, so the task is learnable.

    Args:
        num_samples: how many samples.
        input_shape: the shape of one sample.
        num_classes: the number of labels.
        seed: the same seed gives the same data on every rank.
        dtype: the inputs' dtype.
        teacher: the reference model, mapping a batch of inputs (numpy) to class scores;
            by default a fixed random linear map of the flattened input.
    """
    rng = np.random.default_rng([seed, 1])
    x = rng.standard_normal((num_samples, *input_shape)).astype(dtype)
    if teacher is None:
        weights = rng.standard_normal((int(np.prod(input_shape)), num_classes))
        scores = x.reshape(num_samples, -1) @ weights
    else:
        scores = np.asarray(teacher(x), np.float64)
    # centre and scale each class's score over the data set, so no class takes every sample
    scores = (scores - scores.mean(axis=0)) / (scores.std(axis=0) + 1e-12)
    return x, np.argmax(scores, axis=1).astype(np.int64)


SAVE_HINT = "write it with np.savez(path, x=inputs.astype(np.float32), y=labels)"


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Load inputs ``x`` and integer labels ``y`` from an .npz file.

    Nothing in a data file is ever executed: arrays of Python objects (pickles) are refused.

    Raises:
        UsageError: the file is missing or not an .npz (a .npy, text, a damaged archive), lacks
            ``x`` or ``y``, holds Python objects, its lengths differ, or x holds NaN or inf;
            the message names the file.
    """
    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file (looked in {Path.cwd()}); expected an .npz "
                         f"archive with arrays x and y: {SAVE_HINT}")
    with Path(path).open("rb") as file:
        head = file.read(16)
    if not head.startswith((b"PK", b"\x93NUMPY")):  # numpy would take it for a pickle
        raise UsageError(f"{path}: not a readable .npz file (it starts with {head!r}: neither "
                         "a zip archive, as .npz files are, nor a .npy file); expected an .npz "
                         f"archive with arrays x and y: {SAVE_HINT}")
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # a damaged archive
        raise UsageError(f"{path}: not a readable .npz file ({error}); expected an .npz "
                         f"archive with arrays x and y: {SAVE_HINT}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise UsageError(f"{path}: holds one array (a .npy file); expected an .npz archive "
                         f"with arrays x (inputs) and y (labels): {SAVE_HINT}")
    with data:
        missing = [k for k in ("x", "y") if k not in data.files]
        if missing:
            raise UsageError(f"{path}: missing array(s) {missing}; got {data.files}, expected "
                             "arrays named 'x' (inputs) and 'y' (integer labels)")
        try:
            x, y = data["x"], data["y"]
        except ValueError as error:  # object arrays: unpickling could run code
            raise UsageError(f"{path}: an array holds Python objects ({error}); data files are "
                             f"read without unpickling, which could run code: {SAVE_HINT}"
                             ) from None
    if len(x) != len(y) or y.ndim != 1 or y.dtype.kind not in "iu":
        raise UsageError(f"{path}: x has {len(x)} samples and y has shape {y.shape}, dtype "
                         f"{y.dtype}; expected y of shape ({len(x)},) with integer labels")
    if x.dtype.kind in "fc" and not np.isfinite(x).all():  # training would stop at its loss
        bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
        raise UsageError(f"{path}: x holds NaN or inf in {int(bad.sum())} of {len(x)} samples "
                         f"(the first: sample {int(np.argmax(bad))}); expected finite inputs; "
                         "drop or repair those samples")
    return x, y.astype(np.int64)


def check_samples(x: np.ndarray, y: np.ndarray, input_shape: tuple[int, ...], num_classes: int,
                  batch_size: int, source: str) -> None:
    """Raise UsageError unless (x, y) fit a model of ``input_shape`` and ``num_classes``.

    ``source`` names where the data came from (a file); the message names the config key that
    must change (``input_shape``, ``num_classes``, ``batch_size``) and its value.

    Raises:
        UsageError: samples of another shape, a label outside [0, num_classes), or fewer samples
            than one global batch.
    """
    if tuple(x.shape[1:]) != tuple(input_shape):
        raise UsageError(
            f"{source}: samples of shape {tuple(x.shape[1:])}; the model takes "
            f"train_config.input_shape {list(input_shape)}; set input_shape: "
            f"{list(x.shape[1:])} (in the config or as input_shape=...) or reshape the data")
    if len(y) and (y.min() < 0 or y.max() >= num_classes):
        bad = int(y.max()) if y.max() >= num_classes else int(y.min())
        raise UsageError(
            f"{source}: label {bad} is outside 0..{num_classes - 1} (train_config.num_classes "
            f"{num_classes}); set num_classes: {max(int(y.max()) + 1, 2)} or fix the labels")
    if len(x) < batch_size:
        raise UsageError(
            f"{source}: {len(x)} samples, fewer than one global batch (train_config.batch_size "
            f"{batch_size}); set batch_size to at most {len(x)} (a multiple of the ranks) or "
            "give more samples")


def check_same_data(x: np.ndarray, y: np.ndarray,
                    allgather: Callable[[object], list]) -> None:
    """Raise UsageError on every rank unless every rank holds the same dataset. Collective.

    Each rank takes its part of every global batch from the whole dataset by index
    (``DistributedSampler``): data that differs between ranks (a file another node holds in
    another version) trains on batches nobody meant, without a word. Compared: the samples'
    count, shape and dtype, and a CRC-32 of at most 1,024 evenly spaced samples and their
    labels (cheap at any size: train_gpt's labels are windows, 90 MB made whole).

    Args:
        x: this rank's samples (a host array).
        y: this rank's labels (a host array).
        allgather: returns the list of every rank's object (``MPIConnector.allgather``).
    """
    step = max(1, len(x) // 1024)
    crc = zlib.crc32(np.ascontiguousarray(x[::step]).tobytes())
    crc = zlib.crc32(np.ascontiguousarray(y[::step]).tobytes(), crc)
    every = allgather((len(x), tuple(x.shape[1:]), str(x.dtype), len(y), str(y.dtype), crc))
    if len(set(every)) > 1:
        listing = "; ".join(f"rank {r}: {n} samples of shape {shape} {dtype}, checksum {c:08x}"
                            for r, (n, shape, dtype, _, _, c) in enumerate(every))
        raise UsageError(
            f"fit: the ranks hold different data ({listing}); expected the same dataset on "
            "every rank (each takes its part of every batch by index): give every node the "
            "same data file")


DIGITS = Path(__file__).with_name("digits.csv.gz")


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Return the handwritten digits: x (1797, 1, 8, 8) float32 in [0, 1], y (1797,) labels.

    The UCI "Optical Recognition of Handwritten Digits" test set (E. Alpaydin, C. Kaynak, 1998;
    CC BY 4.0): 8x8 counts of on-pixels (0-16) of 32x32 bitmaps, 43 writers. The file is the
    copy scikit-learn 1.9.1 ships (sklearn/datasets/data/digits.csv.gz: 64 pixel columns, then
    the label), kept here so that nothing is downloaded at run time.
    """
    table = np.loadtxt(DIGITS, delimiter=",", dtype=np.float32)
    return (table[:, :64] / 16).reshape(-1, 1, 8, 8), table[:, 64].astype(np.int64)


def held_out(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices into (train, held out): a seeded shuffle, the last part held out."""
    order = np.random.default_rng([seed, 1]).permutation(num_samples)
    cut = num_samples - int(round(num_samples * fraction))
    return np.sort(order[:cut]), np.sort(order[cut:])


# Modules of the standard library whose sources make the character corpus: plain prose and
# code that every Python installation ships (never downloaded), in a fixed order.
CORPUS_MODULES = ("textwrap", "string", "heapq", "bisect", "fractions", "statistics", "difflib",
                  "pprint", "calendar", "argparse", "random", "shlex", "glob", "fnmatch")


def char_corpus(max_chars: int = 400_000, modules: tuple[str, ...] = CORPUS_MODULES,
                ) -> tuple[np.ndarray, str]:
    """Return the standard library's sources as character ids, and the vocabulary.

    The sources of ``modules`` (this Python's own), joined in order and cut at ``max_chars``;
    characters outside printable ASCII become ``?``. The vocabulary is the sorted set of the
    characters left, so ``vocab[id]`` decodes. Which Python runs decides the exact text.

    Raises:
        ValueError: a module has no Python source here.
    """
    import importlib.util

    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise ValueError(f"char_corpus: module {name!r} has no Python source here; got "
                             f"{spec.origin if spec else None!r}, expected a .py file")
        parts.append(Path(spec.origin).read_text(encoding="utf-8", errors="replace"))
    codes = np.frombuffer("".join(parts)[:max_chars].encode("ascii", "replace"), np.uint8).copy()
    codes[((codes < 32) & (codes != 10)) | (codes > 126)] = ord("?")  # tabs, CR, DEL too
    present = np.unique(codes)
    lookup = np.zeros(128, np.int64)
    lookup[present] = np.arange(len(present))
    return lookup[codes], present.tobytes().decode("ascii")


def windows(ids: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``ids`` into next-token pairs: inputs ``ids[i:i+T]`` and targets one step on.

    Windows start every ``block_size // 2`` tokens (overlapping by half), so a model sees each
    position at two offsets; views of ``ids``, not copies.
    """
    stride = max(1, block_size // 2)
    view = np.lib.stride_tricks.sliding_window_view(ids, block_size + 1)[::stride]
    return view[:, :-1], view[:, 1:]


class DistributedSampler:
    """Split each global batch across ranks (PyTorch DistributedSampler semantics).

    Every epoch draws one permutation from (seed, epoch), the same on every rank; global batch s
    is ``perm[s*B:(s+1)*B]`` and rank r takes its r-th part of b = B/size samples, so the ranks'
    parts are disjoint and their union is the global batch. The incomplete last batch is
    dropped, so every rank runs the same number of steps (an uneven last batch would leave
    ranks waiting in a collective).

    Args:
        num_samples: dataset length.
        batch_size: the global batch B (must divide by size).
        rank: this rank.
        size: number of data-parallel ranks.
        seed: shared seed for the permutation.
        shuffle: permute every epoch; otherwise take samples in order.
        max_steps: stop each epoch after this many steps (None: as many as fit).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, size: int, seed: int = 0,
                 shuffle: bool = True, max_steps: int | None = None) -> None:
        if batch_size % size:
            raise ValueError(f"DistributedSampler: batch_size {batch_size} does not split over "
                             f"{size} ranks; expected a multiple of {size}")
        if num_samples < batch_size:
            raise ValueError(f"DistributedSampler: the dataset has {num_samples} samples, fewer "
                             f"than one global batch of {batch_size}; use a smaller batch_size")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.size, self.seed, self.shuffle = rank, size, seed, shuffle
        full = num_samples // batch_size
        self.steps_per_epoch = full if max_steps is None else min(full, max_steps)

    @property
    def local_batch_size(self) -> int:
        """Samples per step on this rank."""
        return self.batch_size // self.size

    def epoch(self, epoch: int) -> Iterator[np.ndarray]:
        """Yield this rank's sample indices for each step of ``epoch``."""
        order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                 if self.shuffle else np.arange(self.num_samples))
        b = self.local_batch_size
        for step in range(self.steps_per_epoch):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            yield batch[self.rank * b : (self.rank + 1) * b]
