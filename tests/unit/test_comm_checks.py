"""The collectives' argument checks, without MPI: each rule, its message, and what passes."""

import numpy as np
import pytest

from meta_dist import contiguous_arrays
from meta_dist.comm import checks
from meta_dist.xp import data_ptr


def test_inputs_returns_a_list_and_copies_only_non_contiguous_arrays():
    x = np.ones(4, np.float32)
    assert checks.inputs("op", x) == ([x], False)
    got, is_list = checks.inputs("op", (x, x))
    assert is_list and got[0] is x and got[1] is x
    strided = np.arange(10.0)[::2]
    (copy,), _ = checks.inputs("op", strided)
    assert copy is not strided and copy.flags.c_contiguous
    np.testing.assert_array_equal(copy, strided)


@pytest.mark.parametrize("arrays,error,words", [
    ([], ValueError, "op: got an empty list; expected at least one array"),
    ([1.0], TypeError, "op: expected a numpy or cupy array (item 0); got <class 'float'>"),
    (np.ones(2, np.complex64), TypeError, "op: unsupported dtype; got complex64, expected one"),
    ([np.ones(2), np.ones(2, np.float32)], TypeError,
     "op: a fused list must share one dtype; got float64 (item 0) and float32 (item 1)"),
    ([np.ones(2), np.ma.ones(2)], TypeError,
     "op: a fused list must hold one kind of array; got ndarray (item 0) and MaskedArray"),
    (np.ma.masked_less(np.arange(3.0), 1), TypeError,
     "op: got a masked array, whose mask op would ignore; expected a plain array"),
    ([np.ma.ones(2), np.ma.ones(2)], TypeError, "op: got a masked array (item 0), whose mask"),
])
def test_inputs_refusals_name_the_item(arrays, error, words):
    with pytest.raises(error) as err:
        checks.inputs("op", arrays)
    assert words in str(err.value)


def test_op_rank_and_rows():
    checks.check_op("allreduce", "avg", checks.REDUCE_OPS, np.dtype(np.float16))
    with pytest.raises(ValueError, match="allreduce: unknown op; got 'mean', expected one of sum"):
        checks.check_op("allreduce", "mean", checks.REDUCE_OPS, np.dtype(np.float32))
    with pytest.raises(ValueError, match="unknown op; got \\['sum'\\]"):
        checks.check_op("allreduce", ["sum"], checks.REDUCE_OPS, np.dtype(np.float32))
    with pytest.raises(ValueError, match="reduce_scatter: op not supported here; got 'max', "
                                         "expected one of sum, avg; use allreduce for it"):
        checks.check_op("reduce_scatter", "max", checks.SCATTER_OPS, np.dtype(np.float32))
    with pytest.raises(TypeError, match="op 'avg' needs a floating dtype; got int32"):
        checks.check_op("allreduce", "avg", checks.REDUCE_OPS, np.dtype(np.int32))
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=f"root out of range; got {bad!r}, expected 0 <= "):
            checks.check_rank("broadcast", "root", bad, 4)
    for bad, kind in ((True, "bool"), (1.0, "float"), ("0", "str"), (np.array(1), "ndarray")):
        with pytest.raises(ValueError, match=f"root is not an int; got .*\\({kind}\\), "
                                             "expected an int with 0 <= root < 4"):
            checks.check_rank("broadcast", "root", bad, 4)
    checks.check_rank("broadcast", "root", np.int64(3), 4)
    checks.check_rows("reduce_scatter", [np.ones((8, 2))], 4)
    with pytest.raises(ValueError, match="send has 7 rows along axis 0 .* size is 4; expected"):
        checks.check_rows("reduce_scatter", [np.ones(8), np.ones(7)], 4)
    with pytest.raises(ValueError, match="allgather: send is 0-d"):
        checks.check_axis0("allgather", np.ones(()))
    with pytest.raises(ValueError, match="reduce_scatter: send is 0-d; expected an array with "
                                         "axis 0"):
        checks.check_rows("reduce_scatter", [np.ones(())], 4)


