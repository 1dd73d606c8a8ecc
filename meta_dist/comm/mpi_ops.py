"""How the MPI backend reduces: the library's ops, the numpy ufuncs, and the one exception.

Imports numpy and mpi4py only; the MPI backend and the CuPy staging both use these tables.
"""

import numpy as np
from mpi4py import MPI

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
# Open MPI 5.0's MPI_SUM on MPI_UNSIGNED_CHAR saturates at 255 (seen with the PyPI wheel) where
# numpy and C wrap modulo 256; these dtypes are always reduced by numpy in the pairwise path.
NUMPY_REDUCED_DTYPES = (np.dtype(np.uint8),)
