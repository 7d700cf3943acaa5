"""How the package reads a rank's cores under the launcher that started it: each rank makes the
ccl group, runs one large all_reduce (which starts its helper threads, if it has any) and prints
one JSON line: its CPUs, `_C.rank_cores` (cores, pinned, why, crowded), `_C.helpers()`, the
helper threads it runs and torch's intra-op threads.

Under torchrun or mpirun: no arguments. Under mp.spawn: `--spawn PORT [--own-cpu]`, 2 ranks;
--own-cpu pins each rank to a CPU of its own before the group, as a script may do itself.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oneccl_bindings_for_pytorch  # noqa: F401
from oneccl_bind_pt import _C

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import helper_threads  # noqa: E402


def report(own_cpu: int | None = None) -> None:
    if own_cpu is not None:
        os.sched_setaffinity(0, {own_cpu})
    dist.init_process_group("ccl")
    t = torch.ones(4 << 20)
    dist.all_reduce(t)
    world = dist.get_world_size()
    cores, pinned, why, crowded = _C.rank_cores(int(os.environ["CCL_LOCAL_SIZE"]))
    print(json.dumps({"rank": dist.get_rank(), "cpus": sorted(os.sched_getaffinity(0)), "cores": cores,
                      "pinned": pinned, "why": why, "crowded": crowded, "helpers": _C.helpers(),
                      "helper_threads": helper_threads(), "torch_threads": torch.get_num_threads(), "sum_ok": bool(t.eq(world).all())}), flush=True)
    dist.destroy_process_group()


def spawned(rank: int, port: int, own_cpu: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    cpus = sorted(os.sched_getaffinity(0))
    report(cpus[rank % len(cpus)] if own_cpu else None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spawn", type=int, metavar="PORT")
    parser.add_argument("--own-cpu", action="store_true")
    args = parser.parse_args()
    if args.spawn:
        mp.spawn(spawned, args=(args.spawn, args.own_cpu), nprocs=2)
    else:
        report()
