"""Training benchmark: the reference MLP, or a GPT, at ZeRO levels 0-3 (and PyTorch).

Run by meta_dist.bench (``bench train``); imports meta_dist.bench.workloads (what is trained),
and meta_dist.bench.torch_side (PyTorch's variants) only with --torch.

    mpirun -np 2 [--bind-to core] python -m meta_dist bench train [--levels 0,1,2,3]
        [--steps 30] [--warmup 5] [--blocks 5] [--overlap | --no-overlap] [--bucket-mb 25]
        [--hidden 1024 | --big | --xl] [--depth 2] [--precision fp32|fp16|bf16]
        [--no-reshard] [--nonfinite ...] [--torch]
        [--model gpt [--gpt N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE] [--batch 32]]

Workload (--model mlp, the default): MLP 784 -> H -> H -> 10 with ReLU and softmax
cross-entropy, synthetic data, Adam lr 1e-3, fp32, global batch 256 split evenly across the
ranks; every run starts from the same weights. H is 1024 by default; --big makes it 3584
(15.7M parameters), --xl 4096 (20.0M), for the memory comparison. --model gpt: the GPT of
meta_dist.models.gpt (configs/gpt-tiny.yaml's shape by default: 2 layers, 2 heads, width 64,
context 32) on the standard library's characters, global batch 32 windows, Adam lr 1e-3; its
PyTorch twin is meta_dist.models.torch_gpt.TorchGPT with the same weights. --torch adds
PyTorch DDP (gloo), DDP + ZeroRedundancyOptimizer(Adam) and FSDP FULL_SHARD (each Linear, or
each GPT block, its own FSDP unit, as meta_dist's level 3 gathers layer by layer) on the same
workload in the same run; torch.distributed gets MPI's rank and size and a
MASTER_PORT that rank 0 picks and broadcasts. "MiB/step" is what a meta_dist rank asked its
communicator to move per step (``Communicator.traffic``: the bus bytes of NCCL's formulas), so
the levels' communication volumes compare (levels 1 and 2 move DP's bytes, level 3 1.5 times as
many).

Fairness: numpy's BLAS and torch both use ONE thread per rank: OMP_NUM_THREADS,
OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are set to 1 before MPI and torch start (numpy's
OpenBLAS, loaded already, through its own setter: ``blas_threads.use_threads``), and
torch.set_num_threads(1).

Method: every variant is built first; around its build and warmup steps the process's peak RSS is
reset (Linux /proc/self/clear_refs) so "peak" is the RSS high-water mark above the RSS before the
build, and "held" the RSS still added after warmup (max over ranks); with --device cuda the same of
the GPU allocator that holds the variant's arrays (CuPy's pool: PeakMeter; torch's). Then the timed
steps of all variants alternate in blocks so load drift hits them alike; step time is the max over
ranks of each rank's median. Memory of variants sharing one process can still blur (the allocator
reuses freed memory); for clean per-level numbers run one level per process, e.g. --levels 2
(--levels '' --torch runs PyTorch alone).

On a busy machine pass ``--bind-to core`` (Open MPI): unbound, the scheduler can stack
both ranks on one core, and then every exchange waits a whole time slice.
"""

import argparse
import gc
import importlib
import importlib.util
import math
import resource
import time

import numpy as np

from meta_dist import blas_threads
from meta_dist import distributed as dist
from meta_dist.bench import ArgumentParser, check_counts
from meta_dist.bench.plot import check_plotting, plot_memory
from meta_dist.bench.workloads import BATCHES, SEED, GPTWorkload, MLPWorkload, count_params
from meta_dist.config import load_config
from meta_dist.lazy_mpi import MPI
from meta_dist.nn.init import deferred
from meta_dist.train import Trainer, array_module_for
from meta_dist.train.memory import PeakMeter

MIB = 2**20


