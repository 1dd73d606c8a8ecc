"""How the MPI backend reduces and tags: the library's ops, the numpy ufuncs, the one exception.

Imports numpy and mpi4py only; the MPI backend and the CuPy staging both use these tables.
"""

import numpy as np
from mpi4py import MPI

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
UFUNCS = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
# Open MPI 5.0's MPI_SUM on MPI_UNSIGNED_CHAR saturates at 255 (seen with the PyPI wheel) where
# numpy and C wrap modulo 256; these dtypes are always reduced by numpy in the pairwise path.
NUMPY_REDUCED_DTYPES = (np.dtype(np.uint8),)


def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """Return the predefined MPI datatype of a numpy dtype (for explicit buffer specs)."""
    return MPI._typedict[dtype.char]


# Tags on the backend's communicator. The pairwise reductions and the list exchange are built
# from Sendrecv on the same communicator as the user's send/recv, which run on their own threads:
# with one tag a collective's receive could take a message a user's send put in flight.
P2P_TAG = 0
EXCHANGE_TAG = 1
