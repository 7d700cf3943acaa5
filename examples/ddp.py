"""DDP training on the ccl backend: a Linear(4, 5) model, SGD, MSE loss.

    torchrun --nproc_per_node 2 examples/ddp.py
    mpirun -n 2 python examples/ddp.py
    python examples/ddp.py                      # one process
    torchrun --nproc_per_node 2 examples/ddp.py --backend gloo   # the same training on gloo
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend


def train(rank, world, steps=3):
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts them)
    model = nn.Linear(4, 5)
    if world > 1:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()

    torch.manual_seed(100 + rank)  # each rank trains on its own data
    for step in range(steps):
        inputs, labels = torch.randn(2, 4), torch.randn(2, 5)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()  # DDP averages gradients across ranks here
        optimizer.step()
        print(f"rank {rank} step {step}: loss {loss.item():.4f}", flush=True)

    # Identical on every rank when the gradients were really averaged.
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)


def main():
    # torchrun and mpirun provide these (the package maps mpirun's); a plain
    # `python examples/ddp.py` runs as a group of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    ap = argparse.ArgumentParser(description="DDP training on 2 ranks")
    ap.add_argument("--backend", default="ccl", help="process group backend (default: ccl)")
    backend = ap.parse_args().backend
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank {rank} of {world}: {backend} process group ready", flush=True)
    train(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
