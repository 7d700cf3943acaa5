"""A multi-node job on the ccl backend: check the layout, allreduce, a few DDP steps.

The same command on every node (torchrun; node-a hosts the rendezvous):
    torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint node-a:29500 --rdzv_id job1 train.py

Once, from node-a (Intel MPI; the hostfile lists the nodes):
    MASTER_ADDR=node-a mpirun -f hostfile -n 4 -ppn 2 python train.py

See docs/multi-node.md.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend


def main():
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    print(f"rank {rank} of {world}: host {socket.gethostname()}, local rank {local_rank}, "
          f"oneCCL interface {os.environ.get('CCL_KVS_IFACE')}", flush=True)

    # Every rank contributes rank + 1: the sum is world * (world + 1) / 2 everywhere.
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    print(f"rank {rank} allreduce {t[0].item():.1f} (expected {world * (world + 1) / 2:.1f})", flush=True)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)  # each rank its own data
    for step in range(3):
        inputs, targets = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
