#!/usr/bin/env python3
"""Fault matrix: what the ranks of a ccl group do when one of them fails, on each transport.

    python scripts/fault_matrix.py                       # 20 trials per cell, 3 ranks
    python scripts/fault_matrix.py --trials 1 --json out.json

Every trial starts --world ranks (plain processes, a FileStore) that stream mixed async
collectives (allreduce, allgather, broadcast, reduce_scatter, all-to-all; 4 B to 4 MiB, up to
four in flight), all drawn from one seed so every rank calls the same sequence. Once every
rank streams, after a random delay of up to half a second, one fault is injected:

- kill:  SIGKILL of a random rank other than 0;
- stop:  SIGSTOP of a random rank other than 0 (SIGKILLed once the others are done);
- store: SIGKILL of rank 0, which hosts the rendezvous store and oneCCL's key-value store;
- abort: a random rank's group is aborted from another thread of that rank
  (torch.distributed.distributed_c10d._abort_process_group()).

A cell (fault x transport) is green when, in every trial, every rank that was not the
victim raised within the group timeout (--timeout) + 2 s of the fault, then destroyed its
group and exited 0; no rank hung (bounded by the timeout + 30 s), none died of SIGABRT or
SIGSEGV, and no file of the trial's processes was left in /dev/shm. The columns are the
transports of this interpreter's torch release; run it with each release's venv for the
release columns.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAULTS = ["kill", "stop", "store", "abort"]
TRANSPORTS = {"shm": {"ONECCL_BIND_PT_SHM": "1"}, "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}
OPS = ["allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall"]


# ---------------------------------------------------------------- a rank

def _issue(dist, torch, op, numel, world):
    n = max(world, numel - numel % world)
    t = torch.ones(n)
    if op == "allreduce":
        return dist.all_reduce(t, async_op=True)
    if op == "allgather":
        # torch 2.13 renamed the tensor forms (the old names warn); older releases lack the new ones
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(torch.empty(n * world), t, async_op=True)
    if op == "broadcast":
        return dist.broadcast(t, 0, async_op=True)
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(torch.empty(n // world), t, async_op=True)
    return dist.all_to_all_single(torch.empty(n), t, async_op=True)


def rank_main(rank, world, folder, env, timeout, seed):
    import threading

    os.environ.update(env)
    import torch
    import torch.distributed as dist

    import oneccl_bind_pt  # noqa: F401

    folder = Path(folder)
    dist.init_process_group("ccl", init_method=f"file://{folder / 'store'}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))

    def abort_when_told():
        flag = folder / f"abort-{rank}"
        while not flag.exists():
            time.sleep(0.01)
        dist.distributed_c10d._abort_process_group()

    threading.Thread(target=abort_when_told, daemon=True).start()
    rng = random.Random(seed)  # the same on every rank: the same sequence of collectives
    (folder / f"streaming-{rank}").touch()
    result = {"rank": rank, "pid": os.getpid()}
    inflight = []
    deadline = time.monotonic() + 4 * timeout + 60
    try:
        while time.monotonic() < deadline:
            inflight.append(_issue(dist, torch, rng.choice(OPS), 1 << rng.randrange(0, 21), world))
            if len(inflight) == 4:
                inflight.pop(0).wait()
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - what the fault raises is the result
        result.update(raised_at=time.time(), error=f"{type(e).__name__}: {str(e).splitlines()[0]}")
    (folder / f"result-{rank}.json").write_text(json.dumps(result))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - an aborted default group is already gone
        pass


# ---------------------------------------------------------------- a trial

def _dev_shm_of(pids):
    """/dev/shm files named by one of these pids (oneCCL names its files "<pid>:<n>:<n>";
    ours are memfds and never appear there)."""
    pids = {str(p) for p in pids}
    return sorted(n for n in os.listdir("/dev/shm") if pids & set(re.split(r"\D+", n)))


def _stacks(pid):
    """Where a hung rank is: every thread's innermost frames (gdb, when there is one)."""
    if not shutil.which("gdb"):
        return "no gdb to show where it hung"
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 40"],
                         capture_output=True, text=True, timeout=120).stdout
    return "\n".join(line for line in out.splitlines() if line.startswith(("#", "Thread")))


