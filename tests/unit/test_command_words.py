"""``python -m meta_dist`` commands given words they cannot use: one line and exit 2, no MPI."""

import importlib
import json
import subprocess
import sys

import pytest

from meta_dist import trace
from meta_dist.errors import UsageError

ROOT = __file__.rsplit("/tests/", 1)[0]


def test_the_doctor_refuses_an_argument():
    """It ran all its checks and passed whatever followed it (doctor --foo exited 0)."""
    done = subprocess.run([sys.executable, "-m", "meta_dist", "doctor", "--foo"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "doctor: unexpected argument '--foo'; it takes none" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_checkpoint_command_is_one_of_meta_dist_s_commands(tmp_path):
    """python -m meta_dist checkpoint info DIR was an "unknown command" whose usage did not
    mention the checkpoint tool (python -m meta_dist.checkpoint) at all."""
    done = subprocess.run([sys.executable, "-m", "meta_dist", "checkpoint", "info",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2 and "unknown command" not in done.stderr, done.stderr
    assert "holds no complete checkpoint" in done.stderr, done.stderr
    done = subprocess.run([sys.executable, "-m", "meta_dist", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert "python -m meta_dist checkpoint info|consolidate" in done.stderr, done.stderr


def test_trace_merge_names_a_file_that_is_cut_off(tmp_path, capsys):
    """A rank killed while writing its trace left half a file: a JSONDecodeError traceback."""
    whole = {"traceEvents": [{"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": 1.0}]}
    (tmp_path / "trace-rank00000.json").write_text(json.dumps(whole))
    (tmp_path / "trace-rank00001.json").write_text(json.dumps(whole)[:30])
    assert trace.cli(["merge", str(tmp_path), str(tmp_path / "all.json")]) == 2
    said = capsys.readouterr().err
    assert "trace-rank00001.json is not a whole trace" in said and "leave it out" in said
    assert not (tmp_path / "all.json").exists()


@pytest.mark.parametrize("module, argv, says", [
    ("collectives", ["--ops", "allreduce,allreduc"], "--ops: unknown 'allreduc'; expected some of"),
    ("collectives", ["--factor", "1"], "--factor: got 1; expected a number >= 2"),
    ("train", ["--levels", "0,5"], "--levels: expected ZeRO levels among 0, 1, 2, 3"),
    ("train", ["--levels", "two"], "--levels: expected ZeRO levels among 0, 1, 2, 3"),
    ("collectives", ["--min-bytes", "0"], "--min-bytes: got 0; expected a number >= 1"),
    ("collectives", ["--min-bytes", "8192", "--max-bytes", "4096"],
     "--max-bytes: got 4096; expected a number >= --min-bytes (8192)"),
    ("collectives", ["--blocks", "0"], "--blocks: got 0; expected a number >= 1"),
    ("fusion", ["--arrays", "0"], "--arrays: got 0; expected a number >= 1"),
    ("fusion", ["--min-numel", "10", "--max-numel", "5"],
     "--max-numel: got 5; expected a number >= --min-numel (10)"),
    ("train", ["--steps", "0"], "--steps: got 0; expected a number >= 1"),
    ("train", ["--blocks", "0"], "--blocks: got 0; expected a number >= 1"),
    ("train", ["--batch", "0"], "--batch: got 0; expected a number >= 1"),
    ("train", ["--depth", "0"], "--depth: got 0; expected a number >= 1"),
    ("checkpoint", ["save", "ckpt", "--repeat", "0"], "--repeat: got 0; expected a number >= 1"),
    ("fusion", ["--seed", "-1"], "--seed: got -1; expected a number >= 0"),
    ("train", ["--gpt", "2,0,64,32"],
     "--gpt 2,0,64,32: expected N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE, four integers >= 1"),
    ("train", ["--gpt", "2,2,-64,32"],
     "--gpt 2,2,-64,32: expected N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE, four integers >= 1"),
    ("train", ["--gpt", "2,2"], "--gpt 2,2: expected N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE"),
    ("train", ["--gpt", "2,3,64,32"], "--gpt 2,3,64,32: N_HEAD (3) must divide N_EMBD (64)"),
    ("train", ["--bucket-mb", "0"], "--bucket-mb: got 0; expected a finite number > 0"),
    ("train", ["--bucket-mb", "nan"], "--bucket-mb: got nan; expected a finite number > 0"),
    ("train", ["--bucket-mb", "inf"], "--bucket-mb: got inf; expected a finite number > 0"),
    ("checkpoint", ["save", "ckpt", "--level", "5"], "argument --level: invalid choice: 5"),
    ("train", ["--plot", "/no/such/folder/memory.png"],
     "--plot: the folder of /no/such/folder/memory.png does not exist (/no/such/folder)"),
])
def test_a_benchmark_names_the_option_it_cannot_use(module, argv, says, capsys):
    """--ops allreduc also blamed --factor; --levels 5 was blamed on a config 'script dict'
    after MPI had started, and --levels two was a ValueError traceback. A count of 0 ran on:
    --min-bytes 0 looped for ever, --steps or --blocks 0 ended in a ZeroDivisionError after
    the runs, --blocks 0 (collectives) printed a table of nan as 'all results right', --batch
    0 ran 256, --depth 0 ran one hidden layer labelled 784-10, --repeat 0 an
    UnboundLocalError, and --max-bytes under --min-bytes an IndexError; --gpt with a 0 or a
    negative count was a traceback from the GPT's layers, --seed -1 one from numpy (fusion),
    and --gpt 2,2 was blamed as "--gpt (2, 2)"; --gpt 2,3,64,32 was a traceback from the
    attention layer, --bucket-mb 0 (and nan or inf) and checkpoint --level 5 were blamed on
    a 'script dict' after MPI had started. A --plot into a missing folder failed with
    FileNotFoundError after the whole benchmark had run."""
    parse_args = importlib.import_module(f"meta_dist.bench.{module}").parse_args
    with pytest.raises(UsageError) as refused:
        parse_args(argv)
    assert says in str(refused.value) and "--factor must" not in str(refused.value)
