#!/usr/bin/env python3
"""Aborting a group from a second thread while the first issues collectives, one rank.

    python scripts/abort_thread_race.py --how world --runs 30   # _abort_process_group()
    python scripts/abort_thread_race.py --how group --runs 30   # the group's abort()

Each run is a fresh process: the main thread streams small all_reduces on a one-rank ccl
group while a daemon thread aborts it after a random 0-200 ms. Prints how the runs ended
(exit code, or the signal that killed the process). On torch 2.15, _abort_process_group()
drops the group's FlightRecorderHook while the main thread may be inside it, and torch's
hook table has no lock (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import random
import signal
import subprocess
import sys
import threading
import time


def _one_run(how: str, seed: int) -> None:
    import torch
    import torch.distributed as dist

    import oneccl_bind_pt  # noqa: F401

    dist.init_process_group("ccl", init_method="tcp://127.0.0.1:0", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=5))
    delay = random.Random(seed).uniform(0.0, 0.2)

    def abort():
        time.sleep(delay)
        if how == "world":
            dist.distributed_c10d._abort_process_group()
        else:
            dist.group.WORLD.abort()  # not kept: see docs/reliability.md on daemon threads

    threading.Thread(target=abort, daemon=True).start()
    t = torch.ones(1024)
    try:
        while True:
            dist.all_reduce(t, async_op=True).wait()
    except Exception:  # noqa: BLE001 - the abort's error (or torch's) ends the stream
        pass
    time.sleep(0.3)  # the abort thread finishes; only torch's own race is measured
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--how", choices=["world", "group"], required=True)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--as-run", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.as_run is not None:
        _one_run(args.how, args.as_run)
        return 0
    ends = collections.Counter()
    for seed in range(args.runs):
        code = subprocess.run([sys.executable, __file__, "--how", args.how, "--as-run", str(seed)],
                              capture_output=True, timeout=120).returncode
        ends["exit 0" if code == 0 else signal.Signals(-code).name if code < 0 else f"exit {code}"] += 1
    print(f"{args.how}: {args.runs} runs: " + ", ".join(f"{n} {end}" for end, n in ends.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
