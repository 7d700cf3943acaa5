"""Collective benchmark: the ccl backend against gloo and against oneCCL alone.

    python -m oneccl_bind_pt.bench                         # spawns 2 ranks here
    python -m oneccl_bind_pt.bench --nprocs 4 --ops allreduce
    python -m oneccl_bind_pt.bench --memory-hog            # beside a process taking memory bandwidth
    torchrun --nproc_per_node 2 -m oneccl_bind_pt.bench
    mpirun -n 2 python -m oneccl_bind_pt.bench --json out.json --plot out.png

Columns (--backends), and the environment each one runs in:

  ccl       torch.distributed calls on the default ccl group: what users get (the
            package's own routing and oneCCL defaults; on one host, the shared-memory
            transport up to its crossover). Spawned ranks run with OMP_NUM_THREADS=1
            unless it is set, as torchrun starts them (the helper count depends on it).
  pg        the ccl backend's own methods on that group, skipping torch.distributed's
            Python layer (pg -> ccl is torch.distributed's own cost).
  future    the same calls as ccl with async_op=True, each waited on through its Work's
            Future, as DDP waits for its buckets: the backend's background thread moves
            them, not the waiting thread.
  gloo      the same torch.distributed calls on a gloo group.
  copy      no collective but the bound on one host: one plain copy of the same bytes
            on every rank at once, one thread per rank as in a collective.
  staged    a ccl group created with ONECCL_BIND_PT_SHM_SINGLE_COPY=0 (shared memory,
            never single copy).
  single    a ccl group created with ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES=0 (single
            copy at every size).
  ccl:VAR=VALUE
            a ccl group created with VAR=VALUE, where VAR is a variable read when a
            group is created (ONECCL_BIND_PT_SHM_CHUNK_BYTES, ONECCL_BIND_PT_SHM_MAX_BYTES,
            ONECCL_BIND_PT_SHM_SINGLE_COPY, ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES): an A/B
            of that setting against `ccl` in the same processes, e.g.
            --backends ccl,ccl:ONECCL_BIND_PT_SHM_CHUNK_BYTES=2M.
  oneccl    the default ccl group of ranks started with ONECCL_BIND_PT_SHM=0: every
            collective through oneCCL, with the defaults the package sets for that
            (oneCCL's shared memory, CCL_ATL_SHM=1; no oneCCL worker thread).
  raw       the same oneCCL call on the oneccl column's communicator, from C++, with
            no Work, Future or Python around it.
  oneccl+w  as oneccl, plus oneCCL worker threads: CCL_WORKER_COUNT=N with
            N = min(4, cores per rank - 1), at least 1, and CCL_WORKER_AFFINITY on the
            last N cores of each rank's block of cores; when a block has 2 cores or
            more each rank's own threads are pinned to the rest of its block.

A variable oneCCL reads once per process (CCL_*, and ONECCL_BIND_PT_SHM through the
defaults it selects) needs processes of its own: without a launcher the benchmark spawns
one set of ranks per environment (ccl, pg, gloo, copy, staged, single together; oneccl
and raw; oneccl+w), one set after another. Columns of one set run interleaved in the same
processes; compare across sets with that in mind. Under a launcher (torchrun, mpirun)
the ranks are the launcher's, in its environment: the columns that need another one are
left out, with a note.

Reported per point: median and p90 time of one call (the slowest rank's time
for each iteration), algorithm bandwidth (bytes / time) and bus bandwidth
(algbw x the nccl-tests factor: allreduce 2(n-1)/n; allgather, reduce_scatter
and alltoall (n-1)/n; broadcast and sendrecv 1), and whether each backend's
result was right. Bytes are the larger buffer of a call: allgather's output,
reduce_scatter's input. sendrecv is a ping-pong between ranks 0 and 1; its
time is half a round trip. --json records each column's environment and the
oneCCL defaults the package applied in each set of processes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

OPS = ["allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "sendrecv"]
# ccl groups made with one setting of the shared-memory transport changed (the setting is
# read when a group is created). bench_ddp uses "oneccl" for a group in its own processes.
GROUP_ENV = {
    "oneccl": {"ONECCL_BIND_PT_SHM": "0"},                       # every collective through oneCCL
    "staged": {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"},           # shared memory, never single copy
    "single": {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "0"},     # shared memory, single copy at every size
}
WORKERS = "oneccl+w"
# Variables that change what a column measures, recorded when the user had set them.
USER_ENV_PREFIXES = ("CCL_", "FI_", "ONECCL_BIND_PT_", "I_MPI_", "OMP_", "KMP_", "GLIBC_TUNABLES")


@dataclass(frozen=True)
class Column:
    """One column: `env` is set for its ranks' whole processes (oneCCL reads its variables
    once per process), `group_env` only while its group is created."""

    env: dict = field(default_factory=dict)
    group_env: dict = field(default_factory=dict)


COLUMNS = {
    "ccl": Column(),
    "pg": Column(),
    "future": Column(),
    "oneccl": Column(env=GROUP_ENV["oneccl"]),
    WORKERS: Column(env=GROUP_ENV["oneccl"]),  # + the worker variables, per host (worker_layout)
    "gloo": Column(),
    "raw": Column(env=GROUP_ENV["oneccl"]),
    "copy": Column(),
    "staged": Column(group_env=GROUP_ENV["staged"]),
    "single": Column(group_env=GROUP_ENV["single"]),
}
BACKENDS = list(COLUMNS)
DEFAULT_BACKENDS = ["ccl", "pg", "oneccl", WORKERS, "gloo", "raw", "copy"]
# Every group's, and the bound on each raw oneCCL call's wait.
GROUP_TIMEOUT = datetime.timedelta(seconds=300)
# What a `ccl:VAR=VALUE` column may set: the variables read when a group is created (each
# group's own), so its group and `ccl`'s share processes and interleave point by point.
# Where a host's performance drifts by 2-5x from one set of processes to the next (a 2-core
# VM did), only such a column gives a fair A/B.
GROUP_VARS = ("ONECCL_BIND_PT_SHM_CHUNK_BYTES", "ONECCL_BIND_PT_SHM_MAX_BYTES", "ONECCL_BIND_PT_SHM_SINGLE_COPY",
              "ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES")


def column(name):
    """The Column `name` means: one of COLUMNS, or a `ccl:VAR=VALUE` group; None if neither."""
    if name in COLUMNS:
        return COLUMNS[name]
    var, eq, value = name.removeprefix("ccl:").partition("=")
    if name.startswith("ccl:") and eq and var in GROUP_VARS and value:
        return Column(group_env={var: value})
    return None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PRESETS = {
    # The comparison the README quotes: a few sizes, every op, under 3 minutes.
    "headline": dict(ops=OPS, dtypes=["float32"], sizes=[8, 4 << 10, 256 << 10, 4 << 20, 64 << 20]),
}


# torch 2.13's names; the older ones still work but warn.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def bus_factor(op: str, world: int) -> float:
    if op == "allreduce":
        return 2 * (world - 1) / world
    if op in ("allgather", "reduce_scatter", "alltoall"):
        return (world - 1) / world
    return 1.0


def parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


@dataclass
class Point:
    op: str
    dtype: str
    bytes: int
    backend: str
    iters: int
    median_us: float
    p90_us: float
    algbw_GBps: float
    busbw_GBps: float
    correct: bool


class Case:
    """Buffers and one call of `op` for each backend, with a correctness check."""

    def __init__(self, op, dtype, nbytes, rank, world, groups):
        self.op, self.rank, self.world = op, rank, world
        self.groups = groups
        es = torch.empty((), dtype=dtype).element_size()
        per_rank = max(1, nbytes // (es * world))  # one share per rank
        n = per_rank * world if op in ("allgather", "reduce_scatter", "alltoall") else max(1, nbytes // es)
        self.nbytes = n * es
        small, large = (per_rank, n) if op in ("allgather", "reduce_scatter") else (n, n)
        self.inp = torch.zeros(large if op == "reduce_scatter" else small, dtype=dtype)
        self.out = torch.zeros(small if op == "reduce_scatter" else large, dtype=dtype)

    @functools.cached_property
    def copy_buffers(self):
        """Source and destination of the `copy` baseline (only allocated when it runs)."""
        return torch.zeros(self.nbytes, dtype=torch.uint8), torch.zeros(self.nbytes, dtype=torch.uint8)

    def call(self, backend):
        op, inp, out = self.op, self.inp, self.out
        if backend == "raw":
            return lambda iters: _raw(self.groups["ccl"], op, inp, out, iters)
        if backend == "pg":
            return self._backend_call()
        if backend == "copy":
            # The bound for moving these bytes on this host: one plain copy per rank,
            # all ranks copying at once, as in the collective. Run it under
            # one_intra_op_thread(): see there.
            src, dst = self.copy_buffers
            return lambda: dst.copy_(src)
        if backend == "future":
            return self._torch_call(self.groups["ccl"], lambda work: work.get_future().wait())
        return self._torch_call(self.groups[backend])

    def _torch_call(self, g, wait=None):
        """The op through torch.distributed on group `g`; with `wait`, started with
        async_op=True and its Work handed to `wait`."""
        op, inp, out, peer = self.op, self.inp, self.out, 1 - self.rank
        kw = dict(group=g, async_op=True) if wait else dict(group=g)
        done = wait or (lambda _: None)
        if op == "allreduce":
            return lambda: done(dist.all_reduce(inp, **kw))
        if op == "allgather":
            return lambda: done(_all_gather_single(out, inp, **kw))
        if op == "reduce_scatter":
            return lambda: done(_reduce_scatter_single(out, inp, **kw))
        if op == "alltoall":
            return lambda: done(dist.all_to_all_single(out, inp, **kw))
        if op == "broadcast":
            return lambda: done(dist.broadcast(inp, group_src=0, **kw))
        send, recv = (dist.isend, dist.irecv) if wait else (dist.send, dist.recv)

        def pingpong():
            if self.rank == 0:
                done(send(inp, group_dst=peer, group=g))
                done(recv(out, group_src=peer, group=g))
            elif self.rank == 1:
                done(recv(out, group_src=peer, group=g))
                done(send(inp, group_dst=peer, group=g))

        return pingpong

    def _backend_call(self):
        pg = self.groups["ccl"]._get_backend(torch.device("cpu"))
        op, inp, out, peer = self.op, self.inp, self.out, 1 - self.rank
        if op == "allreduce":
            return lambda: pg.allreduce([inp]).wait()
        if op == "allgather":
            return lambda: pg._allgather_base(out, inp).wait()
        if op == "reduce_scatter":
            return lambda: pg._reduce_scatter_base(out, inp).wait()
        if op == "alltoall":
            return lambda: pg.alltoall_base(out, inp, [], []).wait()
        if op == "broadcast":
            return lambda: pg.broadcast([inp]).wait()

        def pingpong():
            if self.rank == 0:
                pg.send([inp], peer, 0).wait()
                pg.recv([out], peer, 0).wait()
            elif self.rank == 1:
                pg.recv([out], peer, 0).wait()
                pg.send([inp], peer, 0).wait()

        return pingpong

    def check(self, backend) -> bool:
        """One call on rank-dependent data; compares with the value worked out by hand."""
        r, w = self.rank, self.world
        if backend == "copy":
            src, dst = self.copy_buffers
            src.copy_(torch.arange(src.numel()) % 251 + r)
            dst.zero_()
            with one_intra_op_thread():
                self.call(backend)()
            return torch.equal(dst, src)
        self.inp.copy_(torch.arange(self.inp.numel()) % 7 + r)
        self.out.zero_()
        call = self.call(backend)
        call(1) if backend == "raw" else call()
        base = torch.arange(self.inp.numel()) % 7
        if self.op == "allreduce":
            want, got = base * w + w * (w - 1) // 2, self.inp
        elif self.op == "allgather":
            k = self.inp.numel()
            want, got = torch.cat([base + s for s in range(w)]), self.out
            want = torch.cat([(torch.arange(k) % 7) + s for s in range(w)])
        elif self.op == "reduce_scatter":
            k = self.out.numel()
            want, got = (base * w + w * (w - 1) // 2)[r * k : (r + 1) * k], self.out
        elif self.op == "alltoall":
            k = self.inp.numel() // w
            want = torch.cat([(torch.arange(self.inp.numel()) % 7 + s)[r * k : (r + 1) * k] for s in range(w)])
            got = self.out
        elif self.op == "broadcast":
            want, got = base, self.inp
        else:  # sendrecv: rank 0 receives rank 1's data and vice versa
            if r > 1:
                return True
            want, got = base + (1 - r), self.out
        ok = torch.equal(got.to(torch.float64), want.to(torch.float64))
        self.inp.zero_()  # timing runs on zeros: repeated sums stay finite
        self.out.zero_()
        return ok


def _raw(group, op, inp, out, iters):
    from . import _C

    backend = group._get_backend(torch.device("cpu"))
    return _C._time_raw_oneccl(backend, op, inp, out, iters, GROUP_TIMEOUT)


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op pool at one thread, for the `copy` baseline.

    A copy_ of more than 32 Ki elements is split over torch's thread pool, by default
    as many threads as the host has cores, in every rank: N ranks then run N x cores
    threads at once, and the pool's waiting threads spin. A region ends only when its
    last thread has run, so a copy of 64 KiB took milliseconds (17.6 ms on 16 cores
    with 2 ranks). A collective moves its bytes in one thread per rank: so does the
    baseline."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def time_calls(case, backend, iters, late=0.0):
    """Times `iters` calls; with `late` (seconds, rank 1 only) each call starts that much
    later, busy-waiting (a peer still computing), and is timed from when it starts."""
    call = case.call(backend)
    if backend == "raw":
        return list(call(iters))
    times = []
    clock = time.perf_counter
    with one_intra_op_thread() if backend == "copy" else contextlib.nullcontext():
        for _ in range(iters):
            if late:
                until = clock() + late
                while clock() < until:
                    pass
            start = clock()
            call()
            times.append(clock() - start)
    return times


def run_point(case, backends, seconds, rounds, control, late=0.0):
    """Times each backend, interleaved over `rounds`; returns {backend: per-iteration seconds}."""
    # Iterations per backend so each spends about `seconds`: rank 0 estimates
    # (after a warm-up) and everybody follows.
    estimates = []
    for b in backends:
        time_calls(case, b, 2)
        # A late rank 1 adds its delay to every call (raw's excepted).
        estimates.append(statistics.median(time_calls(case, b, 3)) + (late if b != "raw" else 0.0))
    iters = torch.tensor([max(rounds, min(20000, int(seconds / max(e, 1e-7)))) for e in estimates])
    dist.broadcast(iters, group_src=0, group=control)
    per_round = {b: max(1, int(n) // rounds) for b, n in zip(backends, iters.tolist())}
    times = {b: [] for b in backends}
    for _ in range(rounds):
        for b in backends:
            dist.barrier(group=control)
            times[b] += time_calls(case, b, per_round[b], late if case.rank == 1 else 0.0)
    # Each iteration counts as its slowest rank; with `late`, as rank 1's: how long the op
    # took once the late rank came, which is what the waiting ranks' polling costs it.
    for b in backends:
        t = torch.tensor(times[b], dtype=torch.float64)
        if late and case.rank != 1:
            t.zero_()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=control)
        times[b] = t.tolist()
    return times


def summarize(case, dtype_name, backend, times, correct, world):
    factor = 0.5 if case.op == "sendrecv" else 1.0  # one way of a round trip
    ts = sorted(t * factor for t in times)
    med = statistics.median(ts)
    p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))]
    algbw = case.nbytes / med / 1e9
    return Point(case.op, dtype_name, case.nbytes, backend, len(ts), med * 1e6, p90 * 1e6,
                 algbw, algbw * bus_factor(case.op, world), correct)


def oneccl_group(world):
    """A ccl group with the shared-memory transport off: every collective through oneCCL."""
    return group_with(world, GROUP_ENV["oneccl"])


@contextlib.contextmanager
def environment(env):
    """os.environ with `env` set, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def group_with(world, env):
    """A ccl group created with `env` set (GROUP_ENV)."""
    with environment(env):
        return dist.new_group(list(range(world)))


