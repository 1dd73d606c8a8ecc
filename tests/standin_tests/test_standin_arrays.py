"""Device arrays of the CuPy stand-in: host access, views, arithmetic, indexing, reductions.

Each test names the CuPy (or numpy) documentation it models. CuPy's reference pages are at
https://docs.cupy.dev/en/stable/reference/ (cupy.ndarray, cupy.asnumpy, ...); CuPy's
"Differences between CuPy and NumPy" is user_guide/difference.html.
"""

import math
import pickle

import numpy as np
import pytest

pytestmark = pytest.mark.gpu_standin


def test_implicit_host_conversion_is_refused(cupy):
    """cupy.ndarray docs, "Conversion to/from NumPy arrays": not implicitly convertible.

    CuPy's __array__ raises TypeError ("Implicit conversion to a NumPy array is not allowed.
    Please use `.get()` ..."); there is no buffer protocol or __array_interface__.
    """
    a = cupy.arange(4, dtype=cupy.float32)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.array(a)
    with pytest.raises(TypeError):
        memoryview(a)
    assert not hasattr(a, "__array_interface__")
    with pytest.raises(TypeError, match="not CUDA-aware|not available"):
        a.__cuda_array_interface__  # noqa: B018 (the access itself must fail)
    with pytest.raises(TypeError):
        a.__dlpack__()


def test_numpy_operands_are_refused(cupy):
    """cupy.ndarray.__array_ufunc__ docstring: a numpy array operand raises instead of
    being silently converted (CuPy's kernels say "Unsupported type <class 'numpy.ndarray'>")."""
    a = cupy.ones(3)
    host = np.ones(3)
    for attempt in (lambda: a + host, lambda: host + a, lambda: np.add(host, a),
                    lambda: cupy.multiply(a, host)):
        with pytest.raises(TypeError, match="Unsupported type"):
            attempt()


def test_numpy_functions_dispatch_to_cupy_ones(cupy):
    """NEP 13/18 support in CuPy (__array_ufunc__, __array_function__, cupy.ndarray docs):
    np.exp(x) and np.shape(x) run CuPy's implementation and return device results; a numpy
    function CuPy lacks raises TypeError."""
    a = cupy.arange(3, dtype=cupy.float64)
    result = np.exp(a)
    assert isinstance(result, cupy.ndarray)
    np.testing.assert_allclose(result.get(), np.exp(np.arange(3.0)))
    assert np.shape(a) == (3,)
    with pytest.raises(TypeError):
        np.linalg.norm(a)


