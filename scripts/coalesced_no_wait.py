"""How often a coalesced all_reduce's tensors are read wrong before wait(), per backend.

    torchrun --nproc_per_node 2 scripts/coalesced_no_wait.py --backend gloo
    torchrun --nproc_per_node 2 scripts/coalesced_no_wait.py --backend ccl

In c10d a result is defined once its work is waited on; this counts how often code that
reads early (one case of torch-ccl's test file does) sees a value the collective has not
written yet, and times the coalesced call with its wait on small tensors.
"""

import argparse
import time

import torch
import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401  registers "ccl"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="ccl")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    want = float(sum(range(1, world + 1)))
    early = 0
    for _ in range(args.calls):
        xs = [torch.full((4,), float(rank + 1)), torch.full((8,), float(rank + 1))]
        work = dist.all_reduce_coalesced(xs, async_op=True)
        early += not all(torch.equal(x, torch.full_like(x, want)) for x in xs)  # read before wait()
        work.wait()
        assert all(torch.equal(x, torch.full_like(x, want)) for x in xs)  # defined after wait()
    xs = [torch.ones(16) for _ in range(4)]
    for _ in range(50):
        dist.all_reduce_coalesced(xs)
    start = time.perf_counter()
    for _ in range(500):
        dist.all_reduce_coalesced(xs)
    us = (time.perf_counter() - start) / 500 * 1e6
    print(f"{args.backend} rank {rank}: read before wait() wrong in {early}/{args.calls} calls; "
          f"all_reduce_coalesced + wait on 4 x 16 floats: {us:.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
