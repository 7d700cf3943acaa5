#!/usr/bin/env python3
"""Where DDP's communication time goes: one model trained five ways on the default ccl group.

    torchrun --nproc_per_node 2 scripts/ddp_costs.py [--steps 7] [--threads 1]

Prints, for rank 0, the median step (ms, slowest rank) of:

  ddp         DistributedDataParallel as users make it (copies each gradient into its bucket,
              the allreduce overlapping backward, the bucket copied back);
  ddp-view    the same with gradient_as_bucket_view=True (no copy back);
  ddp-sync    DDP with a comm hook that all-reduces each bucket at once on the backward
              thread (no progress thread in play);
  after       no DDP: backward, then an allreduce of every gradient, waited for;
  local       no communication at all;

and each minus `local`: what it adds to a step (docs/performance.md, "What DDP itself costs").
The model is bench_ddp's default (6 Linear layers of 3072, batch 8 per rank), float32.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import oneccl_bind_pt  # noqa: F401


def make_model(width, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def sync_hook(_state, bucket):
    t = bucket.buffer()
    t.div_(dist.get_world_size())
    dist.all_reduce(t)
    fut = torch.futures.Future()
    fut.set_result(t)
    return fut


def wrap(kind, model):
    if kind in ("after", "local"):
        return model
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=kind == "ddp-view")
    if kind == "ddp-sync":
        ddp.register_comm_hook(None, sync_hook)
    return ddp


def median_step_ms(kind, args, x):
    net = wrap(kind, make_model(args.width, args.layers))
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        net(x).square().mean().backward()
        if kind == "after":
            for work in [dist.all_reduce(p.grad, async_op=True) for p in net.parameters()]:
                work.wait()
        opt.step()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(times[2:]) * 1000])  # the first two warm up
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=7, help="steps per way, the first two untimed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("ccl")
    x = torch.randn(8, args.width)
    ms = {kind: median_step_ms(kind, args, x) for kind in ("ddp", "ddp-view", "ddp-sync", "after", "local")}
    if dist.get_rank() == 0:
        for kind, v in ms.items():
            added = "" if kind == "local" else f"  (+{v - ms['local']:.1f} over local)"
            print(f"{kind:<9}{v:8.1f} ms{added}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
