"""Top-level test configuration: the multi-rank suite only runs under mpirun.

Plain ``pytest`` runs tests/unit and tests/test_*.py; the latter launch tests/mpi under real
mpirun at 1-4 ranks (see tests/test_mpi_suite.py). Under mpirun the launcher sets
META_DIST_MPI_SUITE=1 and only tests/mpi is collected.
"""

import os

if os.environ.get("META_DIST_MPI_SUITE") != "1":
    collect_ignore = ["mpi", "scripts"]
else:
    collect_ignore = ["unit", "scripts"]
