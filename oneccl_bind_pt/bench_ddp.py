"""DDP step time: one model trained through ccl, through ccl on oneCCL alone, and through gloo.

    python -m oneccl_bind_pt.bench_ddp                        # spawns 2 ranks here
    python -m oneccl_bind_pt.bench_ddp --nprocs 4 --dtypes float32
    torchrun --nproc_per_node 2 -m oneccl_bind_pt.bench_ddp --json ddp.json --plot ddp.png

The model is an MLP of --layers square Linear layers of --width features (default 6 x 3072:
56.6 M parameters, 226 MB of float32 gradients, nine of DDP's 25 MiB buckets), trained with
SGD on random batches of --batch rows. Each configuration wraps its own copy of it (the same
initial values) in DistributedDataParallel on its own group:

- `ccl`: the default ccl group, what users get (on one host, the shared-memory transport);
- `ccl+idle` (only when asked for): a ccl group of its own whose large copies and
  reductions may also take idle helpers, threads that work only while the host has CPUs to
  spare (ONECCL_BIND_PT_IDLE_HELPERS, `auto` unless set; docs/performance.md). Where it runs,
  `ccl` runs without them, so the two compare the setting in the same processes;
- `oneccl`: a ccl group created with ONECCL_BIND_PT_SHM=0 (every collective through oneCCL,
  with its own shared-memory transport, CCL_ATL_SHM=1);
- `gloo`: a gloo group;
- `local`: the same model without DDP (no communication): the floor, so that `step - local`
  is what communication costs a step.

The configurations take turns step by step for --steps timed steps (after --warmup), so a
slow phase of the machine falls on all of them; `comm ms` is the median over steps of a
configuration's step minus `local`'s in the same step. A step is zero_grad, forward, loss,
backward (DDP all-reduces the buckets as their gradients are ready) and the optimizer step;
its time is the slowest rank's.

Correctness is checked against a reference computed without DDP: one float32 copy of the
model that every rank trains alone on all ranks' rows (each rank can draw every rank's batch),
the mean of the loss over them being what DDP's averaged gradients descend. Per configuration:

- `grad err`: one more step (untimed, no optimizer step) on a fresh batch: the gradient DDP
  left on the parameters against the reference's gradient on all ranks' rows from the same
  parameters (relative L2 error, float32). This is the reduction itself; in bfloat16 DDP
  reduces bfloat16 gradients, so only bf16's rounding separates the two.
- `update err`: the parameters' change over the run against the reference's change
  (relative L2 error). The learning rate (--lr; by default one that makes the reference's
  first step move the parameters by LR_MOVE of their norm) is large enough that bfloat16
  parameters move by many of their units in the last place: at a small rate updates round
  away and the parameters never change, whatever the reduction did. Training amplifies
  rounding step by step, so DDP and the reference drift apart even when every reduction is
  right (float32, every backend alike: 1e-6 after 6 steps, 1e-2 after 10, 7e-2 after 14; at
  a 20x smaller rate still 2e-2 after 31). So this is a coarse check, judged against
  `local`'s (at most half of it) where `local` ran; the gradient check is the exact one.
- the parameters are equal on every rank.

`local` trains on its rank's data alone: its errors are what a reduction that kept only the
rank's own gradient would give, shown beside the others' so the tolerances can be judged.

`comm ms` counts DDP's own work too: it copies each gradient into its bucket (scaled by 1 /
ranks) and, after the allreduce, the bucket back into the gradient, two passes over every
gradient whatever the backend. --bucket-view passes gradient_as_bucket_view=True to every DDP
configuration: the gradients are views of the buckets, and the copy back goes away.
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

from oneccl_bind_pt import _C
from oneccl_bind_pt.bench import DTYPES, GROUP_ENV, check_choices, group_with, launch, print_table

CONFIGS = ["ccl", "ccl+idle", "oneccl", "gloo", "local"]
DEFAULT_CONFIGS = ["ccl", "oneccl", "gloo", "local"]
IDLE = "ccl+idle"
# Relative L2 error against the reference (module docstring). A wrong reduction is off by
# about 1 (the sum instead of the mean, a zeroed gradient, one rank's gradient alone);
# float32's gradient agrees to 1e-6, bfloat16's to a few 1e-2 (its rounding).
GRAD_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
# The update error over a run grows with its length whatever the reductions did (module
# docstring). Where `local` ran, a configuration's update error is judged against local's (a
# rank training on its own rows, what a reduction that kept one rank's gradient gives): at
# most this share of it. Without `local`, against these, which hold for a few steps only
# (float32, the default model: 1e-6 after 6 steps, 1e-2 after 10).
UPDATE_SHARE_OF_LOCAL = 0.5
UPDATE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-1}
# The default learning rate makes the reference's first step move the parameters by this
# fraction of their norm: far above bfloat16's rounding (about 0.2% of a value), so its
# parameters move, yet small enough that a few steps stay a gentle descent.
LR_MOVE = 0.02


def make_model(args, dtype):
    torch.manual_seed(0)  # every rank and configuration starts from the same values
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def batch(args, gen):
    """A batch of inputs and targets, drawn from `gen`: (rows, 2 * width)."""
    return torch.randn(args.batch, 2 * args.width, generator=gen)


def loss(model, rows, dtype, compute):
    """Mean squared error to the targets, the rows' halves rounded to `dtype` (what the model
    sees) and computed in `compute`. Targets keep the gradients from vanishing as the model
    learns, which would leave only bfloat16's rounding in them."""
    x, y = rows.to(dtype).to(compute).chunk(2, dim=1)
    return (model(x).float() - y.float()).square().mean()