def test_outputs_must_mirror_the_input():
    like = [np.ones(4, np.float32)]
    out = np.empty(4, np.float32)
    assert checks.outputs("op", out, [(4,)], like, False) == [out]
    with pytest.raises(ValueError, match=r"out must match the input: 1 array; got list of 2"):
        checks.outputs("op", [out, out], [(4,)], like, False)
    with pytest.raises(ValueError, match=r"out must match the input: 2 arrays in a list; got "
                                         r"ndarray of 1"):  # one array for a list of two
        checks.outputs("op", out, [(4,), (4,)], like * 2, True)
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(4,\) and dtype float32; "
                                         r"expected shape \(2,\)"):
        checks.outputs("op", out, [(2,)], like, False)
    with pytest.raises(TypeError, match=r"out\[0\] is a list"):
        checks.outputs("op", [[1, 2]], [(4,)], like, True)
    frozen = np.empty(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="output buffer is read-only"):
        checks.outputs("op", frozen, [(4,)], like, False)
    with pytest.raises(ValueError, match="output buffer is not contiguous"):
        checks.outputs("op", np.empty(8, np.float32)[::2], [(4,)], like, False)


def test_alias_allows_exactly_the_in_place_spellings():
    send = np.zeros(8)
    checks.check_alias("allreduce", send, send[:], 1)  # the same memory: in place
    checks.check_alias("allreduce", send, np.zeros(8), 1)  # separate memory
    with pytest.raises(ValueError, match="allreduce: out overlaps send without being send itself; "
                                         "expected out to be send itself"):
        checks.check_alias("allreduce", send[:6], send[2:8], 1)
    checks.check_alias("reduce_scatter", send, send[2:4], 1)  # rank 1's rows of m = 2
    with pytest.raises(ValueError, match="elsewhere than this rank's rows; expected out to be "
                                         r"send\[1\*m:2\*m\] \(in place\)"):
        checks.check_alias("reduce_scatter", send, send[1:3], 1)
    checks.check_alias("allgather", send[4:6], send, 2)  # send is rank 2's rows of out
    with pytest.raises(ValueError, match=r"elsewhere than this rank's rows of out; expected send "
                                         r"to be out\[2\*m:3\*m\] \(in place\)"):
        checks.check_alias("allgather", send[3:5], send, 2)


def test_adjacent_run_spans_exactly_a_list_laid_back_to_back():
    arrays = contiguous_arrays([(2, 3), (0,), (4,)], np.float32)
    run = checks.adjacent_run(arrays)
    assert run.shape == (10,) and data_ptr(run) == data_ptr(arrays[0])
    run[...] = np.arange(10)
    np.testing.assert_array_equal(arrays[2], [6, 7, 8, 9])
    assert checks.adjacent_run(arrays[::-1]) is None  # back to back, but not in list order
    assert checks.adjacent_run([np.ones(2), np.ones(2)]) is None  # separate allocations
    gap = np.zeros(10)
    assert checks.adjacent_run([gap[:4], gap[5:]]) is None  # one buffer, with a gap


def test_contiguous_arrays_takes_int_shapes_as_numpy_zeros_does():
    arrays = contiguous_arrays([4, np.int64(5), (2, 3)], np.float32)
    assert [a.shape for a in arrays] == [(4,), (5,), (2, 3)]
    assert checks.adjacent_run(arrays).shape == (15,)


def test_adjacent_run_follows_views_whose_base_is_not_the_owner():
    whole = np.frombuffer(bytearray(4 * 8), np.float32)  # owned by a buffer that is no array
    arrays = [whole[:0], whole[:3], whole[3:5].reshape(1, 2), whole[5:]]
    assert arrays[1].base is whole and checks.memory_owner(arrays[1]) is not whole
    run = checks.adjacent_run(arrays)
    assert run.shape == (8,) and data_ptr(run) == data_ptr(whole)
    other = np.frombuffer(bytearray(4 * 8), np.float32)
    assert checks.adjacent_run([whole[:3], other[3:5]]) is None  # another owner, same offsets


def test_shape_rules():
    assert checks.same_arrays([1, 2], [1, 2]) and not checks.same_arrays([1], [1, 2])
