"""``python -m meta_dist bench NAME``: every benchmark runs under real mpirun and finishes.

Briefly (smallest sizes, a step or two): these check that each one runs and reports, never
how fast; the README's benchmark commands (``-m readme_bench``) run them at full size.
"""

import importlib.util
import subprocess
import sys

import pytest
from mpirun import ROOT, run

QUICK = {
    "collectives": (["--min-bytes", "4096", "--max-bytes", "16384", "--ops",
                     "allreduce,reduce_scatter"], "summary: 2 ranks mpi"),
    "fusion": (["--arrays", "20", "--rounds", "2"], "summary: fused meta_dist.allreduce"),
    "train": (["--levels", "0,2,3", "--steps", "2", "--warmup", "1", "--blocks", "1",
               "--hidden", "64"], "summary: ZeRO-2/DP step time"),
}


@pytest.mark.parametrize("name", sorted(QUICK))
def test_each_benchmark_runs_under_mpirun(name):
    options, summary = QUICK[name]
    result = run(2, ["-m", "meta_dist", "bench", name, *options], timeout=180)
    assert result.returncode == 0, str(result)
    assert summary in result.output, str(result)
    if name in ("collectives", "fusion"):
        assert "right" in result.output.splitlines()[-1] and "WRONG" not in result.output
    if name == "train":  # without --torch no torch runs: the header said "torch on gloo"
        header = [line for line in result.output.splitlines() if line.startswith("# 2 ranks")]
        assert len(header) == 1 and "torch" not in header[0], str(result)


def test_the_checkpoint_benchmark_saves_then_loads(tmp_path):
    saved = run(2, ["-m", "meta_dist", "bench", "checkpoint", "save", str(tmp_path),
                    "--hidden", "64", "--depth", "2"], timeout=180)
    assert saved.returncode == 0 and "save_checkpoint" in saved.output, str(saved)
    loaded = run(1, ["-m", "meta_dist", "bench", "checkpoint", "load", str(tmp_path),
                     "--level", "0", "--hidden", "64", "--depth", "2"], timeout=180)
    assert loaded.returncode == 0 and "load_checkpoint" in loaded.output, str(loaded)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="needs the bench extra's matplotlib: pip install -e '.[bench]'")
def test_the_memory_plot_is_drawn(tmp_path):
    picture = tmp_path / "mem.png"
    result = run(2, ["-m", "meta_dist", "bench", "train", *QUICK["train"][0], "--plot",
                     str(picture)], timeout=180)
    assert result.returncode == 0, str(result)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000


def test_loading_into_another_model_is_one_message(tmp_path):
    saved = run(2, ["-m", "meta_dist", "bench", "checkpoint", "save", str(tmp_path),
                    "--hidden", "64", "--depth", "2"], timeout=180)
    assert saved.returncode == 0, str(saved)
    loaded = run(1, ["-m", "meta_dist", "bench", "checkpoint", "load", str(tmp_path),
                     "--hidden", "32", "--depth", "2"], timeout=180)
    assert loaded.returncode == 2, str(loaded)
    assert loaded.output.startswith("python -m meta_dist: error: checkpoint: "), str(loaded)
    assert "shapes differ" in loaded.output and "Traceback" not in loaded.output


def test_an_unknown_benchmark_or_a_plot_without_matplotlib_is_one_message():
    done = subprocess.run([sys.executable, "-m", "meta_dist", "bench", "trian"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "unknown benchmark 'trian'" in done.stderr, done.stderr
    assert "collectives|fusion|train|checkpoint" in done.stderr
    if importlib.util.find_spec("matplotlib") is None:
        done = subprocess.run([sys.executable, "-m", "meta_dist", "bench", "train", "--plot",
                               "x.png"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 2 and "pip install -e '.[bench]'" in done.stderr, done.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="torch is installed: --torch has what it needs")
def test_torch_without_torch_is_one_line_for_the_job():
    """The README's `bench train --levels 0,2,3 --torch` without the bench extra ended in a
    ModuleNotFoundError traceback on every rank."""
    result = run(2, ["-m", "meta_dist", "bench", "train", "--torch"], timeout=120)
    assert result.returncode == 2 and not result.timed_out, str(result)
    said = [line for line in result.output.splitlines() if ": error" in line]
    assert said == ["python -m meta_dist: error: bench train: --torch needs torch, which comes "
                    "with the bench extra: pip install -e '.[bench]'; --help lists the "
                    "options"], str(result)
    assert "Traceback" not in result.output, str(result)


def test_an_option_it_cannot_use_is_one_line_for_the_job():
    """argparse printed its usage and exited on every rank, and failfast took each exit for a
    rank ending early: three usages, three "exits with code 2 while the job is running",
    then MPI_Abort's banner. Now the lowest rank prints one line and the job ends with 2."""
    result = run(3, ["-m", "meta_dist", "bench", "collectives", "--bogus"], timeout=120)
    assert result.returncode == 2 and not result.timed_out, str(result)
    said = [line for line in result.output.splitlines() if ": error" in line]
    assert said == ["python -m meta_dist: error: bench collectives: unrecognized arguments: "
                    "--bogus; --help lists the options"], str(result)
    assert "usage:" not in result.output and "MPI_ABORT" not in result.output, str(result)
