"""Argument checks shared by every backend: pure functions, no MPI, one message per mistake.

Imports numpy and meta_dist.xp only; ``comm.base`` calls these on each rank before any
communication, and the unit tests call them without MPI. Each check either returns the arrays
the collective will move (contiguous, in a list) or raises ValueError / TypeError naming the
argument, what it got and what it expected.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from meta_dist.xp import array_module, data_ptr

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")
SCATTER_OPS = ("sum", "avg")
DTYPES = tuple(np.dtype(d) for d in ("float16", "float32", "float64", "int32", "int64", "uint8"))
try:  # numpy has no bfloat16; ml_dtypes (which CuPy 14 uses too) adds it where installed
    import ml_dtypes

    DTYPES += (np.dtype(ml_dtypes.bfloat16),)
except ImportError:
    pass
_DTYPE_SET = frozenset(DTYPES)


def inputs(api: str, arrays: Any) -> tuple[list[Any], bool]:
    """Return ``(arrays as a list, whether a list was given)``; non-contiguous ones are copied.

    Raises:
        TypeError: an item is not an array, has an unsupported dtype, or the dtypes differ;
            a masked array (its mask would be ignored).
        ValueError: an empty list.
    """
    if (type(arrays) is np.ndarray and arrays.dtype in _DTYPE_SET
            and arrays.flags.c_contiguous):  # the common case, decided in a few attribute reads
        return [arrays], False
    is_list = isinstance(arrays, (list, tuple))
    items = list(arrays) if is_list else [arrays]
    if not items:
        raise ValueError(f"{api}: got an empty list; expected at least one array")
    first = items[0]
    kind, dtype = type(first), getattr(first, "dtype", None)
    masked = issubclass(kind, np.ma.MaskedArray)  # its mask would be ignored
    if hasattr(first, "flags") and dtype in _DTYPE_SET and not masked and all(  # one pass
            type(a) is kind and a.dtype is dtype and a.flags.c_contiguous for a in items):
        return items, is_list
    if masked or not (hasattr(first, "shape") and hasattr(first, "flags") and dtype in _DTYPE_SET
                      and all(same_kind(a, first) and a.dtype == dtype for a in items)):
        _diagnose(api, items, is_list)
    xp = array_module(first)
    return [a if a.flags.c_contiguous else xp.ascontiguousarray(a) for a in items], is_list


def _diagnose(api: str, items: list[Any], is_list: bool) -> None:
    """Raise the error that names the first item ``inputs`` cannot take."""
    for i, a in enumerate(items):
        if not hasattr(a, "dtype") or not hasattr(a, "shape") or not hasattr(a, "flags"):
            where = f" (item {i})" if is_list else ""
            raise TypeError(f"{api}: expected a numpy or cupy array{where}; got {type(a)}")
        if a.dtype not in _DTYPE_SET:
            raise TypeError(f"{api}: unsupported dtype; got {a.dtype}, expected one of "
                            f"{', '.join(str(d) for d in DTYPES)}")
        if a.dtype != items[0].dtype:
            raise TypeError(
                f"{api}: a fused list must share one dtype; got {items[0].dtype} (item 0) and "
                f"{a.dtype} (item {i}); convert them or call once per dtype")
        if not same_kind(a, items[0]):
            raise TypeError(f"{api}: a fused list must hold one kind of array; got "
                            f"{type(items[0]).__name__} (item 0) and {type(a).__name__} "
                            f"(item {i}); move them all to the host or all to the GPU")
        if isinstance(a, np.ma.MaskedArray):
            where = f" (item {i})" if is_list else ""
            raise TypeError(f"{api}: got a masked array{where}, whose mask {api} would ignore; "
                            "expected a plain array: pass a.filled(value), or np.ma.getdata(a) "
                            "for the values under the mask too")


def same_kind(a: Any, b: Any) -> bool:
    """Whether two arrays are of one type, an np.memmap counting as a numpy array.

    Other subclasses stay apart: a masked array's mask, or np.matrix's shapes, would be lost.
    """
    return type(a) is type(b) or _plain(a) is _plain(b)


def _plain(arr: Any) -> type:
    return np.ndarray if isinstance(arr, np.memmap) else type(arr)


def check_op(api: str, op: Any, allowed: tuple[str, ...], dtype: np.dtype) -> None:
    """Raise unless ``op`` is one of ``allowed`` and fits ``dtype`` ("avg" needs floats)."""
    if not isinstance(op, str) or op not in allowed:
        what = "op not supported here" if op in REDUCE_OPS else "unknown op"
        raise ValueError(f"{api}: {what}; got {op!r}, expected one of {', '.join(allowed)}"
                         + ("; use allreduce for it" if op in REDUCE_OPS else ""))
    if op == "avg" and dtype.kind != "f" and dtype.name != "bfloat16":
        raise TypeError(f"{api}: op 'avg' needs a floating dtype; got {dtype}; use op='sum' and "
                        "divide, or convert to float")


def check_rank(api: str, what: str, value: Any, size: int) -> None:
    """Raise ValueError unless ``value`` is an int rank in [0, size)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{api}: {what} is not an int; got {value!r} ({type(value).__name__}), "
                         f"expected an int with 0 <= {what} < {size}")
    if not 0 <= value < size:
        raise ValueError(f"{api}: {what} out of range; got {value!r}, expected 0 <= {what} < "
                         f"{size}")


def check_rows(api: str, sends: list[Any], size: int) -> None:
    """Raise ValueError unless every array's axis 0 divides by ``size`` (reduce_scatter)."""
    for s in sends:
        check_axis0(api, s)
        if s.shape[0] % size:
            raise ValueError(
                f"{api}: send has {s.shape[0]} rows along axis 0 (shape {s.shape}), size is "
                f"{size}; expected a multiple of {size}; pad axis 0 "
                "(meta_dist.zero.partition.padded_size) or use allreduce")


