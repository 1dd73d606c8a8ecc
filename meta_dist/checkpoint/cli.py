"""The command line: ``python -m meta_dist.checkpoint info|consolidate`` and what it runs.

Imports numpy, files.py and reader.py (no MPI: it runs anywhere, without mpirun);
``__main__.py`` and the package's ``__init__`` import it.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from meta_dist.checkpoint.files import CheckpointError
from meta_dist.checkpoint.reader import Reader


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
