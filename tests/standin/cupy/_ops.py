"""The stand-in's cupy functions: one registry, numpy doing the arithmetic inside kernels.

Imports numpy and the stand-in's _engine, _kernel and _ndarray. Every function here enqueues
kernels on the current stream and returns at once; output shapes and dtypes are worked out at
enqueue time (numpy's own rules, applied to 0-d or one-element stand-ins of the operands, so
NEP 50 promotion, casting errors and axis errors surface where CuPy raises them).

The creation, layout and host routines live in ``_routines``. Adding a documented CuPy
function is one line:

- an elementwise function that numpy has as a ufunc: its name in ``UFUNC_NAMES``;
- a reduction with numpy's (axis, dtype, out, keepdims) signature: its name in ``REDUCTIONS``;
- anything else: a function decorated with ``@register``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _kernel
from ._ndarray import ndarray, normalize_dtype

FUNCTIONS: dict[str, Callable[..., Any]] = {}
UFUNCS: dict[str, ufunc] = {}

UFUNC_NAMES = (
    "add", "subtract", "multiply", "divide", "true_divide", "floor_divide", "power", "remainder",
    "mod", "negative", "positive", "absolute", "fabs", "sign", "square", "reciprocal", "sqrt",
    "cbrt", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan",
    "arcsin", "arccos", "arctan", "arctan2", "hypot", "sinh", "cosh", "tanh", "arcsinh",
    "arccosh", "arctanh", "maximum", "minimum", "fmax", "fmin", "greater", "greater_equal",
    "less", "less_equal", "equal", "not_equal", "logical_and", "logical_or", "logical_xor",
    "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor", "invert", "left_shift",
    "right_shift", "isfinite", "isnan", "isinf", "floor", "ceil", "trunc", "rint", "signbit",
    "copysign",
)
REDUCTIONS = ("sum", "prod", "max", "min", "amax", "amin", "mean", "var", "std", "argmax",
              "argmin", "any", "all")


def register(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``fn`` to the cupy namespace under its own name."""
    FUNCTIONS[fn.__name__] = fn
    return fn


def _operand(value: Any) -> Any:
    if isinstance(value, (ndarray, *_kernel.SCALAR_TYPES)):
        return value
    raise TypeError(f"Unsupported type {type(value)}")  # CuPy's words (numpy arrays included)


def _require_array(api: str, value: Any) -> ndarray:
    if not isinstance(value, ndarray):
        raise TypeError(f"{api}: expected a cupy.ndarray; got {type(value).__name__} (move host "
                        f"data with cupy.asarray first)")
    return value


def _dummy(value: Any) -> Any:
    """A 0-d numpy stand-in with the operand's dtype (scalars stay scalars: NEP 50)."""
    return np.zeros((), value.dtype) if isinstance(value, ndarray) else value


def _quietly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _check_out(api: str, out: Any, shape: tuple[int, ...]) -> ndarray:
    out = _require_array(f"{api} out", out)
    if out.shape != shape:
        raise ValueError(f"{api}: out has the wrong shape; got {out.shape}, expected {shape}")
    return out


