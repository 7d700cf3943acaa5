"""FSDP2 (fully_shard) training on CPU over the ccl backend.

    torchrun --nproc_per_node 2 examples/fsdp.py
    mpirun -n 2 python examples/fsdp.py
    python examples/fsdp.py                     # one process

Every parameter is sharded across the ranks; each step gathers a layer's
parameters before it runs (all_gather) and scatters the averaged gradients
back (reduce_scatter). Each rank trains on its own slice of one global batch,
so the result equals one process training on the whole batch.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend

BATCH_PER_RANK = 16


def make_model():
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))


def global_batch(world):
    # Every rank draws the same global batch, then keeps only its slice.
    gen = torch.Generator().manual_seed(1000)
    inputs = torch.randn(BATCH_PER_RANK * world, 8, generator=gen)
    targets = torch.stack([inputs[:, :4].sum(1), inputs[:, 4:].sum(1)], dim=1)  # something learnable
    return inputs, targets


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", help="rank 0 saves the full trained parameters here (torch.save)")
    args = parser.parse_args()

    # torchrun and mpirun set these; a plain `python examples/fsdp.py` is a group of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    model = make_model()
    # Shard each Linear on its own (its parameters are gathered only while it
    # runs), then the root for whatever is left.
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    inputs, targets = global_batch(world)
    mine = slice(BATCH_PER_RANK * rank, BATCH_PER_RANK * (rank + 1))
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs[mine]), targets[mine])
        loss.backward()  # gradients are reduce-scattered (averaged) across ranks
        optimizer.step()  # each rank updates only its shard
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)  # the loss on the whole batch
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)

    # full_tensor() all-gathers a sharded parameter: every rank must call it.
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    checksum = sum(t.double().sum().item() for t in full.values())
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
    if rank == 0 and args.save:
        torch.save(full, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
