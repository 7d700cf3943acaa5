"""The benchmark runs and its results are correct (timings are not judged here)."""

import json
import re
import subprocess
import sys

import torch
import torch.distributed as dist

from harness import communicate, popen, run_ranks
from test_launchers import ROOT


def test_bench_runs_every_op_and_checks_results(tmp_path):
    out = tmp_path / "bench.json"
    png = tmp_path / "bench.png"
    proc = popen(
        [sys.executable, "-m", "oneccl_bind_pt.bench", "--nprocs", "2", "--max-bytes", "4K", "--factor", "32",
         "--seconds", "0.01", "--rounds", "2", "--quiet", "--json", out, "--plot", png, "--memory-hog"],
        cwd=ROOT / "tests", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    (text,) = communicate([proc], 300)  # a hang kills the spawned ranks too
    assert proc.returncode == 0, text
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["memory_hog"] is True
    assert re.search(r"memory hog: [1-9]\d* copies of 256 MiB", text), text  # it ran beside, and was stopped
    points = result["points"]
    ops = {p["op"] for p in points}
    assert ops == {"allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "sendrecv"}
    assert {p["backend"] for p in points} == {"ccl", "pg", "oneccl", "gloo", "raw", "copy"}
    assert {p["bytes"] for p in points if p["op"] == "allreduce"} == {4, 128, 4096}
    bad = [p for p in points if not p["correct"]]
    assert not bad, bad
    assert all(p["median_us"] > 0 and p["p90_us"] >= p["median_us"] for p in points)
    assert png.stat().st_size > 10_000
    assert "gloo/ccl" in text and "oneccl/ccl" in text


def _checks(rank, world):
    """Case.check on each op and backend: right when the call runs, wrong when it does not."""
    from oneccl_bind_pt import bench

    class Idle(bench.Case):
        def call(self, backend):
            return lambda *args: None  # the call does nothing: the buffers keep their inputs

    groups = {"ccl": dist.group.WORLD, "gloo": dist.new_group(backend="gloo"),
              **{b: bench.group_with(world, env) for b, env in bench.GROUP_ENV.items()}}
    verdicts = {}
    for op in bench.OPS:
        for backend in bench.BACKENDS:
            for kind in (bench.Case, Idle):
                case = kind(op, torch.float32, 256, rank, world, groups)
                verdicts[f"{op} {backend} {kind.__name__}"] = case.check(backend)
    return verdicts


def test_the_correctness_check_can_fail():
    # The bench's `correct` column is each rank's Case.check; the job's verdict is the
    # lowest over ranks. A backend whose call did nothing must come out wrong on some rank.
    per_rank = run_ranks(_checks, 2)
    for name in per_rank[0]:
        verdicts = [v[name] for v in per_rank]
        if name.endswith(" Case"):
            assert all(verdicts), (name, verdicts)
        else:
            assert not all(verdicts), (name, verdicts)


def test_ddp_bench_trains_every_config_to_the_same_parameters(tmp_path):
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
        for config, r in by.items():
            assert len(r["steps"]) == 3 and 0 < r["median_ms"] <= r["p90_ms"], r
            if config != "local":  # no DDP there: each rank trains on its own data
                assert r["equal_on_all_ranks"] and r["close_to_gloo"], (dtype, config, r)
    assert png.stat().st_size > 10_000
    assert "x gloo" in text
