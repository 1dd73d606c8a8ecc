"""``Communicator.traffic`` (comm.plans.Traffic) without MPI: what its counts read as."""

import numpy as np

from meta_dist.comm.plans import Traffic


def test_calls_and_bytes_are_the_counts_themselves():
    """``traffic.calls`` and ``traffic.bytes`` are live dicts, as they always were: one held
    across steps shows the calls made since, and reset() empties it too. A copy made when read
    would show nothing of the calls after it."""
    traffic = Traffic(4)
    calls, moved = traffic.calls, traffic.bytes
    traffic.count("allreduce", [np.ones(4, np.float32)])
    traffic.count("allreduce", [np.ones(2, np.float32), np.ones(2, np.float32)])
    assert calls == {"allreduce": 2}
    assert moved == {"allreduce": 2 * 3 / 4 * 32}
    traffic.reset()
    assert calls == {} and moved == {} and traffic.total() == 0
