#!/usr/bin/env python3
"""Collective benchmark across two hosts made on this machine: the ccl backend against gloo.

    sudo .venv/bin/python scripts/bench_hosts.py              # the table in docs/multi-node.md
    python scripts/bench_hosts.py --layouts 2x1 --ops allreduce --max-bytes 64K --json out.json

Makes two network-namespace hosts joined by a veth pair (scripts/netns.py: needs root and
iproute2), then for each layout (HOSTSxRANKS: 2x1 is one rank per host, 2x2 two) starts the
ranks of `python -m oneccl_bind_pt.bench` on them with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, as a launcher would. Rank r runs on host r % 2, so ranks 0 and 1 (the pair
bench's sendrecv ping-pongs between) are on different hosts. Every group spans both hosts, so
ccl runs on oneCCL over libfabric's TCP provider, gloo on its own TCP transport.

The veth pair is a memory copy inside one kernel: loopback speed, no NIC, no wire. The table
shows what each backend's software costs across hosts, not what a network gives.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import netns

from oneccl_bind_pt.bench import human_bytes, print_table

OPS = "allreduce,allgather,alltoall,sendrecv"
# Set by this script per rank, or names of interfaces the namespaces do not have.
DROPPED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CCL_KVS_IFACE",
           "FI_TCP_IFACE")


def run_layout(hosts, ranks_per_host, bench_args, port, timeout):
    """bench's points (its JSON) for 2 x ranks_per_host ranks across the two hosts."""
    world = 2 * ranks_per_host
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        report = Path(tmp) / "bench.json"
        base = {k: v for k, v in os.environ.items() if k not in DROPPED}
        base.update(MASTER_ADDR=hosts.addr[0], MASTER_PORT=str(port), WORLD_SIZE=str(world))
        cmd = [sys.executable, "-m", "oneccl_bind_pt.bench", *bench_args, "--quiet"]
        logs = [stack.enter_context(open(Path(tmp) / f"rank{r}.log", "w+")) for r in range(world)]
        # Not started in a source checkout: `-m` would import the package from it, unbuilt.
        # gloo binds to the address of the host name, which nothing resolves here: name its device.
        procs = [subprocess.Popen(hosts.on(r % 2, cmd + (["--json", report] if r == 0 else [])), cwd=tmp,
                                  env={**base, "RANK": str(r), "GLOO_SOCKET_IFNAME": hosts.dev[r % 2]},
                                  start_new_session=True, stdout=logs[r],
                                  stderr=subprocess.STDOUT)
                 for r in range(world)]
        deadline = time.monotonic() + timeout
        try:
            # Until all exit, one fails (its peers would wait for it until the group timeout),
            # or the time is up.
            while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{world} ranks: not done within {timeout:.0f} s")
                time.sleep(0.2)
        finally:
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)  # its own session: the rank and nothing else
                    p.wait()
        if failed:
            logs[failed[0]].seek(0)
            raise SystemExit(f"{world} ranks: rank {failed[0]} exited {procs[failed[0]].returncode}:\n"
                             f"{logs[failed[0]].read()[-4000:]}")
        return json.loads(report.read_text())["points"]


def table(results):
    """One row per op and size; per layout the two medians (us) and gloo/ccl."""
    rows = {}
    for layout, points in results.items():
        for p in points:
            rows.setdefault((p["op"], p["bytes"]), {}).setdefault(layout, {})[p["backend"]] = p
    header = ["op", "bytes"]
    for layout in results:
        header += [f"{layout} ccl us", f"{layout} gloo us", f"{layout} gloo/ccl"]
    header.append("correct")
    lines = []
    for (op, nbytes), by_layout in rows.items():
        row, correct = [op, human_bytes(nbytes)], True
        for layout in results:
            by = by_layout.get(layout, {})
            ccl, gloo = by.get("ccl"), by.get("gloo")
            row += [f"{ccl['median_us']:,.1f}" if ccl else "-", f"{gloo['median_us']:,.1f}" if gloo else "-",
                    f"{gloo['median_us'] / ccl['median_us']:.1f}x" if ccl and gloo else "-"]
            correct &= all(p["correct"] for p in by.values())
        lines.append(row + ["yes" if correct else "NO"])
    return header, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x1,2x2", help="HOSTSxRANKS per host, comma-separated; two hosts only")
    ap.add_argument("--ops", default=OPS, help="as bench's --ops (default %(default)s)")
    ap.add_argument("--min-bytes", default="4K")
    ap.add_argument("--max-bytes", default="16M")
    ap.add_argument("--factor", type=int, default=16)
    ap.add_argument("--backends", default="ccl,gloo", help="as bench's --backends (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=0.2, help="as bench's --seconds")
    ap.add_argument("--rounds", type=int, default=4, help="as bench's --rounds")
    ap.add_argument("--port", type=int, default=29731, help="MASTER_PORT on host 0 (its namespace is new: "
                    "nothing else listens there)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per layout before its ranks are killed")
    ap.add_argument("--json", help="write every layout's points here")
    args = ap.parse_args(argv)
    layouts = {}
    for layout in args.layouts.split(","):
        nhosts, _, per_host = layout.partition("x")
        if nhosts != "2" or not per_host.isdigit() or int(per_host) < 1:
            ap.error(f"layout {layout!r}: expected 2xN (two hosts, N ranks each)")
        layouts[layout] = int(per_host)
    bench_args = ["--ops", args.ops, "--dtypes", "float32", "--min-bytes", args.min_bytes, "--max-bytes",
                  args.max_bytes, "--factor", str(args.factor), "--backends", args.backends, "--seconds",
                  str(args.seconds), "--rounds", str(args.rounds)]
    results = {}
    with netns.hosts() as hosts:
        for i, (layout, per_host) in enumerate(layouts.items()):
            # A port per layout: the last layout's store may still hold its own.
            results[layout] = run_layout(hosts, per_host, bench_args, args.port + i, args.timeout)
    header, lines = table(results)
    print_table(f"two network-namespace hosts joined by a veth pair, {os.cpu_count()} CPUs; float32; "
                "median of the slowest rank per call", header, lines)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "layouts": results}, indent=1))
    return 0 if all(row[-1] == "yes" for row in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