def worker_layout(nprocs, cores):
    """oneccl+w on this host: (workers per rank, CCL_WORKER_AFFINITY's cores, each rank's own
    cores or None).

    Each rank owns a block of len(cores) // nprocs cores; its workers take the block's last
    ones, so a worker's busy-polling never lands on a core a rank computes on. The list
    covers every local rank's workers: oneCCL picks its slice by local rank."""
    per_rank = len(cores) // nprocs
    count = max(1, min(4, per_rank - 1))
    if per_rank >= 2:
        blocks = [cores[r * per_rank:(r + 1) * per_rank] for r in range(nprocs)]
        return count, [c for blk in blocks for c in blk[-count:]], [blk[:-count] for blk in blocks]
    # Under 2 cores per rank a worker shares a core with some rank's threads whatever we
    # pin: give each its own core where there are enough and leave the ranks to the scheduler.
    return count, [cores[r % len(cores)] for r in range(nprocs) for _ in range(count)], None


def column_env(name, nprocs, cores):
    """The variables a column's processes are started with (COLUMNS, + the workers')."""
    env = dict(column(name).env)
    if name == WORKERS:
        count, affinity, _ = worker_layout(nprocs, cores)
        env.update(CCL_WORKER_COUNT=str(count), CCL_WORKER_AFFINITY=",".join(map(str, affinity)))
    return env


