"""The PyTorch side of ``bench train``: torch.distributed started from MPI, and torch's variants.

Imports torch (the ``bench`` extra); meta_dist.bench.train imports it only when --torch asks for
it, after meta_dist's MPI is up. The variants train a workload's PyTorch twin
(meta_dist.bench.workloads) with the same data and weights as the meta_dist levels.
"""

import os
import socket

import torch
import torch.distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from meta_dist.lazy_mpi import MPI


def start_torch(world, device):
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) with MPI's rank and size."""
    torch.set_num_threads(1)
    port = None
    if world.rank == 0:
        with socket.socket() as sock:  # a free port now; gloo binds it right after
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world.bcast(port)))
    if device == "cuda":
        local = world.Split_type(MPI.COMM_TYPE_SHARED).rank
        torch.cuda.set_device(local % torch.cuda.device_count())
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo",
                                         rank=world.rank, world_size=world.size)


def torch_variant(kind, work, args):
    """Return (step function, None, None) for PyTorch's variant ``kind``; gloo on the CPU.

    ``kind``: "ddp", "zero" (DDP with ZeroRedundancyOptimizer) or "fsdp" (FSDP2 ``fully_shard``
    on each of the workload's units, then on the model: FULL_SHARD, or SHARD_GRAD_OP's behaviour
    with --no-reshard).
    """
    model, units = work.torch_model()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    model.to(device or "cpu")
    if kind == "fsdp":
        mesh = init_device_mesh(device.type if device else "cpu",
                                (torch.distributed.get_world_size(),))
        for unit in units:  # one unit each, as meta_dist's level 3 gathers layer by layer
            fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard)
        ddp = fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard)
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb,
                                      device_ids=[device] if device else None)
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    else:
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)

    def step(x, y):
        opt.zero_grad()
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = work.torch_loss(ddp(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # a Python float, as the meta_dist step returns

    return step, None, None
