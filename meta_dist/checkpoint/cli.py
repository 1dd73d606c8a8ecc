"""The command line: ``python -m meta_dist.checkpoint info|consolidate`` and what it runs.

Imports numpy, files.py and reader.py (no MPI: it runs anywhere, without mpirun);
``__main__.py`` and the package's ``__init__`` import it.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np

from meta_dist.checkpoint.files import LATEST, MANIFEST, STEP_PREFIX, TMP_PREFIX, CheckpointError
from meta_dist.checkpoint.reader import Reader
from meta_dist.errors import USAGE_EXIT, UsageError


def info(path: str | Path) -> str:
    """Return a human-readable summary of a checkpoint, once its files are found whole.

    Every file the manifest names is opened and its length compared (``Reader.check_files``;
    the buffers, small, checksummed too), so that a checkpoint that resume would refuse is not
    reported as fine; the shards' checksums are not read (that reads every byte).

    Raises:
        CheckpointError: no checkpoint there, its manifest is not a meta_dist manifest, or a
            file it names is missing, cut short or damaged.
    """
    reader = Reader(path)
    reader.check_files()
    reader.buffers()  # small: read whole, every listed buffer there, checksummed
    m = reader.manifest
    numel = sum(p["numel"] for p in m["params"])
    try:
        lines = [f"checkpoint {reader.path}",
                 f"  step {m['step']} (epoch {m['epoch'] + 1}, {m['epoch_step']} steps into it)",
                 f"  saved by {m['world_size']} ranks at ZeRO level {m['zero_opt_level']}, "
                 f"precision {m['precision']}",
                 f"  optimizer {m['optimizer']['name']} {m['optimizer']['hyperparameters']}",
                 f"  {len(m['params'])} parameters, {numel:,} elements"]
        lines += [f"    {p['name']}  {tuple(p['shape'])}  {p['dtype']}" for p in m["params"]]
        if m.get("buffers"):  # BatchNorm's running statistics, as the root rank had them
            lines.append(f"  {len(m['buffers'])} buffers (not trained)")
            lines += [f"    {b['name']}  {tuple(b['shape'])}  {b['dtype']}" for b in m["buffers"]]
    except KeyError as error:
        raise CheckpointError(f"checkpoint: {reader.path} is not a meta_dist checkpoint "
                              f"({MANIFEST} has no {error}); expected the manifest a save "
                              "wrote") from None
    return "\n".join(lines)


def consolidate(path: str | Path, out: str | Path, optimizer: bool = False) -> Path:
    """Write one .npz with one array per parameter and buffer (and, asked, optimizer state).

    Parameter arrays are named as the model names them (``model.state()``), buffers
    (BatchNorm's running statistics, which evaluation needs) as the checkpoint names them,
    optimizer state ``optimizer/<key>/<parameter>``. The .npz (np.savez's layout: one stored
    ``.npy`` member per array) is written one parameter at a time, so it needs memory for the
    largest one, not the model. It is written beside ``out`` and renamed over it once complete,
    so a consolidation that fails leaves ``out`` as it was.

    Raises:
        CheckpointError: the checkpoint cannot be read (missing, corrupt, not meta_dist's).
        UsageError: ``out`` cannot be written (a directory, in no existing directory), or is
            inside a checkpoint or is ``latest`` (it would be destroyed).
    """
    reader = Reader(path)
    whats = ["params"] + (list(reader.manifest["optimizer"]["state"]) if optimizer else [])
    out = Path(out)
    target = out.resolve() if out.is_symlink() else out  # replace the file, not the link
    _check_outside_checkpoints(out, reader.path)
    stream = _open_beside(target)
    tmp = Path(stream.name)
    try:
        with stream, zipfile.ZipFile(stream, "w", allowZip64=True) as archive:
            for what in whats:
                for name in reader.params:
                    key = name if what == "params" else f"optimizer/{what}/{name}"
                    with archive.open(f"{key}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, reader.whole(what, name),
                                                  allow_pickle=False)
            for name, value in reader.buffers().items():
                with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, value, allow_pickle=False)
            archive.close()
            stream.flush()
            os.fsync(stream.fileno())  # else a crash just after the rename can leave out empty
        tmp.replace(target)
    except OSError as error:
        raise UsageError(f"consolidate: cannot write {out} ({error.strerror or error}); "
                         f"expected room and permission to write it; {out} is as it was") from None
    finally:
        tmp.unlink(missing_ok=True)  # gone already once renamed
    return out


def _check_outside_checkpoints(out: Path, checkpoint: Path) -> None:
    """Raise UsageError if writing ``out`` would change ``checkpoint`` or one beside it.

    Beside it (in its checkpoint_dir) are the other checkpoints, saves under way and
    ``latest``; any other file there is no checkpoint's. Links are followed, as the write
    follows them; a checkpoint that is a link (to a bigger disk) has its link's folder as well
    as its target's.
    """
    read, where = checkpoint.resolve(), out.resolve()
    home, what = read.parent, ""
    if where.is_relative_to(read):
        what = f"is inside the checkpoint it reads ({checkpoint})"
    for folder in (read.parent, checkpoint.absolute().parent.resolve()):
        if not what:
            home, what = folder, _among_checkpoints(where, folder)
    if not what:
        return
    raise UsageError(f"consolidate: {out} {what}; writing it would damage the checkpoints; "
                     "expected a path outside every checkpoint and latest, e.g. "
                     f"{home / 'model.npz'}")


def _among_checkpoints(where: Path, home: Path) -> str:
    """Say what resolved ``where`` is among checkpoint_dir ``home``'s checkpoints ("": none)."""
    part = where.relative_to(home).parts[0] if where.is_relative_to(home) and where != home else ""
    if part.startswith((STEP_PREFIX, TMP_PREFIX)):
        return f"is inside another checkpoint ({home / part})"
    if part == LATEST:
        return f"is {home}'s {LATEST} (it names the checkpoint a resume takes)"
    return ""


def _open_beside(out: Path) -> BinaryIO:
    """Create a new temporary file in ``out``'s directory, opened for writing.

    There, so that renaming it over ``out`` is atomic; created like any new file (the umask's
    permissions), as ``out`` would be.
    """
    if out.is_dir():
        raise UsageError(f"consolidate: {out} is a directory; expected the .npz file to write, "
                         f"e.g. {out / 'model.npz'}")
    if not out.parent.is_dir():
        raise UsageError(f"consolidate: {out}'s directory {out.parent} does not exist; "
                         "expected an existing directory: create it first")
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        return tmp.open("xb")
    except OSError as error:
        raise UsageError(f"consolidate: cannot write in {out.parent} ({error.strerror or error}); "
                         f"expected a directory you may write, for {out}") from None


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
            sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        else:
            written = consolidate(args.path, args.out, args.optimizer)
            print(f"wrote {written}")
    except UsageError as error:  # CheckpointError is one
        print(error, file=sys.stderr)
        return USAGE_EXIT
    except BrokenPipeError:  # `info ... | head` stopped reading: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # exit flushes stdout
        return 1
    return 0
