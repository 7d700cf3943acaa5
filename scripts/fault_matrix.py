#!/usr/bin/env python3
"""Fault matrix: what the ranks of a ccl group do when one of them fails, on each transport.

    python scripts/fault_matrix.py                       # 20 trials per cell, 3 ranks
    python scripts/fault_matrix.py --trials 1 --json out.json

Every trial starts --world ranks (plain processes; rank 0 hosts the rendezvous TCPStore, as
under mpirun with env://) that stream mixed async collectives (allreduce, allgather,
broadcast, reduce_scatter, all-to-all; 4 B to 4 MiB, up to four in flight), all drawn from one
seed so every rank calls the same sequence. Once every rank streams, after a random delay of
up to half a second, one fault is injected:

- kill:  SIGKILL of a random rank other than 0;
- stop:  SIGSTOP of a random rank other than 0 (SIGKILLed once the others are done);
- store: SIGKILL of rank 0, which hosts the rendezvous store and oneCCL's key-value store;
- abort: a random rank's group is aborted from another thread of that rank (the group's
  abort(); torch's _abort_process_group() also rewrites torch's own registry of groups and
  the group's hook table without a lock, which crashes torch itself when another thread is
  issuing collectives: docs/reliability.md);
- link-down, drop: rank 0 runs on one host and the others on a second (two network
  namespaces joined by a veth pair, scripts/netns.py; needs root), and the hosts are cut
  apart: the link goes down, or every packet between them is dropped unseen. Across hosts
  every group runs on oneCCL, so these rows have no shared-memory cell.

A cell (fault x transport) is green when, in every trial, every rank that was not the
victim (under a partition: every rank) raised within the group timeout (--timeout) + 2 s of
the fault, then destroyed its group and exited 0; no rank hung (bounded by the timeout + 30
s), none died of SIGABRT or SIGSEGV, and no file of the trial's processes was left in
/dev/shm. The columns are the transports of this interpreter's torch release; run it with
each release's venv for the release columns.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns  # noqa: E402
import ports  # noqa: E402

FAULTS = ["kill", "stop", "store", "abort", *netns.PARTITIONS]
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


def rank_main(rank, world, folder, init_method, timeout, seed):
    import faulthandler
    import threading

    faulthandler.enable()  # a rank that dies of a signal says where (its log is kept when red)

    import torch
    import torch.distributed as dist

    import oneccl_bind_pt  # noqa: F401

    folder = Path(folder)
    dist.init_process_group("ccl", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))

    def abort_when_told():
        flag = folder / f"abort-{rank}"
        while not flag.exists():
            time.sleep(0.01)
        # Not kept in a variable: a daemon thread holding the last reference to a group
        # at exit dies in torch's ProcessGroup destructor (docs/reliability.md).
        dist.group.WORLD.abort()

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
    _write_result(folder, rank, result)  # before the teardown, which may hang or kill the rank
    # No fault excuses a teardown that raises, the abort victim's included: abort() tears down
    # the backend's communicators, and destroy_process_group() of a CPU group only drops it
    # from torch's registries (measured: it does not raise there). The trial turns red.
    try:
        dist.destroy_process_group()
        result["destroy_error"] = None
    except Exception as e:  # noqa: BLE001 - reported, and judged by the trial
        result["destroy_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _write_result(folder, rank, result)


def _write_result(folder, rank, result):
    tmp = folder / f"result-{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, folder / f"result-{rank}.json")  # whole or absent, even if the rank dies now


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


def _start_ranks(fault, transport, world, timeout, seed, folder, hosts, port):
    """The ranks as plain processes (a partition puts rank 0 on host 0, the others on host 1)."""
    addr = hosts.addr[0] if hosts else "127.0.0.1"
    init_method = f"tcp://{addr}:{port}"
    # Across hosts nothing of this machine's launch may leak in (a MASTER_ADDR, a pinned interface).
    env = {k: v for k, v in os.environ.items() if not (hosts and k.startswith(("CCL_", "FI_", "MASTER_", "ONECCL_")))}
    env.update(TRANSPORTS[transport])
    procs = []
    for r in range(world):
        cmd = [sys.executable, __file__, "--as-rank", json.dumps([r, world, str(folder), init_method, timeout, seed])]
        with open(folder / f"rank-{r}.log", "wb") as log:
            procs.append(subprocess.Popen(hosts.on(min(r, 1), cmd) if hosts else cmd, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def _no_hosts() -> str | None:
    """Why this machine cannot make network-namespace hosts, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("unshare")):
        return "network namespaces need iproute2 and unshare"
    try:
        with netns.hosts():
            return None
    except subprocess.CalledProcessError as e:
        return f"cannot create network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}"


def _exited(proc, seconds):
    try:
        proc.wait(max(0.1, seconds))
    except subprocess.TimeoutExpired:
        return False
    return True


def trial(fault, transport, world, timeout, seed):
    port = ports.free_port()
    try:
        return _trial(fault, transport, world, timeout, seed, port)
    finally:
        ports.release_port(port)  # every rank has exited: the next trial may have it