def _flat(tensors):
    return torch.cat([t.detach().float().flatten() for t in tensors])


def _rel_err(got, want):
    return ((got - want).norm() / want.norm()).item()


def _reference_grad(params, xs, dtype, args):
    """The gradient one process computes in float32 on all ranks' rows `xs` from `params`."""
    ref = make_model(args, torch.float32)
    with torch.no_grad():
        for r, p in zip(ref.parameters(), params):
            r.copy_(p.float())
    loss(ref, torch.cat(xs), dtype, torch.float32).backward()
    return _flat(r.grad for r in ref.parameters())


def update_limit(dtype, summary):
    """The update error a configuration may show (UPDATE_SHARE_OF_LOCAL)."""
    if "local" in summary:
        return UPDATE_SHARE_OF_LOCAL * summary["local"]["update_error"]
    return UPDATE_TOLERANCE[dtype]


def train(args, rank, world, dtype, groups, control):
    """Median and p90 ms per step (slowest rank) per configuration, and how its gradients and
    updates compare with the reference (module docstring); and the learning rate."""
    ddp = {c: make_model(args, dtype) if g is None else
           nn.parallel.DistributedDataParallel(make_model(args, dtype), process_group=g,
                                               gradient_as_bucket_view=args.bucket_view)
           for c, g in groups.items()}
    start_params = {c: _flat(m.parameters()) for c, m in ddp.items()}
    # The reference starts from the same values (rounded to `dtype`) and sees every rank's rows.
    ref = make_model(args, dtype).float()
    ref_start = _flat(ref.parameters())
    gens = [torch.Generator().manual_seed(1 + r) for r in range(world)]  # rank r's shard of the data
    lr = args.lr
    if lr is None:
        # Rank 0's rate for all: computed alike everywhere, but equal parameters need equal rates.
        xs = [batch(args, torch.Generator().manual_seed(1 + r)) for r in range(world)]
        g = _reference_grad(list(ref.parameters()), xs, dtype, args)
        rate = torch.tensor([LR_MOVE * ref_start.norm().item() / g.norm().item()], dtype=torch.float64)
        dist.broadcast(rate, 0, group=control)
        lr = rate.item()
    opt = {c: torch.optim.SGD(m.parameters(), lr=lr) for c, m in ddp.items()}
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    times = {c: [] for c in ddp}
    splits = {c: [0, 0] for c in ddp}  # this rank's splits on helpers in timed steps, and with idle ones

    def idle_for(c):
        if IDLE in ddp:
            _C._allow_idle_helpers(c == IDLE)

    for step in range(args.warmup + args.steps):
        xs = [batch(args, g) for g in gens]
        x = xs[rank]
        for c, model in ddp.items():
            idle_for(c)
            dist.barrier(group=control)  # every rank starts the step together
            before = _C._split_counts()
            start = time.perf_counter()
            opt[c].zero_grad(set_to_none=True)
            loss(model, x, dtype, dtype).backward()
            opt[c].step()
            if step >= args.warmup:
                times[c].append(time.perf_counter() - start)
                splits[c] = [total + now - then for total, now, then in zip(splits[c], _C._split_counts(), before)]
        ref_opt.zero_grad(set_to_none=True)
        loss(ref, torch.cat(xs), dtype, torch.float32).backward()
        ref_opt.step()
    ref_update = _flat(ref.parameters()) - ref_start
    # The gradient check: one more step on a fresh batch, without the optimizer's step.
    xs = [batch(args, g) for g in gens]
    summary = {}
    for c, model in ddp.items():
        idle_for(c)
        model.zero_grad(set_to_none=True)
        loss(model, xs[rank], dtype, dtype).backward()
        params = list(model.parameters())
        errors = torch.tensor([_rel_err(_flat(p.grad for p in params), _reference_grad(params, xs, dtype, args)),
                               _rel_err(_flat(params) - start_params[c], ref_update)], dtype=torch.float64)
        # The worst rank for what DDP trained; for `local` the least wrong, the bound a
        # rank-own-gradient reduction would at least show.
        dist.all_reduce(errors, op=dist.ReduceOp.MIN if groups[c] is None else dist.ReduceOp.MAX, group=control)
        summary[c] = {"grad_error": errors[0].item(), "update_error": errors[1].item(),
                      "moved": (_flat(params) != start_params[c]).double().mean().item(),
                      # One per parameter, or fewer where the gradients are views of DDP's buckets.
                      "grad_storages": len({p.grad.untyped_storage().data_ptr() for p in params}),
                      "splits": splits[c][0], "idle_splits": splits[c][1]}
    for c, ts in times.items():
        slowest = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control)
        times[c] = slowest.mul(1e3).tolist()  # step by step, as they took turns
        ms = sorted(times[c])
        summary[c].update(median_ms=statistics.median(ms), p90_ms=ms[min(len(ms) - 1, int(0.9 * len(ms)))], steps=times[c])
    for c in summary:
        if "local" in times and c != "local":
            # Paired by step: the configurations took turns, so a slow phase falls on both.
            summary[c]["comm_ms"] = statistics.median(a - b for a, b in zip(times[c], times["local"]))
    for c, model in ddp.items():
        if groups[c] is None:
            continue
        # Equal on every rank: rank 0's values against each rank's own.
        params = _flat(model.parameters())
        theirs = params.clone()
        dist.broadcast(theirs, 0, group=control)
        same = torch.tensor([int(torch.equal(theirs, params))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN, group=control)
        r = summary[c]
        r["equal_on_all_ranks"] = bool(same.item())
        r["update_limit"] = update_limit(dtype, summary)
        r["correct"] = (r["equal_on_all_ranks"] and r["grad_error"] <= GRAD_TOLERANCE[dtype]
                        and r["update_error"] <= r["update_limit"])
    return summary, lr


def run(rank, world, args):
    try:
        measure(rank, world, args)
    finally:
        _C._allow_idle_helpers(True)  # as the process found it


def measure(rank, world, args):
    control = dist.new_group(backend="gloo")  # barriers and the timings, outside what is measured
    made = {"ccl": lambda: dist.group.WORLD, IDLE: lambda: group_with(world, {}),
            "oneccl": lambda: group_with(world, GROUP_ENV["oneccl"]), "gloo": lambda: dist.new_group(backend="gloo"),
            "local": lambda: None}
    groups = {c: make() for c, make in made.items() if c in args.configs}
    trained = {dt: train(args, rank, world, DTYPES[dt], groups, control) for dt in args.dtypes}
    if rank != 0:
        return
    results = {dt: by for dt, (by, _) in trained.items()}
    params = args.layers * (args.width * args.width + args.width)
    report = {"world": world, "cpus": os.cpu_count(), "torch": torch.__version__, "parameters": params,
              "width": args.width, "layers": args.layers, "batch": args.batch, "steps": args.steps,
              "gradient_as_bucket_view": args.bucket_view,
              "lr": {dt: lr for dt, (_, lr) in trained.items()},
              "tolerance": {dt: {"grad_error": GRAD_TOLERANCE[DTYPES[dt]], "update_error": UPDATE_TOLERANCE[DTYPES[dt]],
                                 "update_error_share_of_local": UPDATE_SHARE_OF_LOCAL}
                            for dt in results},
              "results": results}
    # Whether the ccl configurations' large steps ran on helper threads (src/helpers.hpp):
    # rank 0's splits over the whole run, and of them those that took idle helpers (per
    # configuration in the results, over its timed steps).
    splits, idle_splits = _C._split_counts()
    report["helpers"] = {"plan": _C.helpers(), "splits": splits, "idle_splits": idle_splits}
    rows = []
    for dt, by in results.items():
        for c, r in by.items():
            ratios = [f"{r['median_ms'] / by[o]['median_ms']:.2f}" if o in by else "-" for o in ("oneccl", "gloo")]
            comm = f"{r['comm_ms']:,.1f}" if "comm_ms" in r else "-"
            correct = "-" if c == "local" else "yes" if r["correct"] else "NO"
            rows.append([dt, c, f"{r['median_ms']:,.1f}", f"{r['p90_ms']:,.1f}", comm, *ratios,
                         f"{r['grad_error']:.1e}", f"{r['update_error']:.1e}", correct])
    print_table(f"DDP step time: {world} ranks, {os.cpu_count()} CPUs, {params / 1e6:.1f} M parameters, "
                f"batch {args.batch}{', gradient_as_bucket_view' if args.bucket_view else ''}; "
                "median of the slowest rank per step; comm: step - local, paired by step; "
                "errors against one process on all ranks' rows (local: its own rows only)",
                ["dtype", "backend", "median ms", "p90 ms", "comm ms", "x oneccl", "x gloo", "grad err",
                 "update err", "correct"], rows)
    print(f"rank 0: {report['helpers']['plan']}; {splits} splits on helpers, {idle_splits} of them with idle helpers")
    for c in (c for c in ("ccl", IDLE) if c in args.configs):
        by = {dt: (r[c]["splits"], r[c]["idle_splits"]) for dt, r in results.items()}
        print(f"rank 0, {c}, timed steps: " + "; ".join(f"{dt} {n} splits, {i} with idle helpers"
                                                          for dt, (n, i) in by.items()))
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
    configs = [c for c in CONFIGS if any(c in report["results"][dt] for dt in dtypes)]
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        xs = [d + (i - (len(configs) - 1) / 2) * width for d in range(len(dtypes))]
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
    p.add_argument("--lr", type=float, help="SGD's learning rate (default: the reference's first step moves the "
                   f"parameters by {LR_MOVE:.0%}% of their norm)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: " + ", ".join(DTYPES))
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated, of: " + ", ".join(CONFIGS) + " (default: %(default)s)")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP with gradient_as_bucket_view=True: no copy from the buckets back to the gradients")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not under a launcher")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG of the step times here")
    args = p.parse_args(argv)
    args.dtypes, args.configs = args.dtypes.split(","), args.configs.split(",")
    check_choices(p, dtype=(args.dtypes, DTYPES), config=(args.configs, CONFIGS))
    return args


if __name__ == "__main__":
    parsed = parse_args()
    if IDLE in parsed.configs:
        # Read once per process, at the first large split: set before any group exists.
        os.environ.setdefault("ONECCL_BIND_PT_IDLE_HELPERS", "auto")
        if os.environ["ONECCL_BIND_PT_IDLE_HELPERS"].strip() == "0":
            print(f"note: ONECCL_BIND_PT_IDLE_HELPERS=0 is set, so {IDLE} runs as ccl does", file=sys.stderr)
    sys.exit(launch(run, parsed))
