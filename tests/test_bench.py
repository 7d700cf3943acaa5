"""The benchmark runs and its results are correct (timings are not judged here)."""

import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, communicate, popen, run_ranks
from test_launchers import ROOT


def test_bench_runs_every_op_and_checks_results(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench", "--nprocs", "2", "--max-bytes", "4K", "--factor", "1024",
         "--seconds", "0.01", "--rounds", "2", "--quiet", "--json", out, "--plot", png, "--memory-hog"],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Three sets of processes, one after another (ccl's, oneccl's, oneccl+w's). A hang kills
    # the spawned ranks too.
    (text,) = communicate([proc], 420)
    assert proc.returncode == 0, text
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["memory_hog"] is True
    assert re.search(r"memory hog: [1-9]\d* copies of 256 MiB", text), text  # it ran beside, and was stopped
    points = result["points"]
    ops = {p["op"] for p in points}
    assert ops == {"allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "sendrecv"}
    assert {p["backend"] for p in points} == {"ccl", "pg", "oneccl", "oneccl+w", "gloo", "raw", "copy"}
    assert {p["bytes"] for p in points if p["op"] == "allreduce"} == {4, 4096}
    bad = [p for p in points if not p["correct"]]
    assert not bad, bad
    assert all(p["median_us"] > 0 and p["p90_us"] >= p["median_us"] for p in points)
    assert png.stat().st_size > 10_000
    assert "gloo/ccl" in text and "oneccl/ccl" in text and "oneccl+w/ccl" in text

    # ccl runs in processes the benchmark set no variable for but the thread count torchrun
    # sets (one intra-op thread unless the user said): the package's own defaults. The oneCCL
    # columns keep torch's default thread count.
    columns, sets = result["columns"], result["processes"]
    threads = {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}
    assert columns["ccl"] == {"env": threads, "group_env": {}, "processes": 0}, columns["ccl"]
    assert sets[0]["env"] == threads and {"ccl", "pg", "gloo", "copy"} <= set(sets[0]["columns"]), sets[0]
    if "CCL_ATL_SHM" not in os.environ:  # on one host: our transport, oneCCL over sockets (unless SHM=0)
        want = "1" if os.environ.get("ONECCL_BIND_PT_SHM") == "0" else "0"
        assert sets[0]["defaults"]["CCL_ATL_SHM"] == want, sets[0]
    # oneccl and raw: processes started with ONECCL_BIND_PT_SHM=0, so oneCCL's shared memory.
    for name in ("oneccl", "raw"):
        assert columns[name]["env"] == {"ONECCL_BIND_PT_SHM": "0"}, columns[name]
    oneccl = sets[columns["oneccl"]["processes"]]
    assert columns["raw"]["processes"] == columns["oneccl"]["processes"]
    assert oneccl["defaults"].get("CCL_ATL_SHM", os.environ.get("CCL_ATL_SHM")) == "1", oneccl
    # oneccl+w: its own processes, with oneCCL's workers on (the package then leaves offload alone).
    from oneccl_bind_pt import bench

    count, affinity, _ = bench.worker_layout(2, sorted(os.sched_getaffinity(0)))
    assert columns["oneccl+w"]["env"] == {"ONECCL_BIND_PT_SHM": "0", "CCL_WORKER_COUNT": str(count),
                                          "CCL_WORKER_AFFINITY": ",".join(map(str, affinity))}, columns["oneccl+w"]
    workers = sets[columns["oneccl+w"]["processes"]]
    assert workers["columns"] == ["oneccl+w"] and "CCL_WORKER_OFFLOAD" not in workers["defaults"], workers
    assert len(sets) == 3


def test_worker_layout_keeps_workers_off_the_ranks_cores():
    from oneccl_bind_pt.bench import process_sets, worker_layout

    cores = list(range(16))
    assert worker_layout(2, cores) == (4, [4, 5, 6, 7, 12, 13, 14, 15], [[0, 1, 2, 3], [8, 9, 10, 11]])
    assert worker_layout(4, cores) == (3, [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15], [[0], [4], [8], [12]])
    assert worker_layout(8, cores) == (1, [1, 3, 5, 7, 9, 11, 13, 15], [[0], [2], [4], [6], [8], [10], [12], [14]])
    # Under 2 cores per rank a worker must share: one core each where possible, ranks unpinned.
    assert worker_layout(2, [0, 1]) == (1, [0, 1], None)
    assert worker_layout(4, [0, 1]) == (1, [0, 1, 0, 1], None)
    sets = process_sets(["ccl", "oneccl", "oneccl+w", "gloo", "raw", "copy", "staged"], 2, cores)
    assert [cols for _, cols in sets] == [["ccl", "gloo", "copy", "staged"], ["oneccl", "raw"], ["oneccl+w"]]
    assert sets[0][0] == {} and sets[1][0] == {"ONECCL_BIND_PT_SHM": "0"}
    assert sets[2][0] == {"ONECCL_BIND_PT_SHM": "0", "CCL_WORKER_COUNT": "4",
                          "CCL_WORKER_AFFINITY": "4,5,6,7,12,13,14,15"}


def test_a_column_of_a_group_variable_shares_the_ccl_processes():
    from oneccl_bind_pt import bench

    chunk = "ccl:ONECCL_BIND_PT_SHM_CHUNK_BYTES=2M"
    assert bench.process_sets(["ccl", chunk, "oneccl"], 2, list(range(4)))[0] == ({}, ["ccl", chunk])
    assert bench.parse_args(["--backends", f"ccl,{chunk}"]).backends == ["ccl", chunk]
    # A variable read once per process cannot differ between two groups of one process.
    for bad in ("ccl:ONECCL_BIND_PT_HELPERS=1", "ccl:ONECCL_BIND_PT_SHM_CHUNK_BYTES", "pg:X=1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--backends", f"ccl,{bad}"])


def test_a_late_rank_and_the_future_column(tmp_path):
    # --late-us: rank 1 comes late to every call, and a call's time is rank 1's (the op after it
    # came), so that the waiting ranks' polling shows; `future` waits through the Work's Future.
    out = tmp_path / "late.json"
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench", "--nprocs", "2", "--ops", "allreduce,sendrecv", "--sizes",
         "4K", "--backends", "ccl,future", "--late-us", "10000", "--seconds", "0.01", "--rounds", "2", "--quiet",
         "--json", out],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    (text,) = communicate([proc], 300)
    assert proc.returncode == 0, text
    assert "median of rank 1's time per call, rank 1 starting each 10000 us late" in text, text
    result = json.loads(out.read_text())
    assert result["late_us"] == 10000
    points = result["points"]
    assert {(p["op"], p["backend"]) for p in points} == {(o, b) for o in ("allreduce", "sendrecv")
                                                         for b in ("ccl", "future")}
    assert all(p["correct"] for p in points), points
    # Rank 1's time, not rank 0's (which waited the 10 ms as well). 10 ms, not less: with the
    # release builds beside it in CI, one round of `future` (three threads to wake per call on
    # 2 cores) took a median of 4.5 ms where the other round took 0.28 ms.
    assert all(p["median_us"] < 10000 for p in points), [(p["op"], p["backend"], p["median_us"]) for p in points]


