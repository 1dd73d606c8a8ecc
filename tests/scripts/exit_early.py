"""One rank leaves early while the others wait in a collective: the job must end at once.

    mpirun -np N python tests/scripts/exit_early.py WHEN HOW

WHEN is ``before`` (before meta_dist starts MPI) or ``after`` (once the context is up); HOW is
``raise`` (an uncaught exception), ``exit`` (sys.exit(3)), ``builtin`` (the site module's
exit(3), which does not go through sys.exit), ``bare`` (raise SystemExit(3), which does not
either) or ``wrapped`` (raise under an
exception hook that captures stderr around ours, as torch.distributed's does). Rank 1 leaves;
the others go on to an allreduce that rank 1 never joins.
"""

import io
import os
import sys

import numpy as np

import meta_dist
import meta_dist.nn.layers  # noqa: F401  (importing any part of meta_dist starts no MPI)

WHEN, HOW = sys.argv[1], sys.argv[2]
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))


def capture_around(hook):
    """torch.distributed's pattern: run the previous hook with stderr swapped for a buffer."""
    def wrapper(*args):
        real, sys.stderr = sys.stderr, io.StringIO()
        try:
            hook(*args)
        finally:
            captured, sys.stderr = sys.stderr.getvalue(), real
        sys.stderr.write(captured)

    return wrapper


def leave():
    if HOW == "wrapped":
        sys.excepthook = capture_around(sys.excepthook)
    if HOW in ("raise", "wrapped"):
        raise RuntimeError(f"deliberate failure on rank 1 {WHEN} init")
    if HOW == "builtin":
        exit(3)  # noqa: PLR1722 (the builtin on purpose: users call it)
    if HOW == "bare":
        raise SystemExit(3)  # as `raise SystemExit(main())` does
    sys.exit(3)


if WHEN == "before" and RANK == 1:
    leave()
context = meta_dist.init()
if WHEN == "after" and context.rank == 1:
    leave()
meta_dist.allreduce(np.ones(4))
print("unreachable: allreduce returned without rank 1", flush=True)
