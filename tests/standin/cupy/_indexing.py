"""Indexing of stand-in arrays: basic indexing makes views, advanced indexing runs kernels.

Imports numpy and the stand-in's _kernel, _ndarray and _ops. Rules are numpy's, as CuPy's
(https://docs.cupy.dev/en/stable/user_guide/difference.html): integers, slices, None and
Ellipsis give views (an integer index keeps a 0-d device array, never a host scalar); integer
arrays (device arrays, or host lists/arrays copied to the device first) gather and scatter in
kernels; a boolean device mask needs its count on the host first, so it synchronises the
current stream, as in CuPy. Stricter than CuPy: an out-of-bounds integer-array index is a
device fault (CuPy wraps it around silently), reported at the next synchronisation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _kernel
from ._ndarray import ndarray


def _is_advanced(k: Any) -> bool:
    return isinstance(k, (ndarray, np.ndarray, list, bool, np.bool_))


def _basic(a: ndarray, key: tuple) -> ndarray:
    if not any(k is Ellipsis for k in key):
        key = (*key, Ellipsis)  # an integer index then gives a 0-d view, not a host scalar
    return a._from_shadow(a._shadow()[key])


def _device_key(key: tuple) -> tuple:
    from ._routines import array

    converted = []
    for k in key:
        if isinstance(k, (bool, np.bool_)):
            raise IndexError("cupy stand-in: a Python bool used as an index is not supported; "
                             "use a boolean cupy array")
        if isinstance(k, (np.ndarray, list)):
            k = array(k)
        if isinstance(k, ndarray):
            if k.dtype.kind == "b":
                if len(key) != 1 and sum(isinstance(x, ndarray) for x in key) > 1:
                    raise IndexError("cupy stand-in: a boolean mask must be the only array "
                                     "in an index")
                converted.extend(array(i) for i in np.nonzero(k.get()))  # host sync, as CuPy
                continue
            if k.dtype.kind not in "iu":
                raise IndexError(f"arrays used as indices must be of integer or boolean type "
                                 f"(actual: {k.dtype.type})")
        converted.append(k)
    return tuple(converted)


def _dummy_key(key: tuple) -> tuple:
    return tuple(np.broadcast_to(np.intp(0), k.shape) if isinstance(k, ndarray) else k
                 for k in key)


def _template(key: tuple) -> tuple:
    """Return ``key`` with its device arrays replaced by a marker (kernels keep no arrays)."""
    return tuple(_ARRAY if isinstance(k, ndarray) else k for k in key)


_ARRAY = object()


def _rebuild(template: tuple, views: Any) -> tuple:
    it = iter(views)
    return tuple(next(it) if k is _ARRAY else k for k in template)


def _out_of_bounds(error: IndexError) -> IndexError:
    return IndexError(f"{error} (integer-array index out of bounds in a kernel; CuPy would wrap "
                      f"it around silently, the stand-in treats it as a device fault)")


def getitem(a: ndarray, key: Any) -> ndarray:
    """Return ``a[key]``: a view for basic indexing, a gathered copy for advanced indexing."""
    key = key if isinstance(key, tuple) else (key,)
    if not any(_is_advanced(k) for k in key):
        return _basic(a, key)
    from ._ops import empty

    key = _device_key(key)
    shape = np.empty(a.shape, "V0")[_dummy_key(key)].shape
    out = empty(shape, a.dtype)
    indices = [k for k in key if isinstance(k, ndarray)]
    template = _template(key)

    def gather(src: np.ndarray, *rest: np.ndarray) -> None:
        try:
            rest[-1][...] = src[_rebuild(template, rest[:-1])]
        except IndexError as error:
            raise _out_of_bounds(error) from None

    _kernel.launch("kernel gather (advanced indexing)", gather, [a, *indices], [out])
    return out


def setitem(a: ndarray, key: Any, value: Any) -> None:
    """Do ``a[key] = value`` in a kernel (numpy's broadcasting and unsafe casting)."""
    from ._ops import assign
    from ._routines import array

    key = key if isinstance(key, tuple) else (key,)
    if not any(_is_advanced(k) for k in key):
        assign(_basic(a, key), value, "setitem")
        return
    key = _device_key(key)
    if not isinstance(value, (ndarray, *_kernel.SCALAR_TYPES)):
        value = array(value)
    target = np.empty(a.shape, "V0")[_dummy_key(key)]
    if isinstance(value, ndarray):
        np.broadcast_to(np.empty(value.shape, "V0"), target.shape)  # numpy's broadcast error
    indices = [k for k in key if isinstance(k, ndarray)]
    sources = [value] if isinstance(value, ndarray) else []
    scalar = None if sources else value
    template = _template(key)
    count = len(indices)

    def scatter(*views: np.ndarray) -> None:
        index_views, rest = views[:count], views[count:]
        new = rest[0] if len(rest) > 1 else scalar
        try:
            rest[-1][_rebuild(template, index_views)] = new
        except IndexError as error:
            raise _out_of_bounds(error) from None

    _kernel.launch("kernel scatter (advanced indexing)", scatter, [*indices, *sources], [a])
