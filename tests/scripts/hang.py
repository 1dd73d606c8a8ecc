"""A rank that does not arrive: the job must end with a report naming it (tests/test_launch.py).

    META_DIST_STALL_TIMEOUT=5 mpirun -np 3 python tests/scripts/hang.py MODE

The last rank does not come to a collective the others wait in. MODE ``loop``: it loops in
Python (alive: its watchdog answers) while the others wait in an allreduce of a list of arrays.
``gone``: it stops itself with SIGSTOP (its watchdog cannot answer). ``zero2``: training at
ZeRO-2 with overlap, it loops in its loss function at step 3 while the others wait in a bucket's
reduce-scatter on the communication thread; the timeout comes from meta_dist_config.stall_timeout
(5 s) there. ``elsewhere`` (run with META_DIST_CHECK=0, so no call is compared before it runs):
it calls barrier while the others allreduce, both collective #2. ``exits WHERE``: its program ends
(no error) while the others go on to allreduce #2 (WHERE ``allreduce``), a barrier of the
connector (``connector``, as a checkpoint's save makes) or rank 0 to a recv from it (``recv``).
``connector``: it loops in Python while the others wait in the connector's barrier. Prints
``unreachable`` where a rank outlives the stall.
"""

import os
import signal
import sys
import time

import numpy as np

from meta_dist import distributed as dist

MODE = sys.argv[1]


def hang_begins() -> None:
    print(f"hang begins at {time.time():.3f}", flush=True)


def stuck_in_python() -> None:
    """Busy Python code that never reaches the next collective (within the test's time)."""
    hang_begins()
    end = time.monotonic() + 120
    while time.monotonic() < end:
        sum(range(1000))


context = dist.get_context()
last = context.rank == context.size - 1
if MODE in ("loop", "gone"):
    comm = context.communicator("mpi")
    comm.allreduce(np.ones(4))  # every rank completes #1
    if last and MODE == "loop":
        stuck_in_python()
    elif last:
        hang_begins()
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)  # resumed: mpirun sends SIGCONT before it kills a stopped process
    else:
        comm.allreduce([np.ones(5, np.float32), np.ones((2, 3), np.float32)])
elif MODE in ("exits", "connector"):
    comm = context.communicator("mpi")
    comm.allreduce(np.ones(4))
    where = sys.argv[2] if MODE == "exits" else "connector"
    if last and MODE == "connector":
        stuck_in_python()
    elif last:
        hang_begins()
        sys.exit(0)  # as a script's end: its watchdog tells the others it has gone
    elif where == "allreduce":
        comm.allreduce(np.ones(4))
    elif where == "connector":
        context.connector.barrier()
    elif context.rank == 0:
        comm.recv(np.empty(4), context.size - 1)
    else:
        time.sleep(20)  # long enough for rank 0's report
elif MODE == "elsewhere":
    comm = context.communicator("mpi")
    comm.allreduce(np.ones(4))
    hang_begins()
    if last:
        comm.barrier()
    else:
        comm.allreduce(np.ones(4))
else:
    from meta_dist.config import load_config
    from meta_dist.nn.layers import Linear, Tanh
    from meta_dist.nn.losses import softmax_cross_entropy
    from meta_dist.nn.model import Sequential
    from meta_dist.train import Trainer

    rng = np.random.default_rng(3)
    model = Sequential(Linear(6, 9, rng=rng), Tanh(), Linear(9, 9, rng=rng), Tanh(),
                       Linear(9, 3, rng=rng))
    config = load_config({"optimizer": "adam", "batch_size": 30, "n_epoch": 1, "n_mini_batch": 5},
                         {"zero_opt_level": 2, "bucket_size_mb": 1e-4, "overlap_comm": True,
                          "backend": "mpi", "device": "cpu", "stall_timeout": 5})
    calls = [0]

    def loss_fn(output, labels):
        calls[0] += 1
        if last and calls[0] == 3:
            stuck_in_python()
        return softmax_cross_entropy(output, labels)

    x = rng.standard_normal((150, 6)).astype(np.float32)
    Trainer(model, config, loss_fn=loss_fn, log=None).fit(x, rng.integers(0, 3, 150))
print(f"unreachable: rank {context.rank} outlived the stall", flush=True)
