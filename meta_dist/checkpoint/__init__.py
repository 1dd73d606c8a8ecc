"""Checkpoints that any world size and ZeRO level can resume, and plain numpy can read.

Leaf package: imports numpy, the standard library and meta_dist.errors only (no MPI), so
``python -m meta_dist.checkpoint info PATH`` and ``... consolidate PATH OUT.npz`` run anywhere.
The trainer (``train.checkpointing``) writes and reads through ``save_shard``, ``commit`` and
``Reader``, and holds ``checkpoint_dir`` with ``hold``. files.py names, checksums, writes and
finds checkpoints; reader.py reads them by parameter name; lock.py keeps a second job out of a
checkpoint_dir; cli.py is the command line (``__main__.py`` runs it).

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
one is not the highest step). ``keep_last`` prunes the oldest saves, never the newest.
Resuming maps every element through its parameter's name and index, so the shards may be cut
any other way (another world size, level, bucket size). While a job trains, its rank 0 holds
``.lock`` in ``checkpoint_dir`` (flock): a second job there is refused at its start.
"""

from meta_dist.checkpoint.cli import consolidate, info
from meta_dist.checkpoint.files import (
    BUFFERS,
    FORMAT,
    LATEST,
    MANIFEST,
    STEP_PREFIX,
    TMP_PREFIX,
    CheckpointError,
    Checksum,
    clear,
    commit,
    resolve,
    save_buffers,
    save_shard,
    shard_file,
    step_name,
)
from meta_dist.checkpoint.lock import LOCK, DirectoryInUse, hold
from meta_dist.checkpoint.reader import Reader, check_same_model

__all__ = [
    "BUFFERS",
    "FORMAT",
    "LATEST",
    "LOCK",
    "MANIFEST",
    "STEP_PREFIX",
    "TMP_PREFIX",
    "CheckpointError",
    "Checksum",
    "DirectoryInUse",
    "Reader",
    "check_same_model",
    "clear",
    "commit",
    "consolidate",
    "hold",
    "info",
    "resolve",
    "save_buffers",
    "save_shard",
    "shard_file",
    "step_name",
]
