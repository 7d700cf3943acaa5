"""What to paste into a bug report: versions, libraries, environment, launcher, self-test.

    python -m oneccl_bind_pt.doctor [--selftest]

Exits non-zero when something is wrong, with the fix in the message.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

import torch

import oneccl_bind_pt
from oneccl_bind_pt import _C, _env, _launchers, _version

VARIABLE_PREFIXES = ("CCL_", "I_MPI_", "FI_", "ONECCL_BIND_PT_", "LD_LIBRARY_PATH")
PATH_OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall", "send")
PATH_SIZES = (4 << 10, 256 << 10, 4 << 20, 64 << 20, 1 << 30)


def _loaded_library(fragment: str) -> str | None:
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if fragment in os.path.basename(path):
                return path
    return None


def _libfabric() -> str | None:
    # oneCCL dlopens it through the extension's RUNPATH: <prefix>/lib.
    candidate = os.path.normpath(os.path.join(oneccl_bind_pt.cwd, "..", "..", "..", "libfabric.so.1"))
    return candidate if os.path.exists(candidate) else _loaded_library("libfabric")


def _shadowing_libfabric(ours: str | None) -> str | None:
    """A libfabric.so.1 that LD_LIBRARY_PATH (searched before RUNPATH) would load instead of ours."""
    for d in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        found = os.path.join(d, "libfabric.so.1")
        if os.path.exists(found):
            return None if ours and os.path.realpath(found) == os.path.realpath(ours) else found
    return None


def _mpirun() -> tuple[str | None, str | None]:
    """The mpirun on PATH, and this environment's own (Intel MPI, from impi-rt), if any."""
    beside = os.path.join(sys.prefix, "bin", "mpirun")
    return shutil.which("mpirun"), beside if os.path.exists(beside) else None


def _selftest_rank(rank, world, store_path, results):
    import torch.distributed as dist

    dist.init_process_group("ccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    ok = t[0].item() == world * (world + 1) / 2
    out = torch.empty(2 * world)
    # all_gather_single is torch 2.13's name for all_gather_into_tensor (the only one before).
    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, torch.full((2,), float(rank)))
    ok = ok and out.tolist() == [float(r) for r in range(world) for _ in range(2)]
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=world - 1)
    ok = ok and b.tolist() == [float(world - 1)] * 3
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    paths = {op: [pg._path(op, n) for n in PATH_SIZES] for op in PATH_OPS}
    paths["single copy"] = pg._single_copy()
    paths["staging chunk"] = pg._staging_chunk()
    results.put((rank, ok, dict(_env.applied), paths))
    dist.destroy_process_group()


