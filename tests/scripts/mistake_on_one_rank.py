"""A mistake only rank 1 makes, as a data file missing on one node: ``DIR`` names a directory.

    mpirun -np 3 python tests/scripts/mistake_on_one_rank.py DIR [wait]

Without ``wait``: every rank starts meta_dist; rank 1 loads DIR/missing.npz (a UsageError) while
the others wait in a barrier. With ``wait``: every rank writes DIR/waiting-RANK and sleeps (for
a Ctrl-C that reaches every rank outside training).
"""

import sys
import time
from pathlib import Path

from meta_dist import distributed as dist
from meta_dist.train import load_npz

folder = Path(sys.argv[1])
context = dist.init()
if sys.argv[2:] == ["wait"]:
    (folder / f"waiting-{context.rank}").write_text("")
    time.sleep(120)
elif context.rank == 1:
    load_npz(folder / "missing.npz")
context.connector.barrier()
dist.shutdown()
