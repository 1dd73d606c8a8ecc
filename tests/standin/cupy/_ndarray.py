"""cupy.ndarray of the stand-in: device arrays whose bytes the host cannot read directly.

Imports the stand-in's _engine, _kernel, _memory, cuda.memory/device/stream, and (at the end)
_ops and _indexing for operators, reductions and indexing. Modeled on cupy.ndarray
(https://docs.cupy.dev/en/stable/reference/generated/cupy.ndarray.html and CuPy's
cupy/_core/core.pyx):

- The data reach the host only through ``get`` / ``cupy.asnumpy`` (and what calls them:
  ``item``, ``tolist``, ``float()``, ``int()``, ``bool()``, ``repr``), which copy on the current
  (or given) stream and, when ``blocking``, wait for that stream only.
- ``__array__`` raises TypeError, as CuPy does ("Implicit conversion to a NumPy array is not
  allowed"); there is no buffer protocol or ``__array_interface__``; numpy functions work only
  through ``__array_ufunc__`` / ``__array_function__`` where the stand-in has the function, as
  in CuPy, and operands that are numpy arrays are refused ("Unsupported type").
- ``__cuda_array_interface__`` and ``__dlpack__`` raise TypeError: a stand-in device pointer
  handed to MPI would be read as host memory (the PyPI MPI wheels are not CUDA-aware).
- Views (basic indexing, reshape of contiguous data, ravel, transpose, ``.T``) share memory;
  ``.data.ptr`` is base + offset, stable and unique per allocation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _engine, _kernel, _memory
from .cuda import memory
from .cuda.memory import Memory, MemoryPointer
from .cuda.stream import _BaseStream, current_queue


def normalize_dtype(dtype: Any) -> np.dtype:
    """Return ``dtype`` as a numpy dtype CuPy supports, else raise ValueError."""
    dt = np.dtype(dtype)
    if dt.kind in "biufc" or dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return dt
    raise ValueError(f"Unsupported dtype {dt}")


def normalize_shape(shape: Any) -> tuple[int, ...]:
    """Return ``shape`` as a tuple of non-negative ints."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dims = tuple(int(operator_index(d)) for d in dims)
    if any(d < 0 for d in dims):
        raise ValueError("negative dimensions are not allowed")
    return dims


def operator_index(value: Any) -> int:
    """Return ``value`` as an int if it is integral (like ``operator.index``)."""
    import operator

    return operator.index(value)


def contiguous_strides(shape: tuple[int, ...], itemsize: int, order: str) -> tuple[int, ...]:
    """Return C (order "C") or Fortran (order "F") strides."""
    strides, step = [], itemsize
    dims = shape if order == "F" else shape[::-1]
    for d in dims:
        strides.append(step)
        step *= max(d, 1)
    return tuple(strides if order == "F" else strides[::-1])


class Flags:
    """Memory layout flags of an array (``c_contiguous``, ``f_contiguous``, ``owndata``)."""

    def __init__(self, c_contiguous: bool, f_contiguous: bool, owndata: bool) -> None:
        self.c_contiguous, self.f_contiguous, self.owndata = c_contiguous, f_contiguous, owndata

    def __getitem__(self, name: str) -> bool:
        key = {"C_CONTIGUOUS": "c_contiguous", "F_CONTIGUOUS": "f_contiguous",
               "OWNDATA": "owndata"}.get(name)
        if key is None:
            raise KeyError(name)
        return getattr(self, key)

    def __repr__(self) -> str:
        return (f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n"
                f"  OWNDATA : {self.owndata}")


def _queue_of(stream: Any) -> _engine.Queue:
    if stream is None:
        return current_queue()
    if not isinstance(stream, _BaseStream):
        raise TypeError(f"stream must be a cupy.cuda.Stream; got {type(stream).__name__}")
    return stream._queue()


