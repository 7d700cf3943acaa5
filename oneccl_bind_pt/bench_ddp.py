"""DDP step time: one model trained through ccl, through ccl on oneCCL alone, and through gloo.

    python -m oneccl_bind_pt.bench_ddp                        # spawns 2 ranks here
    python -m oneccl_bind_pt.bench_ddp --nprocs 4 --dtypes float32
    torchrun --nproc_per_node 2 -m oneccl_bind_pt.bench_ddp --json ddp.json --plot ddp.png

The model is an MLP of --layers square Linear layers of --width features (default 6 x 3072:
56.6 M parameters, 226 MB of float32 gradients, nine of DDP's 25 MiB buckets), trained with
SGD on random batches of --batch rows. Each configuration wraps its own copy of it (the same
initial values) in DistributedDataParallel on its own group:

- `ccl`: the default ccl group, what users get (on one host, the shared-memory transport);
- `oneccl`: a ccl group created with ONECCL_BIND_PT_SHM=0 (every collective through oneCCL,
  with its own shared-memory transport, CCL_ATL_SHM=1);
- `gloo`: a gloo group;
- `local`: the same model without DDP (no communication): the floor, so that `step - local`
  is what communication costs a step.

The configurations take turns step by step for --steps timed steps (after --warmup), so a
slow phase of the machine falls on all of them. A step is zero_grad, forward, loss, backward
(DDP all-reduces the buckets as their gradients are ready) and the optimizer step; its time is
the slowest rank's. Every configuration sees the same batches, so at the end each one's
parameters must be equal on every rank, and close to the others' (the sums' order differs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from oneccl_bind_pt.bench import DTYPES, GROUP_ENV, check_choices, group_with, launch, print_table

CONFIGS = ["ccl", "oneccl", "gloo", "local"]
# Close, not equal, across configurations: each sums the ranks' gradients in its own order.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def make_model(args, dtype):
    torch.manual_seed(0)  # every rank and configuration starts from the same values
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def train(args, rank, world, dtype, groups, control):
    """Median and p90 ms per step (slowest rank) per configuration, and whether the parameters
    agree across ranks and configurations."""
    ddp = {c: make_model(args, dtype) if g is None else
           nn.parallel.DistributedDataParallel(make_model(args, dtype), process_group=g) for c, g in groups.items()}
    opt = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in ddp.items()}
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own shard of the data
    times = {c: [] for c in ddp}
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, args.width, generator=gen).to(dtype)
        for c, model in ddp.items():
            dist.barrier(group=control)  # every rank starts the step together
            start = time.perf_counter()
            opt[c].zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            opt[c].step()
            if step >= args.warmup:
                times[c].append(time.perf_counter() - start)
    summary = {}
    for c, ts in times.items():
        slowest = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
        ms = sorted(slowest.mul(1e3).tolist())
        summary[c] = {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "steps": ms}
    flat = {c: torch.cat([p.detach().float().flatten() for p in m.parameters()]) for c, m in ddp.items()
            if groups[c] is not None}  # `local` trained on its rank's data alone
    for c, params in flat.items():
        # Equal on every rank: rank 0's values against each rank's own.
        theirs = params.clone()
        dist.broadcast(theirs, 0, group=control)
        same = torch.tensor([int(torch.equal(theirs, params))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=control)
        summary[c]["equal_on_all_ranks"] = bool(same.item())
        summary[c]["max_diff_vs_gloo"] = (params - flat["gloo"]).abs().max().item() if "gloo" in flat else 0.0
        summary[c]["close_to_gloo"] = summary[c]["max_diff_vs_gloo"] <= TOLERANCE[dtype]
    return summary


def run(rank, world, args):
    control = dist.new_group(backend="gloo")  # barriers and the timings, outside what is measured
    groups = {"ccl": dist.group.WORLD, "oneccl": group_with(world, GROUP_ENV["oneccl"]),
              "gloo": dist.new_group(backend="gloo"), "local": None}
    groups = {c: g for c, g in groups.items() if c in args.configs}
    results = {dt: train(args, rank, world, DTYPES[dt], groups, control) for dt in args.dtypes}
    if rank != 0:
        return
    params = args.layers * (args.width * args.width + args.width)
    report = {"world": world, "cpus": os.cpu_count(), "torch": torch.__version__, "parameters": params,
              "width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
              "results": results}
    rows = []
    for dt, by in results.items():
        for c, r in by.items():
            ratios = [f"{r['median_ms'] / by[o]['median_ms']:.2f}" if o in by else "-" for o in ("oneccl", "gloo")]
            comm = f"{r['median_ms'] - by['local']['median_ms']:,.1f}" if "local" in by and c != "local" else "-"
            correct = "-" if c == "local" else "yes" if r["equal_on_all_ranks"] and r["close_to_gloo"] else "NO"
            rows.append([dt, c, f"{r['median_ms']:,.1f}", f"{r['p90_ms']:,.1f}", comm, *ratios, correct])
    print_table(f"DDP step time: {world} ranks, {os.cpu_count()} CPUs, {params / 1e6:.1f} M parameters, "
                f"batch {args.batch}; median of the slowest rank per step",
                ["dtype", "backend", "median ms", "p90 ms", "- local ms", "x oneccl", "x gloo", "correct"], rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["results"])
    fig, ax = plt.subplots(figsize=(2.5 + 2.5 * len(dtypes), 4))
    width = 0.8 / len(CONFIGS)
    for i, c in enumerate(CONFIGS):
        xs = [d + (i - (len(CONFIGS) - 1) / 2) * width for d in range(len(dtypes))]
        med = [report["results"][dt].get(c, {}).get("median_ms", 0) for dt in dtypes]
        p90 = [report["results"][dt].get(c, {}).get("p90_ms", 0) for dt in dtypes]
        bars = ax.bar(xs, med, width, label=c, yerr=[[0] * len(med), [p - m for p, m in zip(p90, med)]], capsize=3)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(dtypes)), dtypes)
    ax.set_ylabel("ms per step (median; bar to p90)")
    ax.set_title(f"DDP, {report['world']} ranks, {report['parameters'] / 1e6:.1f} M parameters")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m oneccl_bind_pt.bench_ddp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=3072, help="features of each Linear layer")
    p.add_argument("--layers", type=int, default=6, help="Linear layers")
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: " + ", ".join(DTYPES))
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not under a launcher")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG of the step times here")
    args = p.parse_args(argv)
    args.dtypes, args.configs = args.dtypes.split(","), args.configs.split(",")
    check_choices(p, dtype=(args.dtypes, DTYPES), config=(args.configs, CONFIGS))
    return args


if __name__ == "__main__":
    sys.exit(launch(run, parse_args()))
