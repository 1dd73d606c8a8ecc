"""NCCL backend selection without a GPU: helpful reasons, imports without cupy, tables, messages."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from meta_dist.comm.checks import DTYPES, REDUCE_OPS
from meta_dist.comm.nccl_backend import NCCL_DTYPE_NAMES, NCCL_H, NCCL_OP_NAMES, NcclCommunicator
from meta_dist.gpus import INSTALL_HINT, decode_nccl_version, nccl_unavailable_reason, ranks_problem
from meta_dist.xp import cupy_or_none, gpu_count

ROOT = Path(__file__).resolve().parents[2]


def test_reason_without_a_gpu_says_how_to_fix():
    reason = nccl_unavailable_reason()
    if reason is None:
        pytest.skip(f"NCCL can run here ({gpu_count()} GPU(s) visible)")
    assert reason.startswith("backend 'nccl' needs ")
    assert "pip install 'meta_dist[gpu]'" in reason and "cupy-cuda13x" in reason
    assert reason.endswith("or use backend: mpi")


def test_module_imports_and_answers_without_cupy():
    code = (
        "import sys\n"
        "sys.modules['cupy'] = sys.modules['cupyx'] = None\n"  # import cupy now raises
        "from meta_dist import gpus\n"
        "from meta_dist.comm import mpi_backend, nccl_backend\n"
        "print(gpus.nccl_unavailable_reason())\n"
        "print(gpus.nccl_version())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    reason, version = done.stdout.strip().splitlines()[-2:]
    assert reason.startswith("backend 'nccl' needs cupy with NCCL (import cupy failed")
    assert INSTALL_HINT in reason
    assert version == "None"


def test_decode_nccl_version():
    assert decode_nccl_version(23203) == (2, 32, 3)
    assert decode_nccl_version(22501) == (2, 25, 1)
    assert decode_nccl_version(2804) == (2, 8, 4)  # before 2.9: X*1000 + Y*100 + Z
    assert decode_nccl_version(30001) == (3, 0, 1)


def test_tables_cover_every_dtype_and_op():
    assert set(NCCL_DTYPE_NAMES) == {d.name for d in DTYPES}
    assert set(NCCL_OP_NAMES) == set(REDUCE_OPS)
    # NCCL's own average (>= 2.10) pre-scales by 1/size, so fp16 sums cannot overflow first
    assert NCCL_OP_NAMES["avg"] == "NCCL_AVG"
    assert all(NCCL_H[name] for name in ("NCCL_AVG", "NCCL_BFLOAT16"))  # where CuPy lacks them


def test_tables_name_what_cupy_has():
    """The constants come from cupy.cuda.nccl itself; each name must exist there with the value
    nccl.h gives it (gpu_facts.md section 1)."""
    if cupy_or_none() is None:
        pytest.skip("cupy does not import here; pip install 'meta_dist[gpu]'")
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("cupy.cuda.nccl could not load libnccl.so.2")
    nccl_h = {"NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT64": 4, "NCCL_FLOAT16": 6,
              "NCCL_FLOAT32": 7, "NCCL_FLOAT64": 8, "NCCL_BFLOAT16": 9, "NCCL_SUM": 0,
              "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4}
    assert NCCL_H == nccl_h  # the fallback table for a CuPy that lacks a name
    for name in (*NCCL_DTYPE_NAMES.values(), *NCCL_OP_NAMES.values()):
        assert getattr(nccl, name, nccl_h[name]) == nccl_h[name], name


def test_ranks_problem_names_every_rank():
    assert ranks_problem("api", [None, None]) is None
    message = ranks_problem("api", ["no gpu", None, "no gpu", "no cupy"])
    assert message == "api: NCCL cannot run on 3 of 4 ranks; ranks 0, 2: no gpu; rank 3: no cupy"


def test_host_arrays_are_refused_with_the_alternative():
    me = SimpleNamespace(device=0, rank=0)
    with pytest.raises(TypeError) as err:
        NcclCommunicator._check_arrays(me, "allreduce", [np.ones(3)])
    assert str(err.value) == ("allreduce: nccl backend moves CuPy arrays; got numpy.ndarray; use "
                              "backend 'mpi' for host arrays or cupy.asarray(x)")
