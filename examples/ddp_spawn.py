"""The DDP example (ddp.py) launched with torch.multiprocessing.spawn.

    python examples/ddp_spawn.py [--nprocs 2] [--port 29501]
"""

import argparse
import os

import torch.distributed as dist
import torch.multiprocessing as mp
from ddp import train

import oneccl_bind_pt  # noqa: F401  registers the "ccl" backend


def run(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("ccl", rank=rank, world_size=world)
    train(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--port", type=int, default=29501)
    args = parser.parse_args()
    mp.spawn(run, args=(args.nprocs, args.port), nprocs=args.nprocs)