def check_axis0(api: str, send: Any) -> None:
    """Raise ValueError for a 0-d array (allgather and reduce_scatter work along axis 0)."""
    if send.ndim == 0:
        raise ValueError(f"{api}: send is 0-d; expected an array with axis 0")


def outputs(api: str, out: Any, shapes: list[tuple[int, ...]], like: list[Any],
            is_list: bool) -> list[Any]:
    """Check the given outputs for inputs ``like`` and return them as a list.

    ``out`` must mirror the input (an array, or a list of as many) with the given shapes, the
    inputs' dtype and kind, C-contiguous and writeable.
    """
    first = like[0]
    if (not is_list and type(out) is type(first) is np.ndarray and out.shape == shapes[0]
            and out.dtype == first.dtype and out.flags.c_contiguous and out.flags.writeable):
        return [out]  # the common case: one numpy array, every rule below holds
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if isinstance(out, (list, tuple)) != is_list or len(outs) != len(shapes):
        raise ValueError(
            f"{api}: out must match the input: {len(shapes)} "
            f"{'arrays in a list' if is_list else 'array'}; got {type(out).__name__} of "
            f"{len(outs)}")
    for i, (o, shape) in enumerate(zip(outs, shapes, strict=True)):
        if not hasattr(o, "shape") or not hasattr(o, "dtype") or not hasattr(o, "flags"):
            raise TypeError(f"{api}: out[{i}] is a {type(o).__name__}; expected a numpy or cupy "
                            "array, or out=None")
        if not same_kind(o, like[0]):
            raise TypeError(f"{api}: out[{i}] is a {type(o).__name__}, the input a "
                            f"{type(like[0]).__name__}; expected the same kind of array")
        if tuple(o.shape) != tuple(shape) or o.dtype != like[0].dtype:
            raise ValueError(f"{api}: out[{i}] has shape {tuple(o.shape)} and dtype {o.dtype}; "
                             f"expected shape {tuple(shape)} and dtype {like[0].dtype}")
        check_writable(api, o)
    return outs


def check_writable(api: str, arr: Any) -> None:
    """Raise ValueError unless ``arr`` is C-contiguous and writeable."""
    if not arr.flags.c_contiguous:
        raise ValueError(f"{api}: output buffer is not contiguous (shape {arr.shape}, strides "
                         f"{arr.strides}); expected a C-contiguous array; pass a contiguous copy "
                         "and copy it back")
    if not getattr(arr.flags, "writeable", True):
        raise ValueError(f"{api}: output buffer is read-only; expected a writeable array; pass "
                         "out=None or a writeable copy")


def check_alias(api: str, send: Any, out: Any, rank: int,
                address: Callable[[Any], int] = data_ptr) -> None:
    """Refuse an ``out`` that overlaps ``send`` other than the way in place is spelled.

    In place is ``out`` on exactly ``send``'s memory (allreduce, broadcast, reduce), on exactly
    this rank's rows of ``send`` (reduce_scatter), or ``send`` on exactly this rank's rows of
    ``out`` (allgather); separate memory is out of place. Any other overlap would read values
    the collective has already overwritten. ``address`` gives an array's data address (a
    backend may pass a cheaper one than ``xp.data_ptr``).
    """
    start, first = address(send), address(out)
    stop, last = start + send.nbytes, first + out.nbytes
    if last <= start or stop <= first:  # separate memory
        return
    if api == "reduce_scatter":
        allowed = first == start + rank * out.nbytes
    elif api == "allgather":
        allowed = start == first + rank * send.nbytes
    else:
        allowed = (first, last) == (start, stop)
    if not allowed:
        where, rule = {
            "reduce_scatter": ("elsewhere than this rank's rows",
                               f"out to be send[{rank}*m:{rank + 1}*m]"),
            "allgather": ("elsewhere than this rank's rows of out",
                          f"send to be out[{rank}*m:{rank + 1}*m]"),
        }.get(api, ("without being send itself", "out to be send itself"))
        raise ValueError(f"{api}: out overlaps send {where}; expected {rule} (in place) or "
                         "separate memory")


def adjacent_run(arrays: list[Any], address: Callable[[Any], int] = data_ptr) -> Any:
    """Return one flat view over arrays lying back to back in one allocation, else None.

    The view spans exactly the arrays' memory, in list order; it is how a fused collective on
    ``meta_dist.contiguous_arrays`` (or the trainer's flat buffers) moves with no copy.
    """
    owner = memory_owner(arrays[0])
    numel, end = 0, None
    for a in arrays:  # per array as little as it can be: a list may hold thousands
        if a.base is not owner and memory_owner(a) is not owner:  # numpy's views name the owner
            return None
        if a.size:
            start = address(a)
            if end is not None and start != end:
                return None
            end = start + a.nbytes
            numel += a.size
    first = next((a for a in arrays if a.size), arrays[0])
    xp = array_module(first)
    return xp.lib.stride_tricks.as_strided(flat_view(first), shape=(numel,))


def same_arrays(outs: list[Any], sends: list[Any]) -> bool:
    """Return True if ``outs`` are the very input arrays, in order (in place)."""
    return len(outs) == len(sends) and all(map(operator.is_, outs, sends))


def memory_owner(arr: Any) -> Any:
    """Return the object that owns ``arr``'s memory (views point at it through ``.base``)."""
    base = getattr(arr, "base", None)
    while base is not None:
        arr, base = base, getattr(base, "base", None)
    return arr


def flat_view(arr: Any) -> Any:
    """Return a 1-D view of a contiguous array (no copy)."""
    return arr if arr.ndim == 1 else arr.reshape(-1)