def test_get_asnumpy_and_set_follow_cupy_14(cupy):
    """cupy.ndarray.get(stream=None, order='C', out=None, blocking=True) and cupy.asnumpy
    (same arguments); ndarray.set(arr, stream=None) type/shape checks (CuPy 14 core.pyx)."""
    a = cupy.arange(6, dtype=cupy.int32).reshape(2, 3)
    np.testing.assert_array_equal(a.get(), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(cupy.asnumpy(a), np.arange(6).reshape(2, 3))
    assert a.get(order="F").flags.f_contiguous
    out = np.empty((2, 3), np.int32)
    assert a.get(out=out) is out
    np.testing.assert_array_equal(out, np.arange(6).reshape(2, 3))
    with pytest.raises(TypeError, match="cannot be obtained"):
        a.get(out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="Shape mismatch"):
        a.get(out=np.empty((3, 2), np.int32))
    a.set(np.full((2, 3), 7, np.int32))
    assert int(a.sum()) == 42
    with pytest.raises(TypeError, match="cannot be set"):
        a.set(np.zeros((2, 3), np.float64))
    with pytest.raises(RuntimeError, match="non-contiguous"):
        a[:, :2].set(np.zeros((2, 2), np.int32))
    assert cupy.asnumpy([1, 2]).tolist() == [1, 2]


def test_scalar_conversions_synchronise(cupy):
    """cupy.ndarray.item / __float__ / __int__ / __bool__ go through get(), a host
    synchronisation (core.pyx); item() of more than one element raises ValueError."""
    a = cupy.full((), 2.5, cupy.float32)
    assert float(a) == 2.5 and int(a) == 2 and bool(a) and a.item() == 2.5
    with pytest.raises(ValueError, match="size 1"):
        cupy.ones(2).item()
    with pytest.raises(ValueError, match="ambiguous"):
        bool(cupy.ones(2))
    assert repr(cupy.arange(2)) == repr(np.arange(2))


def test_views_share_memory_and_pointers(cupy):
    """cupy.ndarray attributes data (MemoryPointer; .ptr is the device address), base,
    flags.c_contiguous, strides; basic slicing, reshape of contiguous data, ravel and .T give
    views (numpy semantics, user_guide/difference.html)."""
    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4)
    assert a.data.ptr != 0 and a.data.ptr % 256 == 0
    assert a[1].data.ptr == a.data.ptr + 16
    assert a[:, 1].data.ptr == a.data.ptr + 4 and a[:, 1].strides == (16,)
    assert a.ravel().data.ptr == a.data.ptr and a.ravel().base is a.base
    assert a.T.shape == (4, 3) and not a.T.flags.c_contiguous and a.T.flags.f_contiguous
    assert a.T.reshape(-1).data.ptr != a.data.ptr  # needs a copy
    owner = cupy.zeros(3)
    assert owner.flags.owndata and not owner[1:].flags.owndata and not a.flags.owndata
    assert a.nbytes == 48 and a.size == 12 and a.ndim == 2 and a.itemsize == 4
    assert a.device.id == 0
    other = cupy.empty(12, cupy.float32)
    assert other.data.ptr >= a.data.ptr + 48  # allocations never share addresses
    view = a[1]
    view += 100
    np.testing.assert_array_equal(a.get()[1], np.arange(4, 8) + 100)
    assert cupy.empty(0).data.ptr == 0  # zero-byte arrays get a null pointer


def test_integer_index_keeps_a_device_array(cupy):
    """CuPy's indexing: a[i] of a 1-D array is a 0-d cupy.ndarray, not a host scalar
    (user_guide/difference.html, "Zero-dimensional array")."""
    a = cupy.arange(5)
    assert isinstance(a[2], cupy.ndarray) and a[2].shape == ()
    assert [int(x) for x in a] == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="0-d"):
        iter(a[0])


def test_uninitialised_memory_is_garbage(cupy):
    """cupy.empty docs: "Returns an array without initializing the elements" (a reused pool
    block holds old data); the stand-in fills new blocks with NaN/-1 bytes."""
    assert np.isnan(cupy.empty(4, cupy.float32).get()).all()
    assert (cupy.empty(4, cupy.int64).get() == -1).all()
    assert (cupy.zeros(4).get() == 0).all()


def test_nep50_promotion_and_casting(cupy):
    """CuPy 14 follows NumPy 2's promotion (NEP 50: Python scalars are weak) and ufunc
    casting='same_kind' for out= (cupy.ufunc docs)."""
    a = cupy.ones(3, cupy.float32)
    assert (a * 2.0).dtype == np.float32
    assert (a * np.float64(2.0)).dtype == np.float64
    assert (a + cupy.ones(3, cupy.int64)).dtype == np.float64
    ints = cupy.ones(3, cupy.int32)
    with pytest.raises(TypeError):
        ints += 1.5
    with pytest.raises(TypeError):
        cupy.add(a, a, out=ints)
    with pytest.raises(ValueError):
        a + cupy.ones(4)


