"""Pipeline parallelism (torch.distributed.pipelining) on CPU over the ccl backend.

    torchrun --nproc_per_node 2 examples/pipeline.py
    mpirun -n 2 python examples/pipeline.py
    python examples/pipeline.py                 # one process: one stage

The model's blocks are split into one stage per rank. Each step cuts the batch
into microbatches; the schedule (1F1B by default, or GPipe) runs them through
the stages, sending activations forward and their gradients back between
neighbouring ranks (batch_isend_irecv), so every rank holds and updates only
its own blocks. Gradients are averaged over the microbatches, so the result
equals one process training the whole model on the whole batch. Across hosts
those sends go through oneCCL.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import oneccl_bindings_for_pytorch  # noqa: F401  registers the "ccl" backend

BLOCKS = 4
WIDTH = 16
BATCH = 32
MICROBATCHES = 4


def make_model():
    torch.manual_seed(0)  # same initial weights on every rank
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS)])


def batch():
    gen = torch.Generator().manual_seed(1000)
    inputs = torch.randn(BATCH, WIDTH, generator=gen)
    return inputs, inputs.flip(1).cumsum(1) / WIDTH  # something learnable


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


def stage_blocks(rank, world):
    """The blocks stage `rank` of `world` holds: an even share, in order."""
    per = BLOCKS // world
    return range(rank * per, (rank + 1) * per)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--save", help="rank 0 saves the full trained parameters here (torch.save)")
    args = parser.parse_args()

    # torchrun and mpirun set these; a plain `python examples/pipeline.py` is a group of one.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if BLOCKS % world:
        raise SystemExit(f"{BLOCKS} blocks do not split evenly into {world} stages")

    mine = stage_blocks(rank, world)
    model = make_model()
    stage_module = nn.Sequential(*[model[i] for i in mine])
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule_class = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    # scale_grads: each microbatch's gradient counts 1 / MICROBATCHES, as one batch's mean would.
    schedule = schedule_class(stage, MICROBATCHES, loss_fn=loss_fn, scale_grads=True)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.1, momentum=0.9)

    inputs, targets = batch()
    for step in range(args.steps):
        optimizer.zero_grad()
        losses = []
        if world == 1:
            schedule.step(inputs, target=targets, losses=losses)
        elif rank == 0:
            schedule.step(inputs)
        elif rank == world - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        if rank == world - 1:
            print(f"step {step}: loss {torch.stack(losses).mean().item():.6f}", flush=True)

    # Every stage's blocks, named as in the whole model, gathered on every rank.
    own = {f"{i}.{name}": p.detach() for i, block in zip(mine, stage_module) for name, p in block.named_parameters()}
    parts = [None] * world
    dist.all_gather_object(parts, own)
    full = {name: t for part in parts for name, t in part.items()}
    checksum = sum(t.double().sum().item() for t in full.values())
    print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
    if rank == 0 and args.save:
        torch.save(full, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
