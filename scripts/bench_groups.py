"""How long a process group takes to make and to destroy: ccl (the default transport), ccl on
oneCCL alone (ONECCL_BIND_PT_SHM=0) and gloo, at the given rank counts on this host.

    python scripts/bench_groups.py                       # 2, 3 and 4 ranks, 8 groups each
    python scripts/bench_groups.py --ranks 2 --groups 20 --json out.json

Per rank count and backend, ranks meeting at a TCPStore as under torchrun: init_process_group's time, the median and the largest time of
`new_group(all ranks)` plus its first all_reduce (4 floats), and `destroy_process_group()`
with those groups alive; each the slowest rank's. Jobs that build many groups (device meshes,
FSDP's hybrid sharding, DeepSpeed) pay the second figure per group.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = {"ccl": ("ccl", {}), "oneccl": ("ccl", {"ONECCL_BIND_PT_SHM": "0"}), "gloo": ("gloo", {})}


def _rank(rank, world, backend, env, groups, port, out):
    try:
        out.put(_timed(rank, world, backend, env, groups, port))
    except Exception as e:  # the parent reports it rather than waiting for this rank
        out.put((rank, f"{type(e).__name__}: {e}"))


def _timed(rank, world, backend, env, groups, port):
    os.environ.update(env)
    import oneccl_bind_pt  # noqa: F401  (registers "ccl")

    start = time.monotonic()
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    init = time.monotonic() - start
    made = []
    for _ in range(groups):
        start = time.monotonic()
        group = dist.new_group(list(range(world)))
        x = torch.ones(4)
        dist.all_reduce(x, group=group)
        made.append(time.monotonic() - start)
        assert x[0].item() == world
    dist.barrier()
    start = time.monotonic()
    dist.destroy_process_group()
    return rank, init, made, time.monotonic() - start


def measure(world, name, groups):
    backend, env = BACKENDS[name]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:  # a free port for the TCPStore, as torchrun's
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, backend, env, groups, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    failed = [g for g in got if len(g) == 2]
    if failed:
        raise SystemExit(f"{name}, {world} ranks: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed)))
    slowest = [max(g[2][i] for g in got) for i in range(groups)]
    return {"ranks": world, "backend": name, "init_s": max(g[1] for g in got),
            "group_ms_median": 1000 * statistics.median(slowest), "group_ms_max": 1000 * max(slowest),
            "destroy_ms": 1000 * max(g[3] for g in got)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="2,3,4", help="rank counts (default: %(default)s)")
    p.add_argument("--backends", default="ccl,oneccl,gloo", help=f"of {', '.join(BACKENDS)} (default: %(default)s)")
    p.add_argument("--groups", type=int, default=8, help="groups made per run (default: %(default)s)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    names = args.backends.split(",")
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or args.groups < 1:
        p.error(f"unknown backends {unknown}" if unknown else "--groups must be at least 1")
    rows = []
    print(f"{'ranks':>5} {'backend':>8} {'init s':>7} {'group ms (median)':>18} {'group ms (max)':>15} "
          f"{'destroy ms':>11}", flush=True)
    for world in map(int, args.ranks.split(",")):
        for name in names:
            row = measure(world, name, args.groups)
            rows.append(row)
            print(f"{world:>5} {name:>8} {row['init_s']:>7.2f} {row['group_ms_median']:>18.1f} "
                  f"{row['group_ms_max']:>15.1f} {row['destroy_ms']:>11.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