def test_arithmetic_matches_numpy(cupy):
    """Elementwise ufuncs and operators (cupy.ufunc, "Universal functions" reference) give
    numpy's results, in place too."""
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    a = cupy.asarray(x)
    expected = np.tanh(x) * 3 - np.exp(x) / 2 + np.sqrt(np.abs(x)) ** 2
    got = cupy.tanh(a) * 3 - cupy.exp(a) / 2 + cupy.sqrt(abs(a)) ** 2
    np.testing.assert_allclose(got.get(), expected)
    b = a.copy()
    b *= 2
    b -= a
    np.testing.assert_allclose(b.get(), x)
    np.testing.assert_array_equal((a > 0).get(), x > 0)
    np.testing.assert_array_equal(cupy.maximum(a, 0).get(), np.maximum(x, 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(cupy.isfinite(a / 0).get(), np.isfinite(x / 0))
    np.testing.assert_allclose(cupy.where(a > 0, a, -a).get(), np.abs(x))
    np.testing.assert_allclose(cupy.clip(a, -1, 1).get(), np.clip(x, -1, 1))


@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "var", "std", "argmax", "prod"])
def test_reductions_match_numpy(cupy, name):
    """Reductions with axis / keepdims / out (cupy.sum, cupy.mean, cupy.amax, cupy.var,
    cupy.argmax reference pages: numpy's signatures)."""
    x = np.random.default_rng(3).standard_normal((3, 4, 5))
    a = cupy.asarray(x)
    for axis in (None, 0, 1, (0, 2)) if name != "argmax" else (None, 0, 2):
        for keepdims in (False, True):
            got = getattr(a, name)(axis=axis, keepdims=keepdims)
            want = getattr(np, name)(x, axis=axis, keepdims=keepdims)
            assert got.shape == np.shape(want)
            np.testing.assert_allclose(got.get(), want, rtol=1e-12)
    want = getattr(np, name)(x, axis=1)
    out = cupy.empty(want.shape, want.dtype)
    assert getattr(cupy, name)(a, axis=1, out=out) is out
    np.testing.assert_allclose(out.get(), want, rtol=1e-12)
    with pytest.raises(ValueError):
        getattr(cupy, name)(a, axis=1, out=cupy.empty((2, 2), want.dtype))
    with pytest.raises(np.exceptions.AxisError):
        getattr(a, name)(axis=3)


def test_matmul_dot_and_transpose(cupy):
    """cupy.matmul (numpy's broadcasting and 1-D rules, out=), cupy.dot, ``@`` and ``.T``."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((3, 5))
    a, b = cupy.asarray(x), cupy.asarray(y)
    np.testing.assert_allclose((a @ b).get(), x @ y)
    np.testing.assert_allclose((a.T.T @ b).get(), x @ y)
    np.testing.assert_allclose(cupy.matmul(b.T, a.T).get(), (x @ y).T)
    out = cupy.empty((4, 5))
    assert cupy.matmul(a, b, out=out) is out
    np.testing.assert_allclose(out.get(), x @ y)
    v = cupy.asarray(y[:, 0])
    np.testing.assert_allclose(cupy.dot(v, v).get(), y[:, 0] @ y[:, 0])
    batch = cupy.asarray(rng.standard_normal((2, 4, 3)))
    assert cupy.matmul(batch, b).shape == (2, 4, 5)
    with pytest.raises(ValueError, match="mismatch"):
        a @ a


def test_advanced_indexing_as_losses_use_it(cupy):
    """Integer-array indexing (user_guide/difference.html): gather ``p[rows, labels]``,
    scatter and in-place scatter, as meta_dist's cross-entropy does."""
    logp = np.log(np.random.default_rng(1).dirichlet(np.ones(5), size=4))
    labels = np.array([4, 0, 2, 2])
    p, rows, lab = cupy.asarray(logp), cupy.arange(4), cupy.asarray(labels)
    np.testing.assert_allclose(p[rows, lab].get(), logp[np.arange(4), labels])
    np.testing.assert_allclose((-p[rows, lab].mean()).get(), -logp[np.arange(4), labels].mean())
    grad = cupy.exp(p)
    grad[rows, lab] -= 1.0
    expected = np.exp(logp)
    expected[np.arange(4), labels] -= 1.0
    np.testing.assert_allclose(grad.get(), expected)
    z = cupy.zeros_like(p)
    z[rows, lab] = -0.25
    assert float(z.sum()) == -1.0
    np.testing.assert_array_equal(p[[0, 2]].get(), logp[[0, 2]])
    np.testing.assert_array_equal(p[p > -1].get(), logp[logp > -1])  # boolean mask: a sync