CHUNK_COLUMN = "ccl:ONECCL_BIND_PT_SHM_CHUNK_BYTES=64K"


def _checks(rank, world):
    """Case.check on each op and backend: right when the call runs, wrong when it does not."""
    from oneccl_bind_pt import bench

    class Idle(bench.Case):
        def call(self, backend):
            return lambda *args: None  # the call does nothing: the buffers keep their inputs

    backends = [*bench.BACKENDS, CHUNK_COLUMN]
    groups = bench.make_groups(world, backends)
    # The column's group was made with its variable, the default group without.
    verdicts = {"chunks": [g._get_backend(torch.device("cpu"))._staging_chunk()
                           for g in (groups["ccl"], groups[CHUNK_COLUMN])]}
    for op in bench.OPS:
        for backend in backends:
            for kind in (bench.Case, Idle):
                case = kind(op, torch.float32, 256, rank, world, groups)
                verdicts[f"{op} {backend} {kind.__name__}"] = case.check(backend)
    return verdicts


def test_the_correctness_check_can_fail():
    # The bench's `correct` column is each rank's Case.check; the job's verdict is the
    # lowest over ranks. A backend whose call did nothing must come out wrong on some rank.
    per_rank = run_ranks(_checks, 2, env=TRANSPORTS["shm"])
    for chunks in (v.pop("chunks") for v in per_rank):
        assert "CHUNK" not in chunks[0] and chunks[1] == "64 KiB: ONECCL_BIND_PT_SHM_CHUNK_BYTES", chunks
    for name in per_rank[0]:
        verdicts = [v[name] for v in per_rank]
        if name.endswith(" Case"):
            assert all(verdicts), (name, verdicts)
        else:
            assert not all(verdicts), (name, verdicts)