def elementwise(fn: Callable[..., Any], name: str, args: Sequence[Any], out: Any,
                nout: int = 1, *, has_out: bool = True, **kwargs: Any) -> Any:
    """Apply numpy's elementwise ``fn`` to device operands in a kernel; return the output(s).

    ``has_out=False`` is for functions without ``out=`` (numpy.where): the kernel assigns
    their result into the output with numpy's unsafe casting.
    """
    operands = [_operand(a) for a in args]
    arrays = [a for a in operands if isinstance(a, ndarray)]
    shape = np.broadcast_shapes(*(a.shape for a in arrays)) if arrays else ()
    dummies = [_dummy(a) for a in operands]
    if out is None:
        found = _quietly(fn, *dummies, **kwargs)
        dtypes = [np.asarray(r).dtype for r in (found if nout > 1 else (found,))]
        outs = tuple(empty(shape, dt) for dt in dtypes)
    else:
        outs = tuple(out) if isinstance(out, tuple) else (out,)
        outs = tuple(_check_out(name, o, shape) for o in outs)
        tiny = tuple(np.zeros((), o.dtype) for o in outs)
        if has_out:
            _quietly(fn, *dummies, out=tiny if nout > 1 else tiny[0], **kwargs)  # casting
    # the kernel keeps scalars only: a queued kernel must not keep arrays (and their memory)
    # alive, or freeing an array another stream still uses would go unnoticed
    scalars = [None if isinstance(a, ndarray) else a for a in operands]
    slots = [isinstance(a, ndarray) for a in operands]
    count = len(arrays)
    del operands

    def kernel(*views: np.ndarray) -> None:
        it = iter(views[:count])
        values = [next(it) if is_array else a for a, is_array in zip(scalars, slots, strict=True)]
        targets = views[count:]
        if has_out:
            fn(*values, out=targets if nout > 1 else targets[0], **kwargs)
        else:
            targets[0][...] = fn(*values, **kwargs)

    _kernel.launch(f"kernel {name}", kernel, arrays, outs)
    return outs if nout > 1 else outs[0]


class ufunc:  # noqa: N801 (CuPy's name)
    """An elementwise function (cupy.ufunc): ``f(*inputs, out=None, dtype=None, casting=...)``."""

    def __init__(self, np_ufunc: np.ufunc) -> None:
        self._np = np_ufunc
        self.__name__ = np_ufunc.__name__
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout
        self.__doc__ = f"Elementwise {self.__name__} on the device (numpy.{self.__name__})."

    def __repr__(self) -> str:
        return f"<ufunc '{self.__name__}'>"

    def __call__(self, *args: Any, out: Any = None, dtype: Any = None,
                 casting: str = "same_kind") -> Any:
        if len(args) != self.nin:
            raise TypeError(f"{self.__name__}: wrong number of arguments; got {len(args)}, "
                            f"expected {self.nin}")
        extra = {} if dtype is None else {"dtype": normalize_dtype(dtype)}
        return elementwise(self._np, self.__name__, args, out, self.nout, casting=casting,
                           **extra)


for _name in UFUNC_NAMES:
    UFUNCS[_name] = FUNCTIONS[_name] = ufunc(getattr(np, _name))
UFUNCS["abs"] = FUNCTIONS["abs"] = UFUNCS["absolute"]


def _reduced_shape(shape: tuple[int, ...], axis: Any, keepdims: bool) -> tuple[int, ...]:
    axes = (range(len(shape)) if axis is None
            else np.lib.array_utils.normalize_axis_tuple(axis, len(shape)))
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _make_reduction(name: str) -> Callable[..., Any]:
    np_fn = getattr(np, name)

    def reduction(a: Any, axis: Any = None, dtype: Any = None, out: Any = None,
                  keepdims: bool = False, **kwargs: Any) -> ndarray:
        a = _require_array(name, a)
        options = dict(kwargs, axis=axis, keepdims=keepdims)
        if dtype is not None:
            options["dtype"] = normalize_dtype(dtype)
        tiny = np.zeros(tuple(min(d, 1) for d in a.shape), a.dtype)
        found = np.asarray(_quietly(np_fn, tiny, **options))  # axis/dtype errors raise here
        shape = _reduced_shape(a.shape, axis, keepdims)
        if out is None:
            out = empty(shape, found.dtype)
        else:
            out = _check_out(name, out, shape)
            _quietly(np_fn, tiny, out=np.zeros(found.shape, out.dtype), **options)

        def kernel(src: np.ndarray, dst: np.ndarray) -> None:
            np_fn(src, out=dst, **options)

        _kernel.launch(f"kernel {name}", kernel, [a], [out])
        return out

    reduction.__name__ = name
    reduction.__doc__ = f"Reduce with numpy.{name}'s rules, on the device."
    return reduction