class VariantMemory:
    """A variant's memory per rank from its build on, MiB.

    Host RSS on the CPU; on a GPU the allocator that holds its arrays (CuPy's pool for
    meta_dist, torch's for torch).
    """

    def __init__(self, device, is_torch):
        self.torch = None
        if device == "cuda" and is_torch:
            import torch

            self.torch = torch
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.meter = PeakMeter(np if device == "cpu" else importlib.import_module("cupy"))
            self.meter.reset()

    def peak_and_held(self):
        """(the high-water mark's rise, what is still held above the start), MiB."""
        if self.torch is not None:
            cuda = self.torch.cuda
            return ((cuda.max_memory_allocated() - self.base) / MIB,
                    (cuda.memory_allocated() - self.base) / MIB)
        return (self.meter.growth() / MIB, (self.meter.current() - self.meter.base) / MIB)


def meta_variant(level, work, args):
    """Return (step function, memory_report, traffic) for a meta_dist Trainer at ``level``."""
    config = load_config(
        {"batch_size": work.global_batch, "optimizer": "adam", "lr": 1e-3, "dtype": "float32",
         "precision": args.precision, **work.config},
        {"zero_opt_level": level, "overlap_comm": args.overlap, "bucket_size_mb": args.bucket_mb,
         "device": args.device, "backend": "mpi" if args.device == "cpu" else "auto",
         "seed": SEED, "nonfinite": args.nonfinite, "reshard_after_forward": args.reshard})
    xp = array_module_for(config)  # cupy on this rank's GPU for --device cuda
    with deferred():  # level 3 then never holds the whole model (nn.init)
        model = work.meta_model(xp)
    trainer = Trainer(model, config, loss_fn=work.loss_fn, log=None)
    args.resolved_overlap = trainer.overlap
    # the batch is copied to the device inside the step, as torch's is; float() waits for it
    return (lambda x, y: float(trainer.train_step(xp.asarray(x), xp.asarray(y))),
            trainer.memory_report(), trainer.comm.traffic)


def parse_args(argv):
    """Parse the command line."""
    p = ArgumentParser(prog="python -m meta_dist bench train",
                       description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default="0,1,2,3", help="ZeRO levels to run, e.g. 0,2 or 3")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant")
    p.add_argument("--blocks", type=int, default=5, help="the timed steps alternate in blocks")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="meta_dist_config overlap_comm (reduce buckets during backward); "
                        "default: decided per run (off on one rank, else on with a spare "
                        "core or a GPU)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size (also DDP's cap)")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="train_config precision (meta_dist only; torch stays fp32)")
    p.add_argument("--nonfinite", choices=("stop", "skip", "ignore"), default="stop",
                   help="meta_dist_config nonfinite (ignore: no per-step finite check)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers")
    size.add_argument("--big", dest="hidden", action="store_const", const=3584,
                      help="hidden 3584: 15.7M parameters")
    size.add_argument("--xl", dest="hidden", action="store_const", const=4096,
                      help="hidden 4096: 20.0M parameters, 84%% of them in one layer")
    p.add_argument("--depth", type=int, default=2,
                   help="hidden layers (784-H-...-H-10); --hidden 2048 --depth 6 is 22.6M "
                        "parameters in layers of equal size")
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                   help="the workload: the reference MLP, or a GPT on characters")
    p.add_argument("--gpt", default="2,2,64,32", metavar="N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE",
                   help="the GPT's shape (--model gpt); default configs/gpt-tiny.yaml's")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch: samples (mlp, default 256) or windows (gpt, default 32)")
    p.add_argument("--reshard", action=argparse.BooleanOptionalAction, default=True,
                   help="level 3's reshard_after_forward (and FSDP FULL_SHARD vs SHARD_GRAD_OP)")
    p.add_argument("--torch", action="store_true",
                   help="also run PyTorch DDP, DDP + ZeroRedundancyOptimizer and FSDP")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw each meta_dist level's memory per rank (stacked: params, grads, "
                        "optimizer, buffers; with the measured peak) into FILE (needs the "
                        "bench extra's matplotlib)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: meta_dist on CuPy (NCCL where usable) and torch on the GPU "
                        "(nccl process group)")
    args = p.parse_args(argv)
    check_counts(p, args, {"--steps": 1, "--warmup": 0, "--blocks": 1, "--hidden": 1,
                           "--depth": 1, "--batch": 1})
    if args.plot and (problem := check_plotting(args.plot)):
        p.error(problem)
    if args.torch and importlib.util.find_spec("torch") is None:
        p.error("--torch needs torch, which comes with the bench extra: pip install -e '.[bench]'")
    try:
        args.levels = [int(level) for level in args.levels.split(",") if level]
    except ValueError:
        args.levels = None
    if args.levels is None or not set(args.levels) <= {0, 1, 2, 3}:
        p.error("--levels: expected ZeRO levels among 0, 1, 2, 3, comma-separated (e.g. 0,2), "
                "or '' with --torch")
    try:
        gpt = tuple(int(n) for n in args.gpt.split(","))
    except ValueError:
        gpt = ()
    if len(gpt) != 4 or min(gpt) < 1:  # a 0 or a negative: a traceback from the GPT's layers
        p.error(f"--gpt {args.gpt}: expected N_LAYER,N_HEAD,N_EMBD,BLOCK_SIZE, four integers "
                ">= 1, e.g. 2,2,64,32")
    if gpt[2] % gpt[1]:  # each head takes N_EMBD / N_HEAD channels
        p.error(f"--gpt {args.gpt}: N_HEAD ({gpt[1]}) must divide N_EMBD ({gpt[2]})")
    if not 0 < args.bucket_mb < math.inf:  # nan and inf too: the config refuses them
        p.error(f"--bucket-mb: got {args.bucket_mb:g}; expected a finite number > 0")
    args.gpt = gpt
    return args