def test_out_of_bounds_index_is_a_device_fault(cupy, fresh_device):
    """CuPy wraps out-of-bounds integer-array indices around (user_guide/difference.html,
    "Out-of-bounds indices"); the stand-in, stricter, makes it a sticky device fault that the
    next synchronisation reports (CUDARuntimeError, as a device-side error would)."""
    a = cupy.arange(3)
    bad = a[cupy.asarray([0, 7])]
    with pytest.raises(cupy.cuda.runtime.CUDARuntimeError):
        bad.get()


def test_basic_setitem_and_views_of_views(cupy):
    """ndarray.__setitem__ with slices, broadcasting and unsafe casting (numpy semantics)."""
    a = cupy.zeros((3, 4), cupy.int64)
    a[1] = 5
    a[:, 2] = cupy.arange(3)
    a[0, :2] = np.array([7, 8])  # host data are copied to the device first
    a[2, 3] = 9.7
    expected = np.zeros((3, 4), np.int64)
    expected[1] = 5
    expected[:, 2] = np.arange(3)
    expected[0, :2] = [7, 8]
    expected[2, 3] = 9
    np.testing.assert_array_equal(a.get(), expected)
    with pytest.raises(ValueError):
        a[0] = cupy.ones(3)


def test_astype_copy_and_creation(cupy):
    """astype(copy=False) returns self when the dtype matches; copy, zeros/ones/full/arange
    /eye/linspace and *_like follow numpy (cupy creation routines reference)."""
    a = cupy.arange(4, dtype=cupy.float32)
    assert a.astype(cupy.float32, copy=False) is a
    assert a.astype(cupy.float64).dtype == np.float64
    assert a.copy().data.ptr != a.data.ptr
    np.testing.assert_array_equal(cupy.full((2,), 3).get(), [3, 3])
    np.testing.assert_array_equal(cupy.eye(2).get(), np.eye(2))
    np.testing.assert_allclose(cupy.linspace(0, 1, 5).get(), np.linspace(0, 1, 5))
    np.testing.assert_array_equal(cupy.ones_like(a).get(), np.ones(4, np.float32))
    assert cupy.asarray(a) is a
    assert cupy.ascontiguousarray(a.reshape(2, 2).T).flags.c_contiguous
    np.testing.assert_array_equal(cupy.concatenate([a, a]).get(), np.tile(np.arange(4), 2))
    np.testing.assert_array_equal(cupy.stack([a, a]).get(), np.stack([np.arange(4)] * 2))
    np.testing.assert_array_equal(cupy.pad(a, 1).get(), np.pad(np.arange(4.0), 1))
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cupy.empty(2, dtype=object)


def test_as_strided_windows_and_bounds(cupy):
    """cupy.lib.stride_tricks.as_strided makes a view with any strides (as numpy's); the
    stand-in refuses views that reach outside their allocation (on a GPU: other data or a
    fault), a deliberate strictness."""
    a = cupy.arange(10, dtype=cupy.float32)
    windows = cupy.lib.stride_tricks.as_strided(a, shape=(8, 3), strides=(4, 4))
    np.testing.assert_array_equal(windows.get(), np.lib.stride_tricks.sliding_window_view(
        np.arange(10, dtype=np.float32), 3))
    with pytest.raises(ValueError, match="outside"):
        cupy.lib.stride_tricks.as_strided(a, shape=(10, 3), strides=(4, 4))


