#!/usr/bin/env python3
"""Whether point-to-point messages between two ranks arrive in send order on the oneCCL path.

    python scripts/p2p_order.py --workers 0      # the package's default: no oneCCL worker
    python scripts/p2p_order.py --workers 1      # one oneCCL worker thread per rank
    python scripts/p2p_order.py --in-flight 1    # one message each way at a time

Two ranks on this host, every op through oneCCL (ONECCL_BIND_PT_SHM=0). Each round, each rank
posts --in-flight irecvs from the other (tags 0, 1, ...), then as many isends, then waits for
all of them. oneCCL has no tags: a recv takes a message from its sender, and for tags to mean
anything the i-th recv must get the i-th send. Prints, per rank, how many of the received
tensors held another send's values. Handed to oneCCL all at once, several in flight were matched
out of order, rarely without its worker threads and often with them; the transport now hands a
peer's sends (and recvs) over one at a time, and none should be (docs/multi-node.md,
"Point-to-point across hosts").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def _rank(rank: int, store: str, rounds: int, in_flight: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import oneccl_bind_pt  # noqa: F401

    dist.init_process_group("ccl", init_method=f"file://{store}", rank=rank, world_size=2)
    peer, wrong = 1 - rank, 0
    for n in range(rounds):
        outs = [torch.zeros(1 << 14) for _ in range(in_flight)]
        works = [dist.irecv(o, src=peer, tag=t) for t, o in enumerate(outs)]
        works += [dist.isend(torch.full((1 << 14,), 100.0 * n + 10 * rank + t), dst=peer, tag=t)
                  for t in range(in_flight)]
        for w in works:
            w.wait()
        wrong += sum(not torch.equal(o, torch.full((1 << 14,), 100.0 * n + 10 * peer + t)) for t, o in enumerate(outs))
    queue.put((rank, wrong, os.environ.get("CCL_WORKER_OFFLOAD"), os.environ.get("CCL_WORKER_COUNT")))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="0", help="ONECCL_BIND_PT_WORKERS for both ranks (default 0)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds (default 300)")
    parser.add_argument("--in-flight", type=int, default=3, help="messages each way per round, all posted before "
                        "any is waited for (default 3)")
    args = parser.parse_args(argv)
    os.environ.update(ONECCL_BIND_PT_SHM="0", ONECCL_BIND_PT_WORKERS=args.workers)
    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args.rounds, args.in_flight, queue), nprocs=2)
    for rank, wrong, offload, count in sorted(queue.get() for _ in range(2)):
        print(f"rank {rank}: {wrong} of {args.in_flight * args.rounds} messages out of order "
              f"(CCL_WORKER_OFFLOAD={offload}, CCL_WORKER_COUNT={count})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
