"""Fault-tolerant DDP on CPU: a rank dies in the middle of a step, the others shrink the group
and train on, without a restart.

    python examples/elastic_shrink.py [--nprocs 3] [--victim 2] [--kill-at 5] [--steps 10]

    # across two hosts: rank 0 on the first, ranks 1 and 2 on the second
    host-a$ python examples/elastic_shrink.py --ranks 0 --master-addr host-a
    host-b$ python examples/elastic_shrink.py --ranks 1,2 --master-addr host-a

Each rank trains the same small model with DistributedDataParallel on "ccl". At step
--kill-at, rank --victim SIGKILLs itself after its forward pass. The other ranks' backward
raises (on one host within half a second, naming the dead rank; across hosts at the group
timeout, --timeout), they call torch.distributed.shrink_group([victim]), which makes the
survivors a new default group (ranks renumbered), wrap the model in a new DDP on it and redo
the step. At the end every survivor prints a checksum of its parameters: they agree.

The ranks are plain processes started here, not torch.multiprocessing.spawn, torchrun or
mpirun: those end every rank when one dies, which is what this example is about not doing.
Rank 0 hosts the rendezvous store, so the victim is another rank.
"""

import argparse
import datetime
import multiprocessing
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import oneccl_bind_pt  # noqa: F401  registers the "ccl" backend


def batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=gen)
    return x, x.sum(1, keepdim=True)


def train(rank, world, args):
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.port))
    dist.init_process_group("ccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < args.steps:
        x, y = batch(step, dist.get_rank())
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), y)
        if step == args.kill_at and rank == args.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            loss.backward()  # DDP all-reduces the gradients here
        except RuntimeError as e:  # DistBackendError: a peer died
            print(f"rank {rank}: step {step} failed: {str(e).splitlines()[0]}", flush=True)
            del ddp  # its reducer's hooks go with it
            dist.shrink_group([args.victim])  # ranks of the group being shrunk: here, the first one's
            ddp = DDP(model)
            print(f"rank {rank}: now rank {dist.get_rank()} of {dist.get_world_size()}; redoing step {step}",
                  flush=True)
            continue
        opt.step()
        step += 1
    ones = torch.ones(4)
    dist.all_reduce(ones)
    assert ones[0].item() == dist.get_world_size(), ones
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    checksums = [None] * dist.get_world_size()
    dist.all_gather_object(checksums, checksum)
    if dist.get_rank() == 0:
        agree = all(c == checksum for c in checksums)
        print(f"{dist.get_world_size()} survivors trained {args.steps} steps; parameters "
              f"{'agree' if agree else 'DIFFER'}: checksums {checksums}", flush=True)
        if not agree:
            sys.exit(1)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=3)
    parser.add_argument("--victim", type=int, default=2, help="the rank that dies (not 0: it hosts the store)")
    parser.add_argument("--kill-at", type=int, default=5, help="the step it dies in")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20, help="the group timeout, seconds")
    parser.add_argument("--port", type=int, default=29503)
    parser.add_argument("--master-addr", default="127.0.0.1", help="the host of rank 0 (and of the store)")
    parser.add_argument("--ranks", help="the ranks to start here, comma-separated (default: all); "
                        "one invocation per host")
    args = parser.parse_args()
    if not 0 < args.victim < args.nprocs:
        parser.error(f"--victim must be a rank from 1 to {args.nprocs - 1}: rank 0 hosts the rendezvous store")
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(args.nprocs))
    if not all(0 <= r < args.nprocs for r in ranks):
        parser.error(f"--ranks must be ranks from 0 to {args.nprocs - 1}")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=train, args=(r, args.nprocs, args)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    expected = [-signal.SIGKILL if r == args.victim else 0 for r in ranks]
    print(f"exit codes {codes}")
    return 0 if codes == expected else 1


if __name__ == "__main__":
    sys.exit(main())
