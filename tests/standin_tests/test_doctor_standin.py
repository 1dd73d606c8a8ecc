"""The doctor on the CuPy/NCCL stand-in: two ranks on a host with one GPU fail two checks."""

import pytest
from mpirun import mpi_env, run
from standin_install import standin_env

pytestmark = pytest.mark.gpu_standin


def test_the_doctor_fails_two_ranks_on_one_gpu(tmp_path):
    env = standin_env(mpi_env(META_DIST_STANDIN_DEVICES="1",
                              META_DIST_STANDIN_RENDEZVOUS=str(tmp_path)))
    result = run(2, ["-m", "meta_dist", "doctor"], timeout=120, env=env)
    assert result.returncode == 1, str(result)
    assert "FAIL  ranks per host: more ranks than GPUs" in result.output, str(result)
    assert "FAIL  GPU per rank: ranks 0, 1 share GPU" in result.output, str(result)
    assert "GPU 0: " in result.output and "doctor: some checks FAILED" in result.output