def selftest(world: int = 2) -> tuple[bool, str, dict, dict]:
    """Runs allreduce, all_gather_single and broadcast on `world` fresh processes;
    also returns the defaults applied and which transport each op and size takes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_selftest_rank, args=(r, world, os.path.join(tmp, "store"), results))
                 for r in range(world)]
        for p in procs:
            p.start()
        got = {}
        try:
            for _ in range(world):
                rank, ok, applied, paths = results.get(timeout=120)
                got[rank] = (ok, applied, paths)
        except Exception:  # noqa: BLE001 - a rank died or hung; reported below
            pass
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    took = time.monotonic() - start
    if len(got) < world:
        codes = [p.exitcode for p in procs]
        return False, f"{world - len(got)} of {world} ranks never reported (exit codes {codes})", {}, {}
    if not all(ok for ok, _, _ in got.values()):
        return False, "a collective returned a wrong result", got[0][1], got[0][2]
    return (True, f"allreduce, all_gather_single, broadcast correct on {world} ranks in {took:.1f} s",
            got[0][1], got[0][2])


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def _print_paths(paths: dict) -> None:
    """Which transport each op takes at each size, for a group on this host."""
    paths = dict(paths)
    single = paths.pop("single copy", None)
    chunk = paths.pop("staging chunk", None)
    print("transport        per op and bytes per rank, ranks on this host (shm: staged through shared")
    print("                 memory; cma: read from the peers' tensors, single copy; oneccl: oneCCL;")
    print("                 ONECCL_BIND_PT_SHM=0 turns shm off, ONECCL_BIND_PT_SHM_MAX_BYTES and")
    print("                 ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES set the crossovers)")
    print(f"                 {'op':<16}" + "".join(f"{_human(n):>9}" for n in PATH_SIZES))
    for op, where in paths.items():
        print(f"                 {op:<16}" + "".join(f"{w:>9}" for w in where))
    if single is not None:
        print(f"single copy      {single}")
    if chunk is not None:
        print(f"staging chunk    {chunk}")


def _workers() -> str:
    """What the first group of a rank started like this process would give oneCCL's workers."""
    env = os.environ
    if any(v in env for v in _env.WORKER_VARS):
        return "as CCL_WORKER_* set by you: " + ", ".join(f"{v}={env[v]}" for v in _env.WORKER_VARS if v in env)
    local_rank, local_size = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
    cores, pinned, cores_why, _ = _C.rank_cores(local_size)

    def plan(asked):
        count, cpus, why = _env.worker_plan({**env, "ONECCL_BIND_PT_WORKERS": asked}, local_rank=local_rank,
                                            local_size=local_size, oneccl_carries=True, cores=cores, pinned=pinned,
                                            torch_threads=max(1, torch.get_num_threads()),
                                            cpus=list(os.sched_getaffinity(0)))
        return (f"{count} on CPU{'s' * (count > 1)} {','.join(map(str, cpus))}" if count else "0"), why

    asked = env.get("ONECCL_BIND_PT_WORKERS", "")
    if asked and asked != "auto":
        return "{} ({})".format(*plan(asked))
    auto = "{} when ranks span hosts ({}; cores: {cores_why}), 0 when all are on one host".format(
        *plan("auto"), cores_why=cores_why)
    return auto if asked else f"0 ({_env.OFF_BY_DEFAULT}); auto would give {auto}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oneccl_bind_pt.doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--selftest", action="store_true", help="also run collectives on 2 local ranks")
    args = parser.parse_args(argv)

    from oneccl_bind_pt._build_info import TORCH_BUILT_WITH

    problems = []
    print(f"oneccl_bind_pt   {oneccl_bind_pt.__version__}  ({oneccl_bind_pt.cwd})")
    print(f"python           {sys.version.split()[0]}  ({sys.executable})")
    print(f"torch            {torch.__version__}  (built against {TORCH_BUILT_WITH}: "
          f"{'match' if oneccl_bind_pt._same_minor(torch.__version__, TORCH_BUILT_WITH) else 'MISMATCH'})")
    # One oneccl_bind_pt release per torch minor: which one a user of another torch needs.
    print("releases         " + ", ".join(
        f"torch {r['torch'].rsplit('.', 1)[0]}.x -> oneccl_bind_pt=={oneccl_bind_pt._public(r['version'])} "
        f"(Python {', '.join(r['python'])})"
        for r in oneccl_bind_pt.supported_releases()))
    print(f"oneCCL           built with {_C.ccl_build_version}, running {_C.ccl_runtime_version()}")
    try:
        print(f"shared memory    {_C.kernels()}")
    except ValueError as e:  # an ONECCL_BIND_PT_KERNELS/_COPY value it does not know
        problems.append(str(e).splitlines()[0])
    try:
        # For this process: a rank under a launcher also divides the host by its ranks.
        print(f"                 {_C.helpers()}")
    except ValueError as e:  # an ONECCL_BIND_PT_HELPERS value it does not know
        problems.append(str(e).splitlines()[0])
    try:
        print(f"oneCCL workers   {_workers()}")
    except ValueError as e:  # an ONECCL_BIND_PT_WORKERS value it does not know
        problems.append(str(e).splitlines()[0])
    hwloc, fabric = _loaded_library("libhwloc"), _libfabric()
    on_path, ours = _mpirun()
    print(f"hwloc            {hwloc or 'NOT FOUND'}")
    print(f"libfabric        {fabric or 'NOT FOUND'}")
    print(f"mpirun           {on_path or ours or 'not found (only needed for mpirun launches)'}")
    if on_path and ours and os.path.realpath(on_path) != os.path.realpath(ours):
        # Open MPI's or MPICH's launcher works too; say which one a bare `mpirun` runs.
        print(f"                 note: that is not this environment's Intel MPI ({ours}); "
              f"source {oneccl_bind_pt.cwd}/env/setvars.sh to put it first")
    if not fabric:
        problems.append(f"libfabric is missing: pip install impi-rt=={_version.IMPI_RT_VERSION} (conda: conda "
                        "install impi_rt); oneCCL loads it at the first group")
    shadow = _shadowing_libfabric(fabric)
    if shadow:
        problems.append(f"LD_LIBRARY_PATH puts another libfabric first ({shadow}); oneCCL would load it instead "
                        f"of {fabric} and may find no provider: remove {os.path.dirname(shadow)} from "
                        "LD_LIBRARY_PATH for this job")
    if ours and not on_path:
        # Not a problem for torchrun, mp.spawn or srun; only a launch with mpirun needs it.
        print(f"                 note: mpirun is not on PATH (needed only to launch with mpirun): "
              f"source {oneccl_bind_pt.cwd}/env/setvars.sh")

    mapped = ", ".join(f"{k}={v} (from {src})" for k, (v, src) in _launchers.mapped.items())
    print(f"launcher         {oneccl_bind_pt.launcher}" + (f": mapped {mapped}" if mapped else ""))
    hint = _launchers.unmapped_launch_hint()
    if hint:
        print(f"                 note: {hint}")
    mine = {k: v for k, v in sorted(os.environ.items()) if k.startswith(VARIABLE_PREFIXES)}
    print("environment      " + (", ".join(f"{k}={v}" for k, v in mine.items()) or "no CCL_/I_MPI_/FI_ variables set"))

    if args.selftest:
        ok, what, applied, paths = selftest()
        if applied:
            print("defaults applied " + ", ".join(f"{k}={v}" for k, v in sorted(applied.items())))
        if paths:
            _print_paths(paths)
        print(f"self-test        {'PASS' if ok else 'FAIL'}: {what}")
        if not ok:
            problems.append("the self-test failed: rerun with CCL_LOG_LEVEL=info and include the output in the report")
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
