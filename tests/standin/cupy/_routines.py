"""The stand-in's creation, layout and host routines (cupy.zeros, cupy.asarray, cupy.pad, ...).

Imports numpy and the stand-in's _engine, _kernel, _ndarray and _ops; registered in the same
``FUNCTIONS`` table as the ufuncs and reductions (see ``_ops``), so ``cupy.<name>`` and numpy's
``__array_function__`` dispatch find them. Creation routines follow numpy's signatures and
CuPy's reference pages (cupy.array / cupy.asarray: a host source is copied on the current
stream, page-locked memory read when the copy runs, pageable memory staged at the call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _engine, _kernel
from ._ndarray import ndarray, normalize_dtype
from ._ops import (
    _check_out,
    _require_array,
    assign,
    elementwise,
    empty,
    register,
)
from .cuda.stream import current_queue

# ---------------------------------------------------------------------- creation


def _filled(shape: Any, dtype: Any, value: Any, order: str, label: str) -> ndarray:
    out = empty(shape, dtype, order)
    assign(out, value, label)
    return out


@register
def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """Return an array of zeros (a fill kernel on the current stream)."""
    return _filled(shape, dtype, 0, order, "zeros")


@register
def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """Return an array of ones (a fill kernel on the current stream)."""
    return _filled(shape, dtype, 1, order, "ones")


@register
def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    """Return an array filled with ``fill_value``."""
    if dtype is None:
        dtype = (fill_value.dtype if isinstance(fill_value, ndarray)
                 else np.array(fill_value).dtype)
    return _filled(shape, dtype, fill_value, order, "full")


def _like(a: Any, dtype: Any, shape: Any) -> tuple[Any, Any]:
    a = _require_array("*_like", a)
    return (a.shape if shape is None else shape), (a.dtype if dtype is None else dtype)


@register
def empty_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
               shape: Any = None) -> ndarray:
    """Return an uninitialised array shaped like ``a``."""
    shape, dtype = _like(a, dtype, shape)
    return empty(shape, dtype)


@register
def zeros_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
               shape: Any = None) -> ndarray:
    """Return zeros shaped like ``a``."""
    shape, dtype = _like(a, dtype, shape)
    return zeros(shape, dtype)


@register
def ones_like(a: Any, dtype: Any = None, order: str = "K", subok: Any = None,
              shape: Any = None) -> ndarray:
    """Return ones shaped like ``a``."""
    shape, dtype = _like(a, dtype, shape)
    return ones(shape, dtype)


@register
def full_like(a: Any, fill_value: Any, dtype: Any = None, order: str = "K", subok: Any = None,
              shape: Any = None) -> ndarray:
    """Return ``fill_value`` everywhere, shaped like ``a``."""
    shape, dtype = _like(a, dtype, shape)
    return full(shape, fill_value, dtype)


def _generated(label: str, values: np.ndarray) -> ndarray:
    """Return a device array whose kernel writes ``values`` (computed from scalars only)."""
    out = empty(values.shape, values.dtype)
    _kernel.launch(label, lambda dst: dst.__setitem__(Ellipsis, values), [], [out])
    return out


@register
def arange(start: Any, stop: Any = None, step: Any = 1, dtype: Any = None) -> ndarray:
    """Return evenly spaced values in [start, stop) (numpy.arange's rules)."""
    return _generated("kernel arange", np.arange(start, stop, step, dtype=dtype))


@register
def linspace(start: Any, stop: Any, num: int = 50, endpoint: bool = True, retstep: bool = False,
             dtype: Any = None, axis: int = 0) -> Any:
    """Return ``num`` evenly spaced values from start to stop (numpy.linspace's rules)."""
    values = np.linspace(start, stop, num, endpoint, retstep, dtype, axis)
    if retstep:
        return _generated("kernel linspace", values[0]), values[1]
    return _generated("kernel linspace", values)


@register
def eye(N: int, M: int | None = None, k: int = 0, dtype: Any = float,  # noqa: N803
        order: str = "C") -> ndarray:
    """Return a 2-D array with ones on diagonal ``k``."""
    return _generated("kernel eye", np.eye(N, M, k, dtype=dtype))


@register
def tri(N: int, M: int | None = None, k: int = 0, dtype: Any = float) -> ndarray:  # noqa: N803
    """Return a 2-D array with ones at and below diagonal ``k``."""
    return _generated("kernel tri", np.tri(N, M, k, dtype=dtype))


@register
def array(obj: Any, dtype: Any = None, copy: bool | None = True, order: str = "K",
          subok: bool = False, ndmin: int = 0, *, blocking: bool = False) -> ndarray:
    """Return a device array made from ``obj`` (a device array, or anything numpy accepts).

    Host data are copied on the current stream: a page-locked source is read when the copy
    runs (writing it earlier is a race, as CuPy's docs warn), a pageable one is staged now.
    """
    if isinstance(obj, ndarray):
        result = obj
        if dtype is not None and normalize_dtype(dtype) != obj.dtype:
            if copy is False:
                raise ValueError("Unable to avoid copy while creating an array as requested.")
            result = obj.astype(dtype)
        elif copy or obj.device.id != _engine.current_device_id():
            if copy is False:
                raise ValueError("Unable to avoid copy while creating an array as requested.")
            result = _copy_across(obj)
        while result.ndim < ndmin:
            result = result[None]
        return result
    if copy is False:
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    if isinstance(obj, (list, tuple)) and any(isinstance(x, ndarray) for x in obj):
        return stack([array(x, dtype) for x in obj])
    host = np.array(obj, dtype=dtype, copy=None, ndmin=ndmin)
    normalize_dtype(host.dtype)
    order = "F" if order in ("F", "A", "K") and host.flags.f_contiguous and host.ndim > 1 else "C"
    out = empty(host.shape, host.dtype, order)
    if out.size:
        _kernel.copy_to_device(host, out, blocking=blocking)
    return out


def _copy_across(a: ndarray, order: str = "C") -> ndarray:
    """Copy ``a`` (on any device) to a new array on the current device."""
    out = empty(a.shape, a.dtype, "F" if order == "F" else "C")
    if a._storage.device == out._storage.device:
        assign(out, a, "copy")
        return out
    # cudaMemcpyPeerAsync on the current stream: "asynchronous with respect to the host and
    # all work on other devices", so the source's writers must be ordered by the caller
    spec_src, spec_dst = a._spec(), out._spec()

    def peer_copy() -> None:
        dst = spec_dst[0].view(*spec_dst[1:])
        dst[...] = spec_src[0].view(*spec_src[1:])

    _engine.enqueue(current_queue(), peer_copy, "peer copy",
                    regions=[a._region(False), out._region(True)])
    return out


@register
def asarray(a: Any, dtype: Any = None, order: Any = None, *, copy: bool | None = None,
            blocking: bool = False) -> ndarray:
    """Return ``a`` as a device array (no copy if it already is one of that dtype)."""
    return array(a, dtype, copy=copy, order=order or "K", blocking=blocking)


@register
def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    """Return a C-contiguous array (``a`` itself when it already is one)."""
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else a.copy()


@register
def copy(a: Any, order: str = "K") -> ndarray:
    """Return a copy of ``a`` on the current device."""
    a = _require_array("copy", a)
    if order in ("A", "K"):
        order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    return _copy_across(a, order)


@register
def copyto(dst: Any, src: Any, casting: str = "same_kind", where: Any = None) -> None:
    """Copy ``src`` into ``dst`` with broadcasting (numpy.copyto's casting rule)."""
    dst = _require_array("copyto", dst)
    if isinstance(src, np.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.squeeze()[()]
    if isinstance(src, ndarray):
        if not np.can_cast(src.dtype, dst.dtype, casting):
            raise TypeError(f"Cannot cast {src.dtype} to {dst.dtype} in {casting} casting mode")
    elif isinstance(src, _kernel.SCALAR_TYPES):
        np.copyto(np.empty((), dst.dtype), src, casting=casting)
    else:
        raise TypeError(f"Unsupported type {type(src)}")
    if where is not None:
        elementwise(np.where, "copyto", (where, src, dst), dst, has_out=False)
        return
    assign(dst, src, "copyto")


@register
def astype(x: Any, dtype: Any, /, *, copy: bool = True) -> ndarray:
    """Return ``x`` converted to ``dtype``."""
    return _require_array("astype", x).astype(dtype, copy=copy)


# ---------------------------------------------------------------------- shapes and layout


@register
def shape(a: Any) -> tuple[int, ...]:
    """Return the shape of ``a``."""
    return a.shape if isinstance(a, ndarray) else np.shape(a)


@register
def ndim(a: Any) -> int:
    """Return the number of axes of ``a``."""
    return a.ndim if isinstance(a, ndarray) else np.ndim(a)


@register
def size(a: Any, axis: int | None = None) -> int:
    """Return the number of elements of ``a`` (along ``axis``)."""
    return a.size if axis is None else a.shape[axis]


@register
def reshape(a: Any, newshape: Any, order: str = "C") -> ndarray:
    """Return ``a`` reshaped (a view when possible)."""
    return _require_array("reshape", a).reshape(newshape, order=order)


@register
def ravel(a: Any, order: str = "C") -> ndarray:
    """Return ``a`` flattened (a view when possible)."""
    return _require_array("ravel", a).ravel(order)


@register
def transpose(a: Any, axes: Any = None) -> ndarray:
    """Return ``a`` with axes permuted (a view)."""
    return _require_array("transpose", a).transpose(axes)


@register
def swapaxes(a: Any, axis1: int, axis2: int) -> ndarray:
    """Return ``a`` with two axes exchanged (a view)."""
    return _require_array("swapaxes", a).swapaxes(axis1, axis2)


@register
def squeeze(a: Any, axis: Any = None) -> ndarray:
    """Return ``a`` without length-1 axes (a view)."""
    return _require_array("squeeze", a).squeeze(axis)


@register
def expand_dims(a: Any, axis: Any) -> ndarray:
    """Return ``a`` with new length-1 axes (a view)."""
    a = _require_array("expand_dims", a)
    return a._from_shadow(np.expand_dims(a._shadow(), axis))


@register
def broadcast_to(array: Any, shape: Any) -> ndarray:
    """Return a view of ``array`` broadcast to ``shape`` (repeated elements share memory)."""
    array = _require_array("broadcast_to", array)
    return array._from_shadow(np.broadcast_to(array._shadow(), shape))


def as_strided(x: Any, shape: Any = None, strides: Any = None) -> ndarray:
    """Return a view of ``x`` with the given shape and strides (no bounds are implied).

    Stricter than CuPy: a view that reaches outside the allocation raises ValueError (on a GPU
    it reads other allocations' data or faults).
    """
    x = _require_array("as_strided", x)
    view = x._from_shadow(np.lib.stride_tricks.as_strided(x._shadow(), shape, strides))
    lo, hi = view._extent()
    if view.size and (lo < 0 or hi > x._storage.nbytes):
        raise ValueError(f"as_strided: the view reaches outside its allocation; got bytes "
                         f"[{lo}, {hi}), expected within [0, {x._storage.nbytes})")
    return view


@register
def concatenate(arrays: Sequence[Any], axis: int | None = 0, out: Any = None,
                dtype: Any = None, casting: str = "same_kind") -> ndarray:
    """Join arrays along an existing axis."""
    arrays = [_require_array("concatenate", a) for a in arrays]
    shape = np.concatenate([np.empty(a.shape, "V0") for a in arrays], axis).shape
    return _joined("concatenate", np.concatenate, arrays, shape, out, dtype, casting, axis=axis)


@register
def stack(arrays: Sequence[Any], axis: int = 0, out: Any = None, *, dtype: Any = None,
          casting: str = "same_kind") -> ndarray:
    """Join arrays along a new axis."""
    arrays = [_require_array("stack", a) for a in arrays]
    shape = np.stack([np.empty(a.shape, "V0") for a in arrays], axis).shape
    return _joined("stack", np.stack, arrays, shape, out, dtype, casting, axis=axis)


def _joined(name: str, np_fn: Callable[..., Any], arrays: list[ndarray],
            shape: tuple[int, ...], out: Any, dtype: Any, casting: str, **kwargs: Any) -> ndarray:
    result = np.result_type(*(a.dtype for a in arrays)) if dtype is None else np.dtype(dtype)
    for a in arrays:
        if not np.can_cast(a.dtype, result, casting):
            raise TypeError(f"{name}: cannot cast {a.dtype} to {result} with casting "
                            f"{casting!r}")
    out = empty(shape, result) if out is None else _check_out(name, out, shape)

    def kernel(*views: np.ndarray) -> None:
        np_fn(list(views[:-1]), out=views[-1], casting="unsafe", **kwargs)

    _kernel.launch(f"kernel {name}", kernel, arrays, [out])
    return out


@register
def where(condition: Any, x: Any = None, y: Any = None) -> Any:
    """Return elements of x where ``condition`` holds, else of y (one argument: nonzero)."""
    if x is None and y is None:
        return nonzero(condition)
    if x is None or y is None:
        raise ValueError("Must provide both 'x' and 'y' or neither.")
    return elementwise(np.where, "where", (condition, x, y), None, has_out=False)


@register
def clip(a: Any, a_min: Any = None, a_max: Any = None, out: Any = None, **kwargs: Any) -> ndarray:
    """Return ``a`` limited to [a_min, a_max]."""
    return elementwise(np.clip, "clip", (a, a_min, a_max), out, **kwargs)


@register
def nonzero(a: Any) -> tuple[ndarray, ...]:
    """Return the indices of non-zero elements (a host synchronisation, as in CuPy)."""
    host = _require_array("nonzero", a).get()
    return tuple(array(index) for index in np.nonzero(host))


@register
def unique(ar: Any, return_index: bool = False, return_inverse: bool = False,
           return_counts: bool = False, axis: int | None = None, *,
           equal_nan: bool = True) -> Any:
    """Return the sorted unique elements, and the index, inverse and counts asked for.

    reference/generated/cupy.unique.html: numpy.unique's arguments and results. The result's
    size depends on the data, so the host waits for the stream (as for nonzero).
    """
    host = _require_array("unique", ar).get()
    found = np.unique(host, return_index, return_inverse, return_counts, axis,
                      equal_nan=equal_nan)
    return tuple(array(x) for x in found) if isinstance(found, tuple) else array(found)


@register
def pad(array: Any, pad_width: Any, mode: str = "constant", **kwargs: Any) -> ndarray:
    """Return ``array`` padded (numpy.pad's modes and arguments)."""
    array = _require_array("pad", array)
    widths = np.broadcast_to(np.asarray(pad_width, dtype=np.intp), (array.ndim, 2))
    shape = tuple(int(d + lo + hi) for d, (lo, hi) in zip(array.shape, widths, strict=True))
    out = empty(shape, array.dtype)
    _kernel.launch("kernel pad", lambda src, dst: dst.__setitem__(
        Ellipsis, np.pad(src, pad_width, mode, **kwargs)), [array], [out])
    return out


# ---------------------------------------------------------------------- host interplay


@register
def asnumpy(a: Any, stream: Any = None, order: str = "C", out: np.ndarray | None = None, *,
            blocking: bool = True) -> np.ndarray:
    """Return a host array: ``a.get(...)`` for a device array, else numpy.asarray(a)."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is None:
        return np.asarray(a, order=order)
    out[...] = a
    return out


@register
def get_array_module(*args: Any) -> Any:
    """Return the stand-in cupy module if any argument is a device array, else numpy."""
    if any(isinstance(a, ndarray) for a in args):
        import cupy

        return cupy
    return np