def process_sets(backends, nprocs, cores):
    """The columns grouped by the environment their processes need: [(env, columns)]."""
    sets = {}
    for b in backends:
        sets.setdefault(tuple(sorted(column_env(b, nprocs, cores).items())), []).append(b)
    return [(dict(env), columns) for env, columns in sets.items()]


def make_groups(world, backends):
    """The group each column calls. In this set of processes the default group is the one
    `ccl`, `oneccl` and `oneccl+w` mean (their differences are the processes' environment)."""
    groups = {b: dist.group.WORLD for b in ("ccl", "oneccl", WORKERS)}
    groups["gloo"] = dist.new_group(backend="gloo")
    # In the same order on every rank (new_group is collective), only those asked for.
    groups.update({b: group_with(world, column(b).group_env) for b in backends if column(b).group_env})
    return groups


def benchmark(args, rank, world):
    backends = [b for b in args.backends if column(b)]
    groups = make_groups(world, backends)
    gloo_group = groups["gloo"]
    points = [
        (op, dt, size)
        for op in args.ops
        for dt in args.dtypes
        for size in args.sizes
        if not (op == "sendrecv" and world < 2)
    ]
    progress = _progress(len(points), " ".join(backends)) if rank == 0 and not args.quiet else None
    results = []
    for op, dt, size in points:
        case = Case(op, DTYPES[dt], size, rank, world, groups)
        correct = {}
        for b in backends:
            ok = torch.tensor([int(case.check(b))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=gloo_group)
            correct[b] = bool(ok.item())
        late = args.late_us * 1e-6 if world > 1 else 0.0
        times = run_point(case, backends, args.seconds, args.rounds, gloo_group, late)
        results += [summarize(case, dt, b, times[b], correct[b], world) for b in backends]
        if progress:
            progress.advance(progress.task_ids[0])
    if progress:
        progress.stop()
    return results


def _progress(total, what):
    try:
        from rich.progress import Progress
    except ImportError:
        return None
    p = Progress(transient=True)
    p.add_task(f"benchmarking {what}", total=total)
    p.start()
    return p


def _env_text(env):
    return " ".join(f"{k}={v}" for k, v in env.items()) or "none"


def report(results, world, args, sets):
    """The table, after one line per set of processes saying what ran in which environment."""
    for i, st in enumerate(sets, 1):
        pinned = f"; ranks pinned to {st['pinned']}" if st.get("pinned") else ""
        print(f"processes {i}/{len(sets)}: {', '.join(st['columns'])}; set by the benchmark: {_env_text(st['env'])}; "
              f"the package's defaults there: {_env_text(st['defaults'])}{pinned}", flush=True)
    backends = [b for b in args.backends if any(p.backend == b for p in results)]
    rows = {}
    for p in results:
        rows.setdefault((p.op, p.dtype, p.bytes), {})[p.backend] = p
    header = ["op", "dtype", "bytes"]
    for b in backends:
        header += [f"{b} med us", f"{b} p90 us"]
    header += ["ccl busbw GB/s", "gloo/ccl", "oneccl/ccl", f"{WORKERS}/ccl", "ccl/raw", "ccl-raw us", "pg/raw",
               "pg-raw us", "correct"]
    lines = []
    for (op, dt, nbytes), by in rows.items():
        row = [op, dt, human_bytes(nbytes)]
        for b in backends:
            row += [f"{by[b].median_us:,.1f}", f"{by[b].p90_us:,.1f}"] if b in by else ["-", "-"]
        ccl, gloo, raw = by.get("ccl"), by.get("gloo"), by.get("raw")
        row.append(f"{ccl.busbw_GBps:.2f}" if ccl else "-")
        row.append(f"{gloo.median_us / ccl.median_us:.1f}x" if ccl and gloo else "-")
        for other in (by.get("oneccl"), by.get(WORKERS)):
            row.append(f"{other.median_us / ccl.median_us:.2f}x" if ccl and other else "-")
        for mine in (ccl, by.get("pg")):
            row.append(f"{mine.median_us / raw.median_us:.2f}" if mine and raw else "-")
            row.append(f"{mine.median_us - raw.median_us:+.1f}" if mine and raw else "-")
        row.append("yes" if all(p.correct for p in by.values()) else "NO")
        lines.append(row)
    who = (f"rank 1's time per call, rank 1 starting each {args.late_us:g} us late" if args.late_us and world > 1
           else "the slowest rank per call")
    print_table(f"{world} ranks, {os.cpu_count()} CPUs; median of {who}", header, lines)


def print_table(title, header, lines):
    """A table on stdout: rich's when installed (the bench extra), plain columns otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table()
        for h in header:
            table.add_column(h, justify="left" if h in ("op", "dtype", "backend", "fault") else "right")
        for row in lines:
            table.add_row(*row)
        console = Console(width=480)
        console.print(title)  # as a table title, rich would wrap it to a narrow table's width
        console.print(table)
    except ImportError:
        print(title)
        widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(header)]
        for row in [header] + lines:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(p.op for p in results))
    fig, axes = plt.subplots(2, len(ops), figsize=(4 * len(ops), 7), squeeze=False)
    for col, op in enumerate(ops):
        for backend in dict.fromkeys(p.backend for p in results):
            for dt in dict.fromkeys(p.dtype for p in results):
                pts = sorted((p for p in results if p.op == op and p.backend == backend and p.dtype == dt),
                             key=lambda p: p.bytes)
                if not pts:
                    continue
                label = f"{backend} {dt}"
                xs = [p.bytes for p in pts]
                axes[0][col].plot(xs, [p.median_us for p in pts], marker="o", label=label)
                axes[1][col].plot(xs, [p.busbw_GBps for p in pts], marker="o", label=label)
        axes[0][col].set_title(op)
        for row, ylabel in ((0, "median time (us)"), (1, "bus bandwidth (GB/s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message bytes")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_json(results, world, args, sets, skipped, partial=False):
    """--json: every point so far. `partial`: more sets of processes are to come (a run cut
    short by a time limit keeps what its finished sets measured)."""
    if not args.json:
        return
    columns = {b: {"env": st["env"], "group_env": column(b).group_env, "processes": i}
               for i, st in enumerate(sets) for b in st["columns"]}
    with open(args.json, "w") as f:
        json.dump({"world": world, "cpus": os.cpu_count(), "memory_hog": args.memory_hog, "late_us": args.late_us,
                   "inherited_env": args.inherited_env, "columns": columns, "processes": sets,
                   "skipped": skipped, "partial": partial, "points": [asdict(p) for p in results]}, f, indent=1)


def finish(results, world, args, sets, skipped):
    """Rank 0's (or the spawning process's) output: the table, --json, --plot."""
    if skipped:
        print(f"left out under a launcher (they need processes started with other variables; run without one): "
              f"{', '.join(skipped)}", flush=True)
    report(results, world, args, sets)
    write_json(results, world, args, sets, skipped)
    if args.plot:
        plot(results, args.plot)


def _defaults_applied():
    from oneccl_bind_pt import _env

    return dict(sorted(_env.applied.items()))


def _set_rank(rank, world, store_path, args, pin, out):
    """One rank of one set of processes (spawned with the set's environment)."""
    if pin:
        os.sched_setaffinity(0, pin[rank])  # before the group exists: threads started later inherit it
    import oneccl_bind_pt  # noqa: F401

    dist.init_process_group("ccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    results = benchmark(args, rank, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"points": [asdict(p) for p in results], "defaults": _defaults_applied()}, f)
    dist.destroy_process_group()


def spawn_sets(args):
    """args.nprocs ranks here, one set of processes per environment (process_sets)."""
    import torch.multiprocessing as mp

    cores = sorted(os.sched_getaffinity(0))
    # Our transport's ranks start as torchrun starts several on one host: one intra-op thread
    # each unless OMP_NUM_THREADS says otherwise. The helper count subtracts those threads, so
    # this is what a torchrun job gets (mp.spawn alone leaves torch a thread per CPU per rank).
    # The oneCCL columns keep torch's default: on a 16-core Xeon oneCCL without workers once ran
    # up to 2x slower in ranks with one thread (not confirmed), and the baseline must not lose.
    threads = {} if "OMP_NUM_THREADS" in os.environ or args.nprocs < 2 else {"OMP_NUM_THREADS": "1"}
    results, sets = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (env, columns) in enumerate(process_sets(args.backends, args.nprocs, cores)):
            env = env if env.get("ONECCL_BIND_PT_SHM") == "0" else {**threads, **env}
            pin = worker_layout(args.nprocs, cores)[2] if WORKERS in columns else None
            out = os.path.join(tmp, f"set{i}.json")
            start = time.monotonic()
            with environment(env):  # spawned interpreters start with os.environ as it is now
                mp.spawn(_set_rank, args=(args.nprocs, os.path.join(tmp, f"store{i}"),
                                          argparse.Namespace(**{**vars(args), "backends": columns}), pin, out),
                         nprocs=args.nprocs)
            with open(out) as f:
                got = json.load(f)
            results += [Point(**p) for p in got["points"]]
            sets.append({"env": env, "columns": columns, "defaults": got["defaults"], "pinned": pin,
                         "seconds": round(time.monotonic() - start, 1)})
            write_json(results, args.nprocs, args, sets, [], partial=True)
    finish(results, args.nprocs, args, sets, [])
    return 0


def under_launcher(args):
    """The launcher's ranks, in its environment: the columns that need no other."""
    shm_off = os.environ.get("ONECCL_BIND_PT_SHM", "1").lower() in ("0", "off", "false")
    workers = "CCL_WORKER_COUNT" in os.environ
    here = [b for b in args.backends
            if (column(b).env.get("ONECCL_BIND_PT_SHM") == "0", b == WORKERS) == (shm_off, workers)]
    skipped = [b for b in args.backends if b not in here]
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    results = benchmark(argparse.Namespace(**{**vars(args), "backends": here}), rank, world)
    if rank == 0:
        sets = [{"env": {}, "columns": here, "defaults": _defaults_applied(), "pinned": None,
                 "seconds": round(time.monotonic() - start, 1)}]
        finish(results, world, args, sets, skipped)
    dist.destroy_process_group()
    return 0


def _spawned(rank, world, store_path, fn, args):
    import oneccl_bind_pt  # noqa: F401

    dist.init_process_group("ccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    fn(rank, world, args)
    dist.destroy_process_group()


def launch(fn, args):
    """fn(rank, world, args) on every rank of a ccl default group: the launcher's ranks when
    run under one (torchrun, mpirun, srun), else args.nprocs ranks spawned here. (bench_ddp's;
    the collective benchmark spawns one set of processes per environment: spawn_sets.)"""
    # The baselines get oneCCL's fastest setting on one host (read at its first communicator).
    os.environ.setdefault("CCL_ATL_SHM", "1")
    import oneccl_bind_pt  # noqa: F401  (maps mpirun's variables too)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("ccl")
        fn(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return 0
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_spawned, args=(args.nprocs, os.path.join(tmp, "store"), fn, args), nprocs=args.nprocs)
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m oneccl_bind_pt.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ", ".join(OPS))
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: " + ", ".join(DTYPES))
    p.add_argument("--min-bytes", default="4", help="smallest message (e.g. 4, 4K, 1M)")
    p.add_argument("--max-bytes", default="64M", help="largest message")
    p.add_argument("--factor", type=int, default=4, help="size step (2 or 4)")
    p.add_argument("--sizes", help="comma-separated message sizes (e.g. 4K,64K,1M,16M,64M), instead of "
                   "--min-bytes/--max-bytes/--factor")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS),
                   help="comma-separated columns: " + ", ".join(BACKENDS) + ", ccl:VAR=VALUE (default: "
                   "%(default)s; what each one is and the environment it runs in: above)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named selection of ops and sizes")
    p.add_argument("--seconds", type=float, default=0.2, help="time spent per backend per point")
    p.add_argument("--rounds", type=int, default=4, help="interleaved rounds per point")
    p.add_argument("--late-us", type=float, default=0.0,
                   help="rank 1 starts every call this much later than the others (busy-waiting, as a peer "
                        "still computing); a call's time is then rank 1's, from its start to its end "
                        "(raw's calls are not delayed, and are rank 1's time as well)")
    p.add_argument("--nprocs", type=int, default=2, help="ranks to spawn when not under a launcher")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG of time and bus bandwidth vs size here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--memory-hog", action="store_true",
                   help="run one more process beside the ranks that streams copies through memory (a neighbour "
                   "taking memory bandwidth, and a core)")
    args = p.parse_args(argv)
    args.ops = args.ops.split(",")
    args.dtypes = args.dtypes.split(",")
    args.backends = list(dict.fromkeys(args.backends.split(",")))  # one group per column
    if args.preset:
        preset = PRESETS[args.preset]
        args.ops, args.dtypes, args.sizes = preset["ops"], preset["dtypes"], preset["sizes"]
    elif args.sizes:
        args.sizes = [parse_bytes(t) for t in args.sizes.split(",")]
    else:
        size, args.sizes = parse_bytes(args.min_bytes), []
        while size <= parse_bytes(args.max_bytes):
            args.sizes.append(size)
            size *= args.factor
    check_choices(p, op=(args.ops, OPS), dtype=(args.dtypes, DTYPES))
    if args.late_us < 0:
        p.error(f"--late-us {args.late_us:g}: expected a delay of 0 us or more")
    bad = [b for b in args.backends if not column(b)]
    if bad:
        p.error(f"unknown backend {bad}; expected some of {BACKENDS}, or ccl:VAR=VALUE with VAR one of "
                f"{list(GROUP_VARS)} (variables read once per process need a run of their own)")
    return args