for _name in REDUCTIONS:
    FUNCTIONS[_name] = _make_reduction(_name)


# ---------------------------------------------------------------------- core kernels


@register
def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    """Return an uninitialised array (its bytes are garbage until written)."""
    return ndarray(shape, dtype, order=order)


def assign(dst: ndarray, value: Any, label: str) -> None:
    """Enqueue ``dst[...] = value`` (numpy's unsafe casting and broadcasting)."""
    if isinstance(value, ndarray):
        np.broadcast_to(np.empty(value.shape, "V0"), dst.shape)  # numpy's broadcast error
        _kernel.launch(f"kernel {label}", lambda s, d: d.__setitem__(Ellipsis, s), [value],
                       [dst])
        return
    if isinstance(value, _kernel.SCALAR_TYPES):
        _quietly(np.zeros((), dst.dtype).__setitem__, Ellipsis, value)  # conversion errors
        _kernel.launch(f"kernel {label}", lambda d: d.__setitem__(Ellipsis, value), [], [dst])
        return
    from ._routines import array

    assign(dst, array(value), label)


# ---------------------------------------------------------------------- linear algebra


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ValueError("matmul: Input operand does not have enough dimensions")
    a2, b2 = (1, *a) if len(a) == 1 else a, (*b, 1) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul: Input operand 1 has a mismatch in its core dimension 0, "
                         f"with gufunc signature (n?,k),(k,m?)->(n?,m?) (size {b2[-2]} is "
                         f"different from {a2[-1]})")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    return (*batch, *a2[-2:-1][: len(a) > 1], *b2[-1:][: len(b) > 1])


@register
def matmul(a: Any, b: Any, out: Any = None, **kwargs: Any) -> ndarray:
    """Return the matrix product (numpy.matmul's broadcasting and 1-D rules)."""
    a, b = _require_array("matmul", a), _require_array("matmul", b)
    shape = _matmul_shape(a.shape, b.shape)
    dtype = np.matmul(np.zeros((1, 1), a.dtype), np.zeros((1, 1), b.dtype)).dtype
    if out is None:
        out = empty(shape, dtype)
    else:
        out = _check_out("matmul", out, shape)
        np.matmul(np.zeros((1, 1), a.dtype), np.zeros((1, 1), b.dtype),
                  out=np.zeros((1, 1), out.dtype), **kwargs)
    _kernel.launch("kernel matmul", lambda x, y, z: np.matmul(x, y, out=z, **kwargs), [a, b],
                   [out])
    return out


@register
def dot(a: Any, b: Any, out: Any = None) -> ndarray:
    """Return the dot product (numpy.dot's rules, including its demands on ``out``)."""
    a, b = _require_array("dot", a), _require_array("dot", b)
    if a.ndim == 0 or b.ndim == 0:
        return UFUNCS["multiply"](a, b, out=out)
    k = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if a.shape[-1] != k:
        raise ValueError(f"shapes {a.shape} and {b.shape} not aligned: {a.shape[-1]} (dim "
                         f"{a.ndim - 1}) != {k} (dim {max(b.ndim - 2, 0)})")
    shape = (*a.shape[:-1], *b.shape[:-2], *b.shape[-1:][: b.ndim > 1])
    dtype = np.dot(np.zeros(1, a.dtype), np.zeros(1, b.dtype)).dtype
    if out is None:
        out = empty(shape, dtype)
    elif (not isinstance(out, ndarray) or out.dtype != dtype or out.shape != shape
          or not out.flags.c_contiguous):
        raise ValueError("output array is not acceptable (must have the right datatype, number "
                         "of dimensions, and be a C-Array)")
    _kernel.launch("kernel dot", lambda x, y, z: np.dot(x, y, out=z), [a, b], [out])
    return out