def test_ddp_bench_trains_every_config_like_one_process_on_all_rows(tmp_path):
    out, png = tmp_path / "ddp.json", tmp_path / "ddp.png"
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench_ddp", "--nprocs", "2", "--width", "256", "--layers", "3",
         "--batch", "4", "--steps", "3", "--warmup", "1", "--json", out, "--plot", png],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    (text,) = communicate([proc], 300)
    assert proc.returncode == 0, text
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["parameters"] == 3 * (256 * 256 + 256)
    assert set(report["results"]) == {"float32", "bfloat16"}
    for dtype, by in report["results"].items():
        assert set(by) == {"ccl", "oneccl", "gloo", "local"}, by
        tol = report["tolerance"][dtype]
        for config, r in by.items():
            assert len(r["steps"]) == 3 and 0 < r["median_ms"] <= r["p90_ms"], r
            assert r["grad_storages"] == 6, r  # without --bucket-view, DDP copies into each parameter's own
            # The parameters moved (bfloat16's too): an update that rounds away hides any reduction.
            assert r["moved"] > 0.5, (dtype, config, r)
            if config == "local":
                # Its rank's gradient alone, what a reduction that dropped the other rank's would
                # leave: far outside the tolerances, so they can tell a wrong sum at this setting.
                # (The others' updates are judged as a share of this one's.)
                assert r["grad_error"] > 10 * tol["grad_error"], r
                assert dtype == "bfloat16" or r["update_error"] > 4 * tol["update_error"], r
                continue
            # Against one process trained on both ranks' rows (not against another DDP config).
            assert r["equal_on_all_ranks"], (dtype, config, r)
            limit = tol["update_error_share_of_local"] * by["local"]["update_error"]
            assert r["update_limit"] == pytest.approx(limit), (dtype, config, r)
            assert r["grad_error"] <= tol["grad_error"] and r["update_error"] <= limit, (dtype, config, r)
            assert r["correct"] and r["comm_ms"] == pytest.approx(
                statistics.median(a - b for a, b in zip(r["steps"], by["local"]["steps"]))), r
    # Loose enough for bf16's rounding, tight for float32's.
    assert report["tolerance"]["float32"]["update_error"] <= 1e-3, report["tolerance"]
    assert png.stat().st_size > 10_000
    assert "x gloo" in text and "comm ms" in text


def test_ddp_bench_with_bucket_views_trains_like_one_process(tmp_path):
    # gradient_as_bucket_view=True: the gradients DDP leaves are views of its buckets.
    out = tmp_path / "ddp.json"
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench_ddp", "--nprocs", "2", "--width", "256", "--layers", "3",
         "--batch", "4", "--steps", "3", "--warmup", "1", "--dtypes", "float32", "--configs", "ccl,local",
         "--bucket-view", "--json", out],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    (text,) = communicate([proc], 300)
    assert proc.returncode == 0, text
    report = json.loads(out.read_text())
    assert report["gradient_as_bucket_view"] is True and "gradient_as_bucket_view" in text
    r = report["results"]["float32"]["ccl"]
    assert r["correct"] and r["grad_error"] <= report["tolerance"]["float32"]["grad_error"], r
    # The 6 gradients (790 KB) are views of DDP's first bucket (1 MiB); local's are their own.
    assert r["grad_storages"] == 1 and report["results"]["float32"]["local"]["grad_storages"] == 6, report