def check_choices(parser, **lists):
    """argparse's error for a comma-separated option naming something unknown."""
    for name, (values, known) in lists.items():
        bad = [v for v in values if v not in known]
        if bad:
            parser.error(f"unknown {name} {bad}; expected some of {list(known)}")


# A neighbour that uses memory bandwidth: one thread copying 256 MiB back and forth
# (far beyond any cache), until it is told to stop; then it says how fast it copied.
MEMORY_HOG = """
import signal, sys, time, torch
torch.set_num_threads(1)
a, b = torch.ones(64 << 20), torch.empty(64 << 20)
copies, start = 0, time.perf_counter()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
try:
    while True:
        b.copy_(a)
        copies += 1
finally:
    gbps = copies * a.nbytes * 2 / (time.perf_counter() - start) / 1e9
    print(f"memory hog: {copies} copies of 256 MiB, {gbps:.1f} GB/s read+written", flush=True)
"""


@contextlib.contextmanager
def memory_hog(on):
    """Runs MEMORY_HOG beside the benchmark (once per host: local rank 0 starts it)."""
    if not on or os.environ.get("LOCAL_RANK", "0") != "0":
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", MEMORY_HOG])
    try:
        yield
    finally:
        hog.terminate()
        hog.wait(timeout=30)


def main(argv=None):
    args = parse_args(argv)
    # What the user set before anything here: the `ccl` column runs with exactly these.
    args.inherited_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(USER_ENV_PREFIXES)}
    import oneccl_bind_pt  # noqa: F401  (maps mpirun's variables: RANK, LOCAL_RANK, ...)

    with memory_hog(args.memory_hog):
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return under_launcher(args)
        return spawn_sets(args)


if __name__ == "__main__":
    sys.exit(main())
