"""MPIConnector and the distributed context against what the launcher says."""

import os

import numpy as np
import pytest
from test_collectives import left_before_the_last_arrived

import meta_dist
from meta_dist import distributed as dist


def test_rank_size_local(connector):
    """local_rank numbers this node's ranks 0..local_size-1 in world-rank order.

    The launcher's own variables (OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS) must agree on
    the count; Open MPI numbers its local ranks in mapping order, which may differ.
    """
    from mpi4py import MPI
    assert (connector.rank, connector.size) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)
    for size_var in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if size_var in os.environ:
            assert connector.local_size == int(os.environ[size_var])
    everyone = connector.allgather((MPI.Get_processor_name(), connector.local_rank))
    mine = [lr for host, lr in everyone if host == MPI.Get_processor_name()]
    assert mine == list(range(connector.local_size))
    assert connector.root_rank == 0 and connector.is_root == (connector.rank == 0)
    assert connector.allgather(connector.rank) == list(range(connector.size))


@pytest.mark.mpi(min_size=2)
def test_barrier_waits_for_the_last_rank(connector):
    early = left_before_the_last_arrived(connector.barrier, connector.rank, connector.size,
                                         connector.allgather)
    assert early == [], f"ranks {early} left the barrier before the last rank entered"


def test_broadcast_objects(connector):
    for root in range(connector.size):
        got = connector.broadcast({"from": connector.rank, "x": [1, 2]}, root=root)
        assert got == {"from": root, "x": [1, 2]}
    with pytest.raises(ValueError, match="root out of range; got 99"):
        connector.broadcast(1, root=99)


def test_context_and_module_level_collectives():
    dctx = dist.get_context()
    assert (dctx.rank, dctx.size, dctx.root_rank) == (dctx.connector.rank, dctx.connector.size, 0)
    assert 0 <= dctx.local_rank < dctx.local_size
    x = np.ones((4, 4), np.float32) * (dctx.rank + 1)
    total = dctx.size * (dctx.size + 1) / 2
    np.testing.assert_array_equal(meta_dist.allreduce(x), np.full((4, 4), total))
    y, z = meta_dist.allreduce([x, x[0]])
    np.testing.assert_array_equal(z, np.full(4, total))
    n, r = dctx.size, dctx.rank  # each collective's async twin, at module level too
    rows = np.arange(2 * n, dtype=np.float64)
    np.testing.assert_array_equal(meta_dist.reduce_scatter_async(rows).wait(),
                                  n * rows[2 * r:2 * r + 2])
    np.testing.assert_array_equal(meta_dist.allgather_async(rows[:2] + r).wait(),
                                  np.concatenate([rows[:2] + k for k in range(n)]))
    np.testing.assert_array_equal(meta_dist.broadcast_async(x, root=n - 1).wait(),
                                  np.full((4, 4), n, np.float32))
    at_root = meta_dist.reduce_async(x, root=0).wait()
    assert (at_root is None) == (r != 0)
    if n > 1 and r < 2:
        sent = meta_dist.send_async(x, 1 - r)
        got = meta_dist.recv_async(np.empty_like(x), 1 - r).wait()
        sent.wait()
        np.testing.assert_array_equal(got, np.full((4, 4), 2 - r, np.float32))
    dctx.enable_data_parallel = True
    dctx.zero_opt_level = 3
    with pytest.raises(ValueError, match="zero_opt_level must be one of 0, 1, 2, 3; got 4"):
        dctx.zero_opt_level = 4
    with pytest.raises(TypeError, match="enable_data_parallel must be a bool"):
        dctx.enable_data_parallel = "yes"
    dist.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        meta_dist.allreduce(x)
    assert dist.get_context() is not dctx  # a new context after shutdown
    np.testing.assert_array_equal(meta_dist.allreduce(x), np.full((4, 4), total))
    dist.shutdown()
