"""GradBlocks and ParamBlocks: a parameter's gradient, or the parameter itself, in row blocks.

Leaf module: imports nothing of meta_dist; the nn layers write and read through it, ``zero.flat``
makes the GradBlocks and ``zero.stage3`` the ParamBlocks. A layer's backward normally writes each
parameter gradient into the array ``grads[name]`` at once. A layer too large for one communication
bucket may instead find a GradBlocks there: it then computes the gradient a block of rows at a time
(top rows first) into the arrays the blocks give it, so the whole gradient never exists at once, and
the owner of the blocks learns as each one is written. A parameter tied to later layers (weight
tying) carries their gradients as ``extra``: each block adds their rows before it counts as written.

ParamBlocks is the same for reading: at ZeRO level 3 a layer larger than a bucket may find one
in ``params[name]`` and read the parameter a block of rows at a time (each block gathered as it
is asked for), so the whole parameter is never gathered at once (``read_rows``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

RowsInto = Callable[[int, int, Any], None]


class GradBlocks:
    """A parameter's gradient as row blocks, each written into the array its owner provides.

    Args:
        shape: the parameter's shape (rows along axis 0; a vector's rows are its elements).
        spans: ``(first_row, stop_row)`` of each block, top rows first.
        target: returns the array a block is written into, shaped like its rows.
        written: told ``(first_row, stop_row)`` once a block holds its rows.
        extra: arrays of the parameter's shape whose rows are added to each block (the
            gradients the parameter's other uses wrote; their backward runs first).
    """

    def __init__(self, shape: tuple[int, ...], spans: list[tuple[int, int]],
                 target: Callable[[int, int], Any], written: Callable[[int, int], None],
                 extra: tuple[Any, ...] = ()) -> None:
        self.shape = tuple(shape)
        self.spans = spans
        self._target, self._written, self.extra = target, written, extra

    def blocks(self) -> Iterator[tuple[int, int, Any]]:
        """Yield ``(first_row, stop_row, out)`` for each block, top rows first."""
        for first, stop in self.spans:
            yield first, stop, self._target(first, stop)
            self._written(first, stop)


def write_grad(grad: Any, rows_into: RowsInto) -> None:
    """Write a parameter's gradient into ``grad``, an array or a GradBlocks.

    Args:
        grad: the array that takes the gradient (overwritten), or a GradBlocks.
        rows_into: ``rows_into(first, stop, out)`` writes rows ``[first, stop)`` of the gradient
            into ``out``, an array shaped like those rows.
    """
    if isinstance(grad, GradBlocks):
        for first, stop, out in grad.blocks():
            rows_into(first, stop, out)
            for other in grad.extra:  # a tied parameter: its other uses' gradients add up
                out += other[first:stop] if other.ndim else other
    else:
        rows_into(0, grad.shape[0] if grad.ndim else 1, grad)


def in_float32(x: Any) -> Any:
    """Return 16-bit floats as float32 (wider arrays as they are), for arithmetic 16 bits lose.

    Squares overflow float16 past 256, ``1/N`` underflows it for large N, and a count past
    65504 is inf; PyTorch's autocast takes losses and norms in float32 for the same reasons.
    """
    return x if x.dtype.itemsize >= 4 else x.astype(np.float32)


def sum_rows(rows: Any, out: Any = None, axis: Any = 0) -> Any:
    """Return the sum of ``rows`` over ``axis`` (written into ``out`` when given).

    16-bit values are added up in float32 and rounded once, as a 16-bit matmul accumulates:
    numpy adds them in 16 bits a row at a time (4096 ones in float16 sum to 2048).
    """
    if rows.dtype.itemsize >= 4:
        return rows.sum(axis=axis, out=out)
    total = rows.sum(axis=axis, dtype=np.float32)
    if out is None:
        return total.astype(rows.dtype)
    out[...] = total
    return out


class ParamBlocks:
    """A parameter as row blocks, each fetched by its owner when the layer asks for it.

    Args:
        shape: the parameter's shape (rows along axis 0; a vector's rows are its elements).
        spans: ``(first_row, stop_row)`` of each block, lowest rows first.
        fetch: returns a block's values, shaped like its rows; valid until the next fetch.
    """

    def __init__(self, shape: tuple[int, ...], spans: list[tuple[int, int]],
                 fetch: Callable[[int, int], Any]) -> None:
        self.shape = tuple(shape)
        self.spans = spans
        self._fetch = fetch

    def blocks(self) -> Iterator[tuple[int, int, Any]]:
        """Yield ``(first_row, stop_row, values)`` for each block, lowest rows first."""
        for first, stop in self.spans:
            yield first, stop, self._fetch(first, stop)


def read_rows(param: Any) -> Iterator[tuple[int, int, Any]]:
    """Yield a parameter as ``(first_row, stop_row, values)`` blocks.

    A ParamBlocks gives its own blocks; an array comes whole, as one block.
    """
    if isinstance(param, ParamBlocks):
        yield from param.blocks()
    else:
        yield 0, (param.shape[0] if param.ndim else 1), param