def trial(fault, transport, world, timeout, seed):
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        folder = Path(tmp)
        procs = [ctx.Process(target=rank_main, args=(r, world, tmp, TRANSPORTS[transport], timeout, seed))
                 for r in range(world)]
        for p in procs:
            p.start()
        start = time.monotonic()
        while not all((folder / f"streaming-{r}").exists() for r in range(world)):
            if time.monotonic() - start > 120 or any(p.exitcode is not None for p in procs):
                for p in procs:
                    p.kill()
                return {"ok": False, "why": "the ranks did not start streaming"}
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))  # the random moment of the fault
        victim = 0 if fault == "store" else rng.randrange(1, world)
        fault_at = time.time()
        if fault in ("kill", "store"):
            os.kill(procs[victim].pid, signal.SIGKILL)
        elif fault == "stop":
            os.kill(procs[victim].pid, signal.SIGSTOP)
        else:
            (folder / f"abort-{victim}").touch()
        others = [r for r in range(world) if fault == "abort" or r != victim]
        hung = []
        for r in others:
            procs[r].join(max(0.1, fault_at + timeout + 30 - time.time()))
            if procs[r].exitcode is None:
                hung.append(r)
        stacks = {r: _stacks(procs[r].pid) for r in hung}
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        why = [f"ranks {hung} hung"] if hung else []
        results = {r: json.loads((folder / f"result-{r}.json").read_text())
                   for r in others if (folder / f"result-{r}.json").exists()}
        for r in others:
            code = procs[r].exitcode
            if code != 0 and r not in hung:
                why.append(f"rank {r} exited {signal.Signals(-code).name if code < 0 else code}")
            if r not in results:
                continue
            if results[r]["error"] is None:
                why.append(f"rank {r} never raised")
            elif results[r]["raised_at"] - fault_at > timeout + 2:
                why.append(f"rank {r} raised {results[r]['raised_at'] - fault_at:.1f} s after the fault")
        left = _dev_shm_of(p.pid for p in procs)
        if left:
            why.append(f"left in /dev/shm: {left}")
        for name in left:
            os.unlink(f"/dev/shm/{name}")
        errors = sorted({r["error"].split(" (rank")[0] for r in results.values() if r["error"]})
        return {"ok": not why, "why": "; ".join(why), "victim": victim, "errors": errors, "hung_stacks": stacks}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="trials per cell")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--timeout", type=float, default=5, help="the group timeout, seconds")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every trial's result here")
    args = p.parse_args(argv)
    import torch

    faults, transports = args.faults.split(","), args.transports.split(",")
    cells = {}
    for fault in faults:
        for transport in transports:
            runs = [trial(fault, transport, args.world, args.timeout, args.seed + 1000 * i) for i in range(args.trials)]
            cells[f"{fault} {transport}"] = runs
            bad = [r for r in runs if not r["ok"]]
            print(f"{fault:6} {transport:7} {len(runs) - len(bad)}/{len(runs)} green"
                  + (f"; first red: {bad[0]['why']}" if bad else ""), flush=True)
    title = f"torch {torch.__version__}, {args.world} ranks, group timeout {args.timeout:g} s, {args.trials} trial(s) per cell"
    header = ["fault", *transports]
    rows = [[f, *(f"{sum(r['ok'] for r in cells[f'{f} {t}'])}/{args.trials}" for t in transports)] for f in faults]
    from oneccl_bind_pt.bench import print_table

    print_table(title, header, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "world": args.world,
                                               "timeout": args.timeout, "cells": cells}, indent=1))
    return 0 if all(r["ok"] for runs in cells.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