def test_copyto_and_pickle(cupy):
    """cupy.copyto (casting rule, non-scalar numpy source refused) and pickling (CuPy's
    __reduce__ goes through get())."""
    dst = cupy.zeros(3, cupy.float32)
    cupy.copyto(dst, cupy.arange(3, dtype=cupy.float32))
    cupy.copyto(dst, 2)
    assert float(dst.sum()) == 6
    with pytest.raises(TypeError):
        cupy.copyto(cupy.zeros(3, cupy.int32), cupy.ones(3))
    with pytest.raises(ValueError, match="non-scalar"):
        cupy.copyto(dst, np.ones(3))
    back = pickle.loads(pickle.dumps(cupy.arange(3)))
    assert isinstance(back, cupy.ndarray) and back.tolist() == [0, 1, 2]


def test_bfloat16_arrays(cupy):
    """CuPy 14's minimal bfloat16 support through ml_dtypes (docs/source/upgrade.rst)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = cupy.asarray(np.arange(4, dtype=ml_dtypes.bfloat16))
    assert a.dtype == np.dtype(ml_dtypes.bfloat16)
    assert math.isclose(float((a * 2).sum()), 12.0)
    assert a.view(cupy.uint16).dtype == np.uint16


def test_scatter_add_accumulates_and_refuses_bfloat16(cupy):
    """cupyx.scatter_add (reference/generated/cupyx.scatter_add.html): ``a[slices] += value``
    with repeated indices accumulating, as numpy's add.at. CuPy's add.at takes int32, int64,
    float16, float32, float64, uint32 and uint64 only: CuPy 14.2 on an H200 raised TypeError
    "cupy.add.at only supports ... as data type" for bfloat16. Also meta_dist's Embedding, which
    sums 16-bit rows in float32 and rounds once."""
    import cupyx

    from meta_dist.nn.embedding import _scatter_add

    ml_dtypes = pytest.importorskip("ml_dtypes")
    ids = cupy.asarray(np.array([0, 2, 0, 0], np.int64))
    rows = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    out = cupy.zeros((3, 2), cupy.float32)
    cupyx.scatter_add(out, ids, cupy.asarray(rows))
    want = np.zeros((3, 2), np.float32)
    np.add.at(want, ids.get(), rows)
    np.testing.assert_array_equal(out.get(), want)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(TypeError, match=r"cupy.add.at only supports .* as data type"):
        cupyx.scatter_add(cupy.zeros((3, 2), bf16), ids, cupy.asarray(rows.astype(bf16)))
    many = np.full(300, 1.0 + 2.0**-7, np.float32)  # bfloat16 rounds each add on its own
    out = cupy.zeros((1, 1), bf16)
    _scatter_add(out, cupy.zeros(300, cupy.int64), cupy.asarray(many.astype(bf16)[:, None]))
    assert out.get()[0, 0] == np.float32(many.astype(bf16).astype(np.float32).sum()).astype(bf16)


def test_unique_returns_sorted_values_and_what_was_asked(cupy):
    """cupy.unique (reference/generated/cupy.unique.html): numpy.unique's arguments; the sorted
    unique values, then the first indices, the inverse and the counts, each only when asked,
    as device arrays."""
    ids = cupy.asarray(np.array([5, 1, 5, 9, 1, 5], np.int64))
    values = cupy.unique(ids)
    assert isinstance(values, cupy.ndarray)
    np.testing.assert_array_equal(values.get(), [1, 5, 9])
    values, first, inverse, counts = cupy.unique(ids, return_index=True, return_inverse=True,
                                                 return_counts=True)
    assert all(isinstance(x, cupy.ndarray) for x in (values, first, inverse, counts))
    np.testing.assert_array_equal(first.get(), [1, 0, 3])
    np.testing.assert_array_equal(values.get()[inverse.get()], ids.get())
    np.testing.assert_array_equal(counts.get(), [2, 3, 1])