def test_ddp_bench_compares_idle_helpers_in_the_same_processes(tmp_path):
    # ccl+idle: the ccl backend whose splits may take idle helpers, on a group of its own, beside
    # ccl without them. Free CPUs counted among 64 open the gate on any machine.
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONECCL_BIND_PT_HELPERS": "0", "ONECCL_BIND_PT_IDLE_HELPERS": "1",
           "ONECCL_BIND_PT_IDLE_CPUS": "64"}
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench_ddp", "--nprocs", "2", "--width", "1024", "--layers", "2",
         "--batch", "4", "--steps", "2", "--warmup", "1", "--dtypes", "float32", "--configs", "ccl,ccl+idle,local",
         "--json", out],
        cwd=ROOT / "tests", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    (text,) = communicate([proc], 300)
    assert proc.returncode == 0, text
    by = json.loads(out.read_text())["results"]["float32"]
    assert set(by) == {"ccl", "ccl+idle", "local"}, by
    assert by["ccl"]["correct"] and by["ccl+idle"]["correct"], by
    # Without always-used helpers, only idle ones split, and only in ccl+idle's steps.
    assert (by["ccl"]["splits"], by["ccl"]["idle_splits"]) == (0, 0), by["ccl"]
    assert by["ccl+idle"]["idle_splits"] == by["ccl+idle"]["splits"] > 0, by["ccl+idle"]
    assert "rank 0, ccl+idle, timed steps: float32" in text, text


def test_group_bench_makes_and_destroys_groups_on_every_backend(tmp_path):
    out = tmp_path / "groups.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_groups.py"), "--ranks", "2", "--groups", "2",
                           "--json", str(out)], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["backend"] for r in rows] == ["ccl", "oneccl", "gloo"], rows
    assert all(r["ranks"] == 2 and 0 < r["group_ms_median"] <= r["group_ms_max"] and r["destroy_ms"] > 0
               for r in rows), rows

# Every command with options answers --help (a '%' in a help text once made bench_ddp's raise).
HELP = [["-m", f"oneccl_bind_pt.{m}"] for m in ("bench", "bench_ddp", "doctor")] + [
    [str(p)] for p in sorted((ROOT / "scripts").glob("*.py")) if "argparse" in p.read_text()]


@pytest.mark.parametrize("command", HELP, ids=lambda c: c[-1].rsplit("/", 1)[-1])
def test_help(command):
    proc = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT / "tests", capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout + proc.stderr


def _raw_call_a_peer_never_makes(rank, world, op):
    import datetime
    import time

    from oneccl_bind_pt import _C

    store = dist.distributed_c10d._get_default_store()
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    t = torch.ones(1024)
    if rank == 1:
        store.wait(["raised"], datetime.timedelta(seconds=120))  # makes no call meanwhile
        return None
    start = time.monotonic()
    try:
        _C._time_raw_oneccl(backend, op, t, torch.zeros(1024), 3, datetime.timedelta(seconds=2))
        said = None
    except dist.DistBackendError as e:
        said = str(e)
    waited = time.monotonic() - start
    # The group is aborted: the next op fails at once instead of meeting the call left in oneCCL.
    try:
        dist.all_reduce(t)
        after = None
    except dist.DistBackendError as e:
        after = str(e)
    store.set("raised", "1")
    return said, waited, after


@pytest.mark.parametrize("op", ["allreduce", "sendrecv"])
def test_a_raw_oneccl_call_waits_at_most_its_timeout(op):
    # The benchmark's raw column calls oneCCL directly; a rank whose peer never makes the call
    # raises after the timeout it was given, instead of waiting for good (sendrecv: rank 0's
    # send may complete alone, its recv cannot).
    (said, waited, after), _ = run_ranks(_raw_call_a_peer_never_makes, 2, op, env=TRANSPORTS["oneccl"], timeout=180)
    assert said is not None, "the call returned though rank 1 never made it"
    assert f"raw oneCCL {op} on rank 0 of 2: call 1 of 3 did not complete within 2000 ms" in said, said
    assert 2 <= waited < 30, waited
    assert after is not None and "abort" in after, after
