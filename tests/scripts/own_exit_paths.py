"""Exits that meta_dist's failure policy must read right (tests/test_launch.py).

    mpirun -np 3 python tests/scripts/own_exit_paths.py MODE

``caught``: every rank calls sys.exit(2) and exit(2) inside try/except SystemExit (as a try
around argparse does), then goes on to an allreduce and ends normally: the job must exit 0.
``hook``: rank 2 installs a sys.excepthook of its own (as rich.traceback.install does) and
raises after the first allreduce while the others wait in the next one: the job must end at
once with code 1, saying the exception was uncaught.
``thread``: after the last allreduce every rank's helper thread calls sys.exit(2), which ends
that thread alone: the job must exit 0.
"""

import sys
import threading

import numpy as np

import meta_dist

MODE = sys.argv[1]
context = meta_dist.init()
meta_dist.allreduce(np.ones(4))
if MODE == "caught":
    for leave in (sys.exit, exit):
        try:
            leave(2)
        except SystemExit:
            pass
    meta_dist.allreduce(np.ones(4))
    print(f"rank {context.rank} went on", flush=True)
elif MODE == "thread":
    helper = threading.Thread(target=sys.exit, args=(2,))
    helper.start()
    helper.join()
    print(f"rank {context.rank} went on", flush=True)
else:
    if context.rank == 2:
        sys.excepthook = lambda kind, error, tb: print(f"own hook: {error}", flush=True)
        raise RuntimeError("deliberate failure on rank 2")
    meta_dist.allreduce(np.ones(4))
    print("unreachable: allreduce returned without rank 2", flush=True)