def _verdict(why, victim=None, errors=(), stacks=None, logs=None):
    """A trial's result: the same keys on every path, so a red one always says why."""
    return {"ok": not why, "why": "; ".join(why), "victim": victim, "errors": sorted(errors),
            "hung_stacks": stacks or {}, "logs": logs or {}}


def _logs(folder, ranks):
    return {r: (folder / f"rank-{r}.log").read_text(errors="replace")[-3000:] for r in ranks
            if (folder / f"rank-{r}.log").exists()}


def _trial(fault, transport, world, timeout, seed, port):
    rng = random.Random(seed)
    partition = fault in netns.PARTITIONS
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp, \
            (netns.hosts() if partition else contextlib.nullcontext()) as hosts:
        folder = Path(tmp)
        procs = _start_ranks(fault, transport, world, timeout, seed, folder, hosts, port)
        start = time.monotonic()
        while not all((folder / f"streaming-{r}").exists() for r in range(world)):
            if time.monotonic() - start > 120 or any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                    p.wait()
                codes = [p.returncode for p in procs]
                return _verdict([f"the ranks did not start streaming (exit codes {codes})"],
                                logs=_logs(folder, range(world)))
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.5))  # the random moment of the fault
        victim = None if partition else 0 if fault == "store" else rng.randrange(1, world)
        fault_at = time.time()
        if fault in ("kill", "store"):
            procs[victim].send_signal(signal.SIGKILL)
        elif fault == "stop":
            procs[victim].send_signal(signal.SIGSTOP)
        elif fault == "abort":
            (folder / f"abort-{victim}").touch()
        else:
            hosts.partition(fault)
        others = [r for r in range(world) if fault == "abort" or r != victim]
        hung = [r for r in others if not _exited(procs[r], fault_at + timeout + 30 - time.time())]
        stacks = {r: _stacks(procs[r].pid) for r in hung}
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        why = [f"ranks {hung} hung"] if hung else []
        results = {r: json.loads((folder / f"result-{r}.json").read_text())
                   for r in others if (folder / f"result-{r}.json").exists()}
        for r in others:
            code = procs[r].returncode
            if code != 0 and r not in hung:
                why.append(f"rank {r} exited {signal.Signals(-code).name if code < 0 else code}")
            if r not in results:
                if code == 0:
                    why.append(f"rank {r} exited 0 without writing its result")
                continue
            if results[r]["error"] is None:
                why.append(f"rank {r} never raised")
            elif results[r]["raised_at"] - fault_at > timeout + 2:
                why.append(f"rank {r} raised {results[r]['raised_at'] - fault_at:.1f} s after the fault")
            if "destroy_error" not in results[r]:
                if code == 0:
                    why.append(f"rank {r} exited 0 without finishing destroy_process_group()")
            elif results[r]["destroy_error"]:
                why.append(f"rank {r}'s destroy_process_group() raised {results[r]['destroy_error']}")
        left = _dev_shm_of([p.pid for p in procs] + [r["pid"] for r in results.values()])
        if left:
            why.append(f"left in /dev/shm: {left}")
        for name in left:
            os.unlink(f"/dev/shm/{name}")
        errors = {r["error"].split(" (rank")[0] for r in results.values() if r["error"]}
        errors |= {f"teardown: {r['destroy_error']}" for r in results.values() if r.get("destroy_error")}
        # A red trial keeps what its ranks printed (the end of it): the cause is often there.
        return _verdict(why, victim, errors, stacks, _logs(folder, others) if why else {})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="trials per cell")
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--timeout", type=float, default=5, help="the group timeout, seconds")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every trial's result here")
    p.add_argument("--as-rank", help=argparse.SUPPRESS)  # how a trial starts each rank
    args = p.parse_args(argv)
    if args.as_rank:
        rank_main(*json.loads(args.as_rank))
        return 0
    import torch

    faults, transports = args.faults.split(","), args.transports.split(",")
    if set(faults) & set(netns.PARTITIONS) and (why := _no_hosts()):
        print(f"the partition rows are left out: {why}", flush=True)
        faults = [f for f in faults if f not in netns.PARTITIONS]
    cells = {}
    for fault in faults:
        for transport in transports:
            if fault in netns.PARTITIONS and transport == "shm":
                continue  # shared memory never spans hosts
            runs = [trial(fault, transport, args.world, args.timeout, args.seed + 1000 * i) for i in range(args.trials)]
            cells[f"{fault} {transport}"] = runs
            bad = [r for r in runs if not r["ok"]]
            print(f"{fault:9} {transport:6} {len(runs) - len(bad)}/{len(runs)} green"
                  + (f"; first red: {bad[0]['why']}" if bad else ""), flush=True)
    title = f"torch {torch.__version__}, {args.world} ranks, group timeout {args.timeout:g} s, {args.trials} trial(s) per cell"
    header = ["fault", *transports]
    rows = [[f, *(f"{sum(r['ok'] for r in cells[f'{f} {t}'])}/{args.trials}" if f"{f} {t}" in cells else "-"
                  for t in transports)] for f in faults]
    from oneccl_bind_pt.bench import print_table

    print_table(title, header, rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "world": args.world,
                                               "timeout": args.timeout, "cells": cells}, indent=1))
    return 0 if all(r["ok"] for runs in cells.values() for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
