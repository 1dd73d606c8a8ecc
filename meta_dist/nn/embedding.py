"""Embedding: a lookup table ``weight[ids]`` whose backward scatter-adds into the rows it read.

Leaf module: imports numpy, ``meta_dist.xp`` and ``nn.layers``, ``nn.init``, ``nn.grad_blocks``
only; ``nn.transformer``, ``meta_dist.models`` and the tests import it. The gradient is written a
block of rows at a time when ZeRO asks for it (``nn.grad_blocks.write_grad``), each block taking
only the ids that fall in it.
"""

from __future__ import annotations

import types

import numpy as np

from meta_dist.nn.grad_blocks import write_grad
from meta_dist.nn.init import draw_normal
from meta_dist.nn.layers import Layer, _positive
from meta_dist.xp import array_module, is_cupy_array


def _scatter_add(out, ids, rows) -> None:
    """Add ``rows[i]`` to ``out[ids[i]]`` for every i (ids 1-D), repeated ids accumulating.

    16-bit gradients are summed in float32 and rounded once, as PyTorch's embedding backward
    accumulates them: added in 16 bits one id at a time, a token seen 4096 times gets 2048 in
    float16 (numpy's add.at rounds every add; CuPy cannot scatter-add bfloat16 at all: 14.2
    raised "cupy.add.at only supports ..." on an H200). Only the rows the ids touch are widened,
    not the table (a 50k-token vocabulary's would be 4 bytes a weight every backward).
    """
    if out.dtype.itemsize < 4:
        touched, where = array_module(out).unique(ids, return_inverse=True)
        sums = out[touched].astype(np.float32)
        _scatter_add(sums, where.reshape(-1), rows.astype(np.float32))
        out[touched] = sums.astype(out.dtype)
    elif is_cupy_array(out):
        import cupyx

        cupyx.scatter_add(out, ids, rows)
    else:
        np.add.at(out, ids, rows)


class Embedding(Layer):
    """Lookup table ``weight[ids]``, weight of shape (num_embeddings, embedding_dim)."""

    grad_rows = True

    def __init__(self, num_embeddings: int, embedding_dim: int, *, rng: np.random.Generator,
                 dtype=np.float32, xp: types.ModuleType = np) -> None:
        """Create the table with PyTorch's initialisation, weight ~ N(0, 1).

        Args:
            num_embeddings: number of rows (the vocabulary or the positions).
            embedding_dim: size of each row.
            rng: host generator for the initial values.
            dtype: parameter dtype.
            xp: array module (numpy or cupy) the parameters live on.

        Raises:
            TypeError: a size is not an int.
            ValueError: a size is not positive.
        """
        super().__init__()
        self.num_embeddings = _positive("Embedding", "num_embeddings", num_embeddings)
        self.embedding_dim = _positive("Embedding", "embedding_dim", embedding_dim)
        shape = (num_embeddings, embedding_dim)
        self._add_param("weight", draw_normal(rng, 1.0, shape, dtype), dtype, xp)
        self.ids = None

    def forward(self, ids):
        """Return ``weight[ids]`` of shape ``ids.shape + (embedding_dim,)``; keeps the ids.

        Raises:
            TypeError: ids are not integers.
            ValueError: (host arrays only) an id is outside [0, num_embeddings).
        """
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"Embedding.forward: ids must be integers; got dtype {ids.dtype}, "
                            f"expected an integer dtype")
        # Reading the ids back is a host sync on the GPU, so the range is checked on the host only.
        if ids.size and not is_cupy_array(ids):
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                raise ValueError(f"Embedding.forward: id out of range; got ids in [{low}, {high}],"
                                 f" expected every id in [0, {self.num_embeddings - 1}]")
        self.ids = ids
        return self.params["weight"][ids]

    def backward(self, dout):
        """Write the scatter-add of ``dout`` into the rows of dweight; return None (ids)."""
        # 64-bit: a block's first row may exceed what narrow ids hold (uint8 ids, 600 rows)
        ids = self.ids.reshape(-1).astype(np.int64, copy=False)
        rows = dout.reshape(-1, self.embedding_dim)

        def rows_into(first: int, stop: int, out) -> None:
            out[...] = 0
            if first == 0 and stop == self.num_embeddings:
                _scatter_add(out, ids, rows)
            else:  # one block of a GradBlocks: only the ids that fall in it
                inside = (ids >= first) & (ids < stop)
                _scatter_add(out, ids[inside] - first, rows[inside])

        write_grad(self.grads["weight"], rows_into)
