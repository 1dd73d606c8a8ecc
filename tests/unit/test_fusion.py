"""Fusion's buffers, without MPI: when a large result's memory may be handed out again."""

import numpy as np

from meta_dist.comm.fusion import RECYCLE_MIN_BYTES, Fusion


def test_a_result_buffer_is_handed_out_again_only_once_no_view_of_it_lives():
    """new_buffer reuses a large result's memory (fresh pages cost faults) only once no array
    over it is left: a view of a view of a view keeps it; dropping everything frees it. The
    test is by weak reference, not by counting references (Python 3.14 counts fewer: it
    borrows references on its stack)."""
    fusion = Fusion(lambda a: a.ctypes.data)
    like, numel = np.empty(0, np.float32), RECYCLE_MIN_BYTES // 4
    first = fusion.new_buffer(like, numel)
    first_address = first.ctypes.data
    kept = first[4:].reshape(-1, 4).T[1:]
    kept[...] = 7.0
    del first
    second = fusion.new_buffer(like, numel)
    second_address = second.ctypes.data
    assert not np.shares_memory(second, kept)
    second[...] = 1.0
    del second
    third = fusion.new_buffer(like, numel)
    assert third.ctypes.data == second_address  # dropped: its memory again
    assert (kept == 7.0).all()
    del kept
    fourth = fusion.new_buffer(like, numel)
    assert fourth.ctypes.data == first_address and not np.shares_memory(fourth, third)