class ndarray:  # noqa: N801 (CuPy's name)
    """Multi-dimensional array on a (modeled) CUDA device; see the module docstring."""

    __slots__ = ("__weakref__", "_alloc", "_base", "_dtype", "_offset", "_shape", "_storage",
                 "_strides")
    __array_priority__ = 100

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
                 strides: Any = None, order: str = "C") -> None:
        shape = normalize_shape(shape)
        dt = normalize_dtype(dtype)
        if order not in ("C", "F"):
            raise ValueError(f"order not understood; got {order!r}, expected 'C' or 'F'")
        nbytes = math.prod(shape) * dt.itemsize
        if memptr is None:  # new memory, from the current allocator (cupy.cuda.alloc)
            memptr = memory.alloc(nbytes)
            alloc, offset = memptr.mem._allocation, memptr._offset
            memptr = None  # the layout checks below are for a caller's memptr
        else:
            alloc, offset = memptr.mem._allocation, memptr._offset
        strides = (contiguous_strides(shape, dt.itemsize, order) if strides is None
                   else tuple(int(s) for s in strides))
        self._set(alloc, offset, shape, strides, dt, None)
        lo, hi = self._extent()
        if memptr is not None and (lo < 0 or hi > alloc.storage.nbytes) and nbytes:
            raise ValueError(f"ndarray: the layout reaches outside the allocation; got bytes "
                             f"[{lo}, {hi}), expected within [0, {alloc.storage.nbytes})")

    def _set(self, alloc: _memory.Allocation, offset: int, shape: tuple[int, ...],
             strides: tuple[int, ...], dtype: np.dtype, base: ndarray | None) -> None:
        self._alloc, self._storage = alloc, alloc.storage
        self._offset, self._shape, self._strides, self._dtype = offset, shape, strides, dtype
        self._base = base

    @classmethod
    def _view_of(cls, owner: ndarray, offset: int, shape: tuple[int, ...],
                 strides: tuple[int, ...], dtype: np.dtype) -> ndarray:
        view = cls.__new__(cls)
        view._set(owner._alloc, offset, shape, strides, dtype,
                  owner if owner._base is None else owner._base)
        return view

    # ------------------------------------------------------------------ layout

    def _spec(self) -> tuple:
        return self._storage, self._offset, self._shape, self._strides, self._dtype

    def _extent(self) -> tuple[int, int]:
        if self.size == 0:
            return self._offset, self._offset
        lo = hi = self._offset
        for n, s in zip(self._shape, self._strides, strict=True):
            if s < 0:
                lo += (n - 1) * s
            else:
                hi += (n - 1) * s
        return lo, hi + self._dtype.itemsize

    def _region(self, write: bool) -> _engine.Region:
        lo, hi = self._extent()
        return _engine.Region(self._storage, lo, hi, write)

    def _shadow(self) -> np.ndarray:
        return self._storage.shadow(self._offset, self._shape, self._strides, self._dtype)

    def _from_shadow(self, shadow: np.ndarray) -> ndarray:
        start = self._storage.buf.__array_interface__["data"][0]
        offset = shadow.__array_interface__["data"][0] - start
        return ndarray._view_of(self, offset, shadow.shape, shadow.strides, shadow.dtype)

    # ------------------------------------------------------------------ attributes

    @property
    def shape(self) -> tuple[int, ...]:
        """Lengths of the axes."""
        return self._shape

    @shape.setter
    def shape(self, value: Any) -> None:
        dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
        try:
            shadow = self._shadow().reshape(dims, copy=False)
        except ValueError:
            raise AttributeError("Incompatible shape for in-place modification. Use "
                                 "`.reshape()` to make a copy with the desired shape.") from None
        self._shape, self._strides = shadow.shape, shadow.strides

    @property
    def dtype(self) -> np.dtype:
        """Element type."""
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes between consecutive elements along each axis."""
        return self._strides

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self._shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (size * itemsize)."""
        return self.size * self._dtype.itemsize

    @property
    def flags(self) -> Flags:
        """Contiguity and ownership flags."""
        shadow = self._shadow()
        return Flags(shadow.flags.c_contiguous, shadow.flags.f_contiguous, self._base is None)

    @property
    def data(self) -> MemoryPointer:
        """Pointer to the first element (``.data.ptr`` is its device address)."""
        return MemoryPointer(Memory(self._alloc), self._offset)

    @property
    def device(self) -> Any:
        """The Device the array is on."""
        from .cuda.device import Device

        return Device(self._storage.device)

    @property
    def base(self) -> ndarray | None:
        """The array whose memory this view shares (None for an owner)."""
        return self._base

    @property
    def T(self) -> ndarray:  # noqa: N802 (numpy's name)
        """The transposed view."""
        return self.transpose()

    # ------------------------------------------------------------------ host transfers

    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        """Return a host copy, made on ``stream`` (default: the current stream).

        With ``blocking`` the host waits for that stream up to the copy; otherwise the copy
        runs when the stream gets to it and ``out`` must not be read before then.
        """
        q = _queue_of(stream)
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if self._dtype != out.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self._dtype} array")
            if self._shape != out.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self._shape}, actual shape: "
                                 f"{out.shape}")
            if not (out.flags.c_contiguous or out.flags.f_contiguous):
                raise RuntimeError("`out` cannot be specified when copying to non-contiguous "
                                   "ndarray")
            host = out
        else:
            if self.size == 0:
                return np.ndarray(self._shape, dtype=self._dtype)
            order = order.upper()
            if order == "A":
                order = "F" if self.flags.f_contiguous else "C"
            if order not in ("C", "F"):
                raise ValueError(f"unsupported order: {order}")
            host = np.empty(self._shape, dtype=self._dtype, order=order)
            host.reshape(-1).view(np.uint8)[...] = 0xFF  # an unfinished copy leaves garbage
        if self.size:
            _kernel.copy_to_host(self, host, q=q, blocking=blocking)
        return host

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Copy host array ``arr`` into this array on ``stream`` (default: the current stream).

        Asynchronous: a page-locked ``arr`` is read when the copy runs, so it must not be
        written before the stream has passed the copy.
        """
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self._dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self._dtype} array")
        if self._shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self._shape}, new shape: "
                             f"{arr.shape}")
        if not (self.flags.c_contiguous or self.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        if self.size:
            _kernel.copy_to_device(arr, self, q=_queue_of(stream))

    def item(self) -> Any:
        """Return the only element as a Python scalar (a host synchronisation)."""
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self) -> Any:
        """Return the elements as nested Python lists (a host synchronisation)."""
        return self.get().tolist()

    def tobytes(self, order: str = "C") -> bytes:
        """Return the raw bytes (a host synchronisation)."""
        return self.get().tobytes(order)

    def __int__(self) -> int:
        return int(self.get())

    def __float__(self) -> float:
        return float(self.get())

    def __complex__(self) -> complex:
        return complex(self.get())

    def __bool__(self) -> bool:
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        return bool(self.get())

    def __repr__(self) -> str:
        return repr(self.get())

    def __str__(self) -> str:
        return str(self.get())

    def __format__(self, spec: str) -> str:
        return format(self.get(), spec)

    def __reduce__(self) -> tuple:
        from ._routines import array

        return array, (self.get(),)

    def __copy__(self) -> ndarray:
        return self.copy()

    def __deepcopy__(self, memo: dict) -> ndarray:
        return self.copy()

    # ------------------------------------------------------------------ what CuPy refuses

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    @property
    def __cuda_array_interface__(self) -> dict:
        raise TypeError("cupy stand-in: __cuda_array_interface__ is not available; its device "
                        "pointers are not real memory, and the PyPI MPI wheels are not "
                        "CUDA-aware anyway; copy to the host first (x.get(out=pinned))")

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("cupy stand-in: __dlpack__ is not available (device memory cannot be "
                        "exported); copy to the host first with x.get()")

    def __dlpack_device__(self) -> tuple[int, int]:
        return 2, self._storage.device  # kDLCUDA

    def __iter__(self) -> Any:
        if not self._shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._shape[0]))

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of unsized object")
        return self._shape[0]

    # ------------------------------------------------------------------ numpy protocols

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any,
                        **kwargs: Any) -> Any:
        found = _ops.UFUNCS.get(ufunc.__name__)
        if method != "__call__" or found is None:
            return NotImplemented
        if "out" in kwargs:
            out = kwargs["out"]
            if isinstance(out, tuple):
                if len(out) != 1:
                    raise ValueError("The 'out' parameter must have exactly one array value")
                kwargs["out"] = out[0]
        return found(*inputs, **kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func.__module__.split(".")[1:]:  # numpy.linalg.norm, numpy.fft.fft, ...
            return NotImplemented
        found = _ops.FUNCTIONS.get(func.__name__)
        if found is None or not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return found(*args, **kwargs)

    # ------------------------------------------------------------------ views

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        """Return the data with a new shape: a view when the layout allows, else a copy."""
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        try:
            return self._from_shadow(self._shadow().reshape(shape, order=order, copy=False))
        except ValueError as error:
            if "copy" not in str(error):
                raise
        return self.copy(order=order).reshape(shape, order=order)

    def ravel(self, order: str = "C") -> ndarray:
        """Return a 1-D view when the layout allows, else a copy."""
        return self.reshape(-1, order=order)

    def flatten(self, order: str = "C") -> ndarray:
        """Return a 1-D copy."""
        return self.copy(order=order).reshape(-1, order=order)

    def transpose(self, *axes: Any) -> ndarray:
        """Return the view with axes permuted (reversed by default)."""
        if len(axes) == 1 and (axes[0] is None or not isinstance(axes[0], (int, np.integer))):
            axes = axes[0]
        return self._from_shadow(self._shadow().transpose(axes or None))

    def swapaxes(self, axis1: int, axis2: int) -> ndarray:
        """Return the view with two axes exchanged."""
        return self._from_shadow(self._shadow().swapaxes(axis1, axis2))

    def squeeze(self, axis: Any = None) -> ndarray:
        """Return the view without length-1 axes."""
        return self._from_shadow(self._shadow().squeeze(axis))

    def view(self, dtype: Any = None) -> ndarray:
        """Return the view of the same bytes as another dtype."""
        if dtype is None:
            return self._from_shadow(self._shadow())
        return self._from_shadow(self._shadow().view(normalize_dtype(dtype)))

    # ------------------------------------------------------------------ kernels

    def copy(self, order: str = "C") -> ndarray:
        """Return a copy on the current device (a kernel on the current stream)."""
        return _routines.copy(self, order=order)

    def astype(self, dtype: Any, order: str = "K", casting: str | None = None,
               subok: Any = None, copy: bool = True) -> ndarray:
        """Return the elements converted to ``dtype`` (self if no copy is needed and allowed)."""
        dt = normalize_dtype(dtype)
        if not copy and dt == self._dtype:
            return self
        if casting is not None and not np.can_cast(self._dtype, dt, casting):
            raise TypeError(f"Cannot cast array data from {self._dtype!r} to {dt!r} according "
                            f"to the rule {casting!r}")
        out = _ops.empty(self._shape, dt, order="F" if order == "F" else "C")
        _ops.assign(out, self, "astype")
        return out

    def fill(self, value: Any) -> None:
        """Set every element to ``value`` (a kernel on the current stream)."""
        _ops.assign(self, value, "fill")

    def __getitem__(self, key: Any) -> ndarray:
        return _indexing.getitem(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _indexing.setitem(self, key, value)

    def dot(self, b: ndarray, out: ndarray | None = None) -> ndarray:
        """Return the dot product with ``b``."""
        return _ops.dot(self, b, out=out)

    def __matmul__(self, other: Any) -> Any:
        return _binary(_ops.matmul, self, other)

    def __rmatmul__(self, other: Any) -> Any:
        return _binary(_ops.matmul, other, self)

    def __neg__(self) -> ndarray:
        return _ops.UFUNCS["negative"](self)

    def __pos__(self) -> ndarray:
        return _ops.UFUNCS["positive"](self)

    def __abs__(self) -> ndarray:
        return _ops.UFUNCS["absolute"](self)

    def __invert__(self) -> ndarray:
        return _ops.UFUNCS["invert"](self)

    __hash__ = None  # type: ignore[assignment]


def _binary(fn: Any, a: Any, b: Any, **kwargs: Any) -> Any:
    other = b if isinstance(a, ndarray) else a
    if not isinstance(other, (ndarray, *_kernel.SCALAR_TYPES)):
        if isinstance(other, np.ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        return NotImplemented
    return fn(a, b, **kwargs)


def _install_operators() -> None:
    pairs = {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
             "floordiv": "floor_divide", "mod": "remainder", "pow": "power",
             "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
             "lshift": "left_shift", "rshift": "right_shift"}
    for short, name in pairs.items():
        def forward(self: ndarray, other: Any, name: str = name) -> Any:
            return _binary(_ops.UFUNCS[name], self, other)

        def reflected(self: ndarray, other: Any, name: str = name) -> Any:
            return _binary(_ops.UFUNCS[name], other, self)

        def inplace(self: ndarray, other: Any, name: str = name) -> Any:
            result = _binary(_ops.UFUNCS[name], self, other, out=self)
            return self if result is not NotImplemented else result

        setattr(ndarray, f"__{short}__", forward)
        setattr(ndarray, f"__r{short}__", reflected)
        setattr(ndarray, f"__i{short}__", inplace)
    for short, name in {"lt": "less", "le": "less_equal", "gt": "greater",
                        "ge": "greater_equal", "eq": "equal", "ne": "not_equal"}.items():
        def compare(self: ndarray, other: Any, name: str = name) -> Any:
            return _binary(_ops.UFUNCS[name], self, other)

        setattr(ndarray, f"__{short}__", compare)
    for name in ("sum", "prod", "max", "min", "mean", "var", "std", "argmax", "argmin", "any",
                 "all", "clip", "nonzero"):
        def method(self: ndarray, *args: Any, name: str = name, **kwargs: Any) -> Any:
            return _ops.FUNCTIONS[name](self, *args, **kwargs)

        method.__name__ = name
        method.__doc__ = f"See ``cupy.{name}``."
        setattr(ndarray, name, method)


from . import _indexing, _ops, _routines  # noqa: E402  (they need the class defined above)

_install_operators()
