"""DTensor and tensor parallelism on CPU over the ccl backend.

    torchrun --nproc_per_node 2 examples/dtensor.py
    mpirun -n 2 python examples/dtensor.py

Part 1 shards a matrix by rows across the ranks, multiplies it by a
replicated one (each rank computes its rows), then gathers the product
(redistribute to Replicate = all_gather). Part 2 trains a two-layer MLP with
tensor parallelism: the first Linear split by output columns, the second by
input rows, so the hidden activations stay sharded and one all_reduce per
forward pass joins the partial outputs.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend


def matrices(world):
    gen = torch.Generator().manual_seed(7)
    return torch.randn(4 * world, 6, generator=gen), torch.randn(6, 3, generator=gen)


def make_mlp(world):
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 4 * world), nn.ReLU(), nn.Linear(4 * world, 2))


def batch():
    gen = torch.Generator().manual_seed(11)
    inputs = torch.randn(16, 8, generator=gen)
    return inputs, inputs[:, :2] - inputs[:, 2:4]  # something learnable


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", help="rank 0 saves the product and the trained parameters here (torch.save)")
    args = parser.parse_args()

    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    # Part 1: a row-sharded matmul. distribute_tensor sends rank 0's tensor, so
    # the other ranks' copies only need the right shape.
    a, b = matrices(world)
    a_rows = distribute_tensor(a, mesh, [Shard(0)])  # 4 rows per rank
    b_all = distribute_tensor(b, mesh, [Replicate()])
    product = a_rows @ b_all  # local matmul, result stays Shard(0)
    print(f"rank {rank}: local rows of A {tuple(a_rows.to_local().shape)}, product {product.placements}", flush=True)
    product = product.redistribute(mesh, [Replicate()]).to_local()  # all_gather: the full product everywhere
    if rank == 0:
        print(f"A @ B sum {product.double().sum().item():.10f}", flush=True)

    # Part 2: tensor-parallel MLP. Every rank sees the same (replicated) batch.
    model = parallelize_module(make_mlp(world), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    print(f"rank {rank}: first weight shard {tuple(model[0].weight.to_local().shape)}, "
          f"second {tuple(model[2].weight.to_local().shape)}", flush=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = batch()
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)  # output is already all-reduced
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)

    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # all_gather the shards
    checksum = sum(t.double().sum().item() for t in full.values())
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
    if rank == 0 and args.save:
        torch.save({"product": product, **full}, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