def main(argv):
    """Build every variant, time their steps in alternating blocks, print the table."""
    args = parse_args(argv)
    blas_threads.use_threads(1)  # before MPI: the connector then leaves the count alone
    dist.get_context()  # meta_dist up before torch, so its communicators come first
    world = MPI.COMM_WORLD.Dup()
    rank, size = world.rank, world.size
    work = GPTWorkload(args) if args.model == "gpt" else MLPWorkload(args)
    glob = work.global_batch
    local = glob // size  # check_world in the Trainer rejects sizes that do not divide
    starts = [i * glob + rank * local for i in range(BATCHES)]  # this rank's part
    batches = [(work.x[s:s + local], work.y[s:s + local]) for s in starts]
    if args.torch:
        from meta_dist.bench import torch_side  # torch (the bench extra) only when asked for

        torch_side.start_torch(world, args.device)
    makers = {f"meta_dist ZeRO-{lv}" if lv else "meta_dist DP":
              (lambda lv=lv: meta_variant(lv, work, args)) for lv in args.levels}
    if args.torch:
        makers["torch DDP"] = lambda: torch_side.torch_variant("ddp", work, args)
        makers["torch DDP + ZeroRedundancyOpt"] = \
            lambda: torch_side.torch_variant("zero", work, args)
        makers["torch FSDP2 " + ("FULL_SHARD" if args.reshard else "SHARD_GRAD_OP")] = \
            lambda: torch_side.torch_variant("fsdp", work, args)

    runs = {}  # name -> dict(step, report, peak, held, times, done, loss)
    for name, make in makers.items():
        gc.collect()
        memory = VariantMemory(args.device, name.startswith("torch"))
        step, report, traffic = make()
        for i in range(args.warmup):
            step(*batches[i % BATCHES])
        peak, held = memory.peak_and_held()
        runs[name] = {"step": step, "report": report, "times": [], "done": args.warmup,
                      "traffic": traffic, "moved": 0.0,
                      "peak": world.allreduce(peak, op=MPI.MAX),
                      "held": world.allreduce(held, op=MPI.MAX)}
    per_block = -(-args.steps // args.blocks)
    for block in range(args.blocks):
        names = list(runs)[block % len(runs):] + list(runs)[:block % len(runs)]
        for name in names:  # rotated: no variant always runs first after another's block
            run = runs[name]
            world.Barrier()
            before = run["traffic"].total() if run["traffic"] else 0.0  # one per communicator
            for _ in range(min(per_block, args.warmup + args.steps - run["done"])):
                start = time.perf_counter()
                run["loss"] = run["step"](*batches[run["done"] % BATCHES])
                run["times"].append(time.perf_counter() - start)
                run["done"] += 1
            run["moved"] += run["traffic"].total() - before if run["traffic"] else 0.0
    for run in runs.values():
        run["moved"] = world.allreduce(run["moved"] / MIB / len(run["times"]), op=MPI.MAX)
        run["ms"] = world.allreduce(float(np.median(run["times"])) * 1e3, op=MPI.MAX)
        run["loss"] = world.allreduce(run["loss"]) / size  # global-batch loss: equal local batches
    process_peak = world.allreduce(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                   op=MPI.MAX)

    if rank == 0:
        with deferred():  # shapes only
            params = count_params(work.meta_model())
        # torch's process group only when torch runs (--torch): the header names what ran
        torch_on = (f", torch on {'nccl' if args.device == 'cuda' else 'gloo'}" if args.torch
                    else "")
        print(f"# {size} ranks, {work.describe()} ({params / 1e6:.2f}M params)"
              f", Adam, {args.precision}, {args.device}{torch_on}"
              f", global batch {glob} ({local}/rank), overlap_comm="
              f"{getattr(args, 'resolved_overlap', args.overlap)}, bucket {args.bucket_mb:g} MiB, "
              f"1 thread/rank; {args.steps} steps "
              f"after {args.warmup} warmup; step time = max over ranks of the median; memory "
              "MiB per rank (max over ranks)")
        print(f"{'variant':<31}{'step ms':>8}{work.unit + '/s':>10}{'peak Δ':>8}{'held Δ':>8}"
              f"{'params':>8}{'grads':>7}{'optim':>7}{'bufs':>6}{'MiB/step':>9}{'loss':>8}")
        for name, r in runs.items():
            rep = r["report"]
            model = ("".join(f"{rep[k] / MIB:>{w}.1f}" for k, w in
                             (("params", 8), ("grads", 7), ("optimizer", 7), ("buffers", 6)))
                     if rep else f"{'-':>8}{'-':>7}{'-':>7}{'-':>6}")
            moved = f"{r['moved']:>9.2f}" if r["traffic"] else f"{'-':>9}"
            print(f"{name:<31}{r['ms']:>8.2f}{work.per_step / r['ms'] * 1e3:>10.0f}"
                  f"{r['peak']:>8.1f}{r['held']:>8.1f}{model}{moved}{r['loss']:>8.4f}")
        print(f"# process peak RSS (ru_maxrss, max over ranks): {process_peak:.0f} MiB; with "
              "several variants in one process the Δ columns may blur: use --levels N for one")
        ms = {name: r["ms"] for name, r in runs.items()}
        dp, ddp = ms.get("meta_dist DP"), ms.get("torch DDP")
        parts = []
        if dp and ddp:
            parts.append(f"DP {work.per_step / dp * 1e3:.0f} {work.unit}/s = {ddp / dp:.2f}x "
                         f"torch DDP ({work.per_step / ddp * 1e3:.0f})")
        for level in (1, 2):
            if dp and f"meta_dist ZeRO-{level}" in ms:
                parts.append(f"ZeRO-{level}/DP step time {ms[f'meta_dist ZeRO-{level}'] / dp:.3f}")
        z2, z3 = ms.get("meta_dist ZeRO-2"), ms.get("meta_dist ZeRO-3")
        fsdp = next((v for k, v in ms.items() if k.startswith("torch FSDP")), None)
        if z2 and z3:
            parts.append(f"ZeRO-3/ZeRO-2 step time {z3 / z2:.3f}")
        if z3 and fsdp:
            parts.append(f"ZeRO-3 = {fsdp / z3:.2f}x torch FSDP's speed")
        print("summary: " + ("; ".join(parts) or "(nothing to compare: run level 0 beside "
                                                  "another level, or with --torch)"))
        if args.plot:
            bars = {name.replace("meta_dist ", ""): {**{k: r["report"][k] / MIB for k in
                                                        ("params", "grads", "optimizer",
                                                         "buffers")}, "peak": r["peak"]}
                    for name, r in runs.items() if r["report"]}
            plot_memory(bars, args.plot, f"{work.describe()} ({params / 1e6:.2f}M params), "
                        f"Adam {args.precision}, {size} ranks: memory per rank")
            print(f"memory plot: {args.plot}")
    world.Free()
    dist.shutdown()
    return 0

