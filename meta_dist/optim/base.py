"""Optimizer base class: the step / state / checkpoint contract that ZeRO relies on.

Leaf module: imports numpy and meta_dist.xp only; imported by optim.sgd and optim.adam (and,
through meta_dist.optim, by zero and trainer). Optimizers are pure update rules on 1-D arrays,
a rank's shard of the flat parameter buffer: they know nothing of ranks, layers or communication.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from meta_dist.xp import array_module, to_numpy

HOST_BLOCK = 16384  # elements per pass on the host: 5 float32 blocks of 64 KiB stay in L2

Array = Any  # numpy.ndarray or cupy.ndarray; the array module is whatever the optimizer was given


class Optimizer:
    """Update rule over a 1-D range of ``numel`` parameters, with its state laid out flat.

    Every state array has length ``numel``. ``step`` accepts the parameters as one array or as
    pieces laid end to end: piece i uses ``state[offset_i : offset_i + len_i]``. All arithmetic is
    elementwise, so the result is bit-identical however the range is cut into pieces, and also when
    several optimizers each own a disjoint part of it; that is what lets ZeRO shard the state.

    Subclasses set ``name``, validate their hyperparameters into attributes, call
    ``super().__init__`` with them (they are recorded for ``state_dict``), and implement
    ``_state_keys`` and ``_update``.

    Attributes:
        name: registry name of the rule ("sgd", "adam", "adamw"), stored in checkpoints.
        numel: number of parameters this optimizer updates.
        step_count: number of ``step`` calls so far.
        hyperparameters: constructor hyperparameters, as validated.
        state: state arrays by name, each 1-D of length ``numel``, allocated with ``xp``.
    """

    name: ClassVar[str] = "optimizer"

    def __init__(
        self, numel: int, *, xp: Any = np, dtype: Any = np.float32, **hyperparameters: Any
    ) -> None:
        api = type(self).__name__
        self.numel = check_numel(api, numel)
        self.dtype = check_float_dtype(api, dtype)
        self.xp = xp
        self.hyperparameters = hyperparameters
        self.step_count = 0
        self.state: dict[str, Array] = {
            key: xp.zeros(self.numel, dtype=self.dtype) for key in self._state_keys()
        }
        # One workspace reused by every step: per-step temporaries would cost an allocation and
        # a cold page walk per ufunc. Not optimizer state, so state_bytes() leaves it out.
        self._scratch = self._workspace()
        self._l2_weight_decay = 0.0
        self._decay_spans: list[tuple[int, int]] | None = None  # None: decay everywhere
        self._decayed_grad: Array | None = None
        self._grad_space: Array | None = None  # widened or scaled gradients, one block

    def _workspace(self) -> Array:
        """Allocate an uninitialised buffer for one block (workspace, not state)."""
        return self.xp.empty(min(self.numel, self._block or self.numel), dtype=self.dtype)

    @property
    def _block(self) -> int | None:
        """Elements updated per pass on the host (None on a GPU: one kernel per op is best).

        Each numpy ufunc is one pass over memory, so a block that stays in cache turns the
        rule's ~12 passes into about one (`bench train` shows the optimizer's share).
        """
        return HOST_BLOCK if self.xp is np else None

    def _use_l2_decay(self, weight_decay: float) -> None:
        """Make ``_add_l2_decay`` add ``weight_decay * param`` to the grads (if non-zero)."""
        self._l2_weight_decay = weight_decay
        # grad + weight_decay * param is needed alongside the scratch buffer (Adam's moments,
        # SGD's Nesterov term), and grads are read only, so it gets a workspace of its own.
        self._decayed_grad = self._workspace() if weight_decay != 0 else None

    def set_decay_spans(self, spans: Sequence[tuple[int, int]] | None) -> None:
        """Apply weight decay only inside these ``[start, stop)`` spans of the range.

        As nanoGPT's parameter groups: matrices decay, biases and norm weights do not. None
        (the default) decays every element, as one PyTorch parameter group does.
        """
        self._decay_spans = None if spans is None else sorted(
            (int(a), int(b)) for a, b in spans if b > a)

    def _decay_ranges(self, piece: slice) -> list[tuple[int, int]]:
        """Return where weight decay applies within ``piece``, relative to its start."""
        if self._decay_spans is None:
            return [(0, piece.stop - piece.start)]
        return [(max(a, piece.start) - piece.start, min(b, piece.stop) - piece.start)
                for a, b in self._decay_spans if a < piece.stop and piece.start < b]

    def _state_keys(self) -> tuple[str, ...]:
        """Return the names of the state arrays this configuration needs."""
        raise NotImplementedError

    def _update(self, param: Array, grad: Array, piece: slice) -> None:
        """Update one piece in place; ``piece`` locates it in the state arrays.

        The workspace arrays are one block long: use ``workspace[: piece.stop - piece.start]``.

        ``step_count`` has already been incremented for this step.
        """
        raise NotImplementedError

    def step(self, params: Array | Sequence[Array], grads: Array | Sequence[Array],
             grad_scale: float = 1.0) -> None:
        """Apply one update to ``params`` in place.

        Args:
            params: one 1-D array, or a list of 1-D arrays (pieces) laid end to end in the state.
            grads: gradients shaped like ``params`` (an array, or a list of as many pieces).
                Read only: they are never written to. They may be of a narrower floating
                dtype than the optimizer's (float16, bfloat16 working gradients under mixed
                precision): each block is then widened on the fly.
            grad_scale: multiplies every gradient first (undoing a loss scale, averaging
                accumulated micro-batches, clipping), in the same block pass.

        Raises:
            ValueError: the pieces do not pair up, are not 1-D, or do not total ``numel``.
            TypeError: an array is mixed with a list, or a piece has another dtype or array
                module than the optimizer.
        """
        pieces = self._check_pieces(params, grads)
        self.step_count += 1
        offset, block = 0, self._block
        for param, grad in pieces:
            widen = grad.dtype != self.dtype or grad_scale != 1.0
            step = block or max(param.size, 1)
            for start in range(0, param.size, step):
                stop = min(start + step, param.size)
                g = grad[start:stop]
                if widen:  # into a workspace of our dtype: grads stay read only
                    g = self._widened(g, grad_scale)
                self._update(param[start:stop], g, slice(offset + start, offset + stop))
            offset += param.size

    def _widened(self, grad: Array, scale: float) -> Array:
        """Return ``grad * scale`` in this optimizer's dtype, in the gradient workspace."""
        if self._grad_space is None or self._grad_space.size < grad.size:
            self._grad_space = self._workspace() if self._block else self.xp.empty(
                grad.size, self.dtype)
        out = self._grad_space[: grad.size]
        out[...] = grad
        if scale != 1.0:
            out *= self.dtype.type(scale)
        return out

    def _check_pieces(self, params: Any, grads: Any) -> list[tuple[Array, Array]]:
        """Pair params with grads and check them all before anything is written."""
        api = f"{type(self).__name__}.step"
        param_list, grad_list = _as_pieces(api, params, grads)
        for i, (param, grad) in enumerate(zip(param_list, grad_list, strict=True)):
            for label, arr in (("params", param), ("grads", grad)):
                self._check_array(api, f"{label} piece {i}", arr)
            if param.size != grad.size:
                raise ValueError(
                    f"{api}: piece {i} has {param.size} params and {grad.size} grads; "
                    "expected equal sizes"
                )
        total = sum(param.size for param in param_list)
        if total != self.numel:
            raise ValueError(
                f"{api}: the pieces cover the wrong number of elements; got {total}, "
                f"expected numel = {self.numel}"
            )
        return list(zip(param_list, grad_list, strict=True))

    def _check_array(self, api: str, label: str, arr: Any) -> None:
        """Check that one piece is a 1-D array of this optimizer's dtype and array module."""
        if not hasattr(arr, "ndim") or array_module(arr) is not self.xp:
            raise TypeError(
                f"{api}: {label} is not an array of the optimizer's array module; "
                f"got {type(arr).__name__}, expected an array of {self.xp.__name__}"
            )
        if arr.ndim != 1:
            raise ValueError(f"{api}: {label} is {arr.ndim}-D; got shape {arr.shape}, expected 1-D")
        narrower = label.startswith("grads") and arr.dtype.kind in "fV" and (
            arr.dtype.itemsize < self.dtype.itemsize)  # bfloat16 (ml_dtypes) is kind "V"
        if arr.dtype != self.dtype and not narrower:
            raise TypeError(
                f"{api}: {label} has the wrong dtype; got {arr.dtype}, expected {self.dtype}"
                + ("" if label.startswith("params") else " or a narrower floating dtype")
            )

    def _add_l2_decay(self, param: Array, grad: Array, piece: slice) -> Array:
        """Return ``grad + weight_decay * param`` (PyTorch's L2 form), or ``grad`` if unused."""
        if self._decayed_grad is None:
            return grad
        out = self._decayed_grad[: piece.stop - piece.start]
        ranges = self._decay_ranges(piece)
        if ranges == [(0, out.size)]:
            self.xp.multiply(param, self._l2_weight_decay, out=out)
            out += grad
            return out
        out[...] = grad
        for a, b in ranges:
            out[a:b] += self._l2_weight_decay * param[a:b]
        return out

    def state_dict(self) -> dict[str, Any]:
        """Return a checkpoint: name, numel, step_count, hyperparameters and host copies of state.

        Returns:
            ``{"name", "numel", "step_count", "hyperparameters", "state"}``; ``state`` maps each
            key to a numpy copy (a device-to-host copy under CuPy), safe to keep after more steps.
        """
        return {
            "name": self.name,
            "numel": self.numel,
            "step_count": self.step_count,
            "hyperparameters": dict(self.hyperparameters),
            "state": {key: np.array(to_numpy(arr), copy=True) for key, arr in self.state.items()},
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore ``step_count`` and state from a ``state_dict`` checkpoint.

        Hyperparameters are not taken from ``d``: the constructor's values stand, so a resumed run
        may change, say, ``lr``. State values are cast to this optimizer's dtype.

        Args:
            d: a dict returned by ``state_dict`` (possibly of another process or device).

        Raises:
            ValueError: ``d`` is for another rule, another ``numel``, or other state keys.
        """
        api = f"{type(self).__name__}.load_state_dict"
        missing = {"name", "numel", "step_count", "state"} - set(d)
        if missing:
            raise ValueError(
                f"{api}: checkpoint lacks {sorted(missing)}; got keys {sorted(d)}, "
                "expected the keys of state_dict()"
            )
        if d["name"] != self.name:
            raise ValueError(
                f"{api}: optimizer name differs; got {d['name']!r}, expected {self.name!r}"
            )
        if d["numel"] != self.numel:
            raise ValueError(f"{api}: numel differs; got {d['numel']}, expected {self.numel}")
        if set(d["state"]) != set(self.state):
            raise ValueError(
                f"{api}: state keys differ; got {sorted(d['state'])}, expected {sorted(self.state)}"
                "; was the checkpoint made with other hyperparameters (e.g. momentum)?"
            )
        step_count = d["step_count"]
        integral = isinstance(step_count, numbers.Integral) and not isinstance(step_count, bool)
        if not integral or step_count < 0:
            raise ValueError(
                f"{api}: invalid step_count; got {step_count!r}, expected an integer >= 0"
            )
        for key, value in d["state"].items():
            if np.shape(value) != (self.numel,):
                raise ValueError(
                    f"{api}: state[{key!r}] has the wrong shape; got {np.shape(value)}, "
                    f"expected ({self.numel},)"
                )
        for key, value in d["state"].items():
            self.xp.copyto(self.state[key], self.xp.asarray(value, dtype=self.dtype))
        self.step_count = int(step_count)

    def state_bytes(self) -> int:
        """Return the bytes held by state arrays (workspace excluded), for memory reports."""
        return sum(int(arr.nbytes) for arr in self.state.values())

    def state_bytes_per_element(self) -> int:
        """Return the state bytes this optimizer keeps per parameter (Adam in fp32: 8).

        From its kind and dtype alone: what memory predictions multiply by.
        """
        return len(self._state_keys()) * self.dtype.itemsize


def _as_pieces(api: str, params: Any, grads: Any) -> tuple[list[Array], list[Array]]:
    """Return params and grads as equal-length lists of pieces."""
    params_listed = isinstance(params, (list, tuple))
    grads_listed = isinstance(grads, (list, tuple))
    if params_listed != grads_listed:
        raise TypeError(
            f"{api}: params and grads must both be arrays or both be lists of arrays; "
            f"got {type(params).__name__} and {type(grads).__name__}"
        )
    if not params_listed:
        return [params], [grads]
    if len(params) != len(grads):
        raise ValueError(
            f"{api}: params has {len(params)} pieces, grads has {len(grads)}; "
            "expected the same number"
        )
    return list(params), list(grads)


def check_numel(api: str, numel: Any) -> int:
    """Return ``numel`` as an int, or raise if it is not an integer >= 0 (0: an empty shard)."""
    try:
        value = operator.index(numel)
    except TypeError:
        value = None
    if value is None or isinstance(numel, bool) or value < 0:
        raise ValueError(f"{api}: invalid numel; got {numel!r}, expected an integer >= 0")
    return value


def check_float_dtype(api: str, dtype: Any) -> np.dtype:
    """Return ``dtype`` as a numpy dtype, or raise if it is not a floating-point type."""
    try:
        value = np.dtype(dtype)
    except TypeError:
        value = None
    if value is None or value.kind != "f":
        raise TypeError(f"{api}: invalid dtype; got {dtype!r}, expected a floating-point dtype")
    return value


def check_hyperparameter(
    api: str, name: str, value: Any, *, lower: float | None = 0, upper: float | None = None
) -> float:
    """Return ``value`` as a float, or raise unless ``lower <= value < upper``.

    Args:
        api: the caller's name, for the message.
        name: the hyperparameter's name, for the message.
        value: the value to check; a real number (bools are refused).
        lower: inclusive lower bound, or None for none.
        upper: exclusive upper bound, or None for none.

    Raises:
        TypeError: ``value`` is not a real number.
        ValueError: ``value`` is out of range (NaN included).
    """
    rule = " ".join(
        part
        for part in (
            f"{lower} <=" if lower is not None else "",
            name,
            f"< {upper}" if upper is not None else "",
        )
        if part
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{api}: {name} must be a real number; got {value!r}, expected {rule}")
    number = float(value)
    too_low = lower is not None and number < lower
    too_high = upper is not None and number >= upper
    if math.isnan(number) or too_low or too_high:
        raise ValueError(f"{api}: invalid {name}; got {value!r}, expected {rule}")
    return number
