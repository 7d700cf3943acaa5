"""scripts/perf_set.py: what `prepare` carries and how `run` stops at its budget (seconds; the
full set itself is `run --installed --quick`, minutes, documented in docs/performance.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_launchers import ROOT

SCRIPT = ROOT / "scripts" / "perf_set.py"
LIB = Path(sys.prefix) / "lib"


def test_prepare_carries_the_wheel_and_the_packages_own_libraries(tmp_path):
    if not (LIB / "libfabric.so.1").exists():
        pytest.skip("impi-rt is not installed beside this Python")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "oneccl_bind_pt-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"stand-in")
    dest = tmp_path / "carry"
    r = subprocess.run([sys.executable, SCRIPT, "prepare", "--wheel", wheels, "--dest", dest],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    assert manifest["wheel"].startswith("oneccl_bind_pt-2.11.0-cp312-")
    assert sorted(p.name for p in (dest / "lib").iterdir()) == sorted(
        ["libfabric.so.1", "libhwloc.so.15", "librxm-fi.so", "libshm-fi.so", "libtcp-fi.so"])
    assert {lib["from"] for lib in manifest["libs"].values()} == {"impi-rt", "tcmlib"}
    assert (dest / "lib" / "libfabric.so.1").read_bytes() == (LIB / "libfabric.so.1").resolve().read_bytes()

    # Over the size limit, or a library that is not the package's own: refused.
    r = subprocess.run([sys.executable, SCRIPT, "prepare", "--wheel", wheels, "--dest", dest, "--max-mib", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "over --max-mib 1" in r.stderr, r.stderr
    fake = tmp_path / "prefix"
    (fake / "lib").mkdir(parents=True)
    for name in ("libfabric.so.1", "libtcp-fi.so", "libshm-fi.so", "librxm-fi.so", "libhwloc.so.15"):
        (fake / "lib" / name).write_bytes(b"not from a package")
    r = subprocess.run([sys.executable, SCRIPT, "prepare", "--wheel", wheels, "--dest", tmp_path / "c2",
                        "--libs-from", fake], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "is not the file impi-rt installed" in r.stderr, r.stderr


def test_run_starts_nothing_past_its_budget(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, SCRIPT, "run", "--installed", "--quick", "--budget", "0", "--out", out],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == [
        "bench_ddp 2 ranks x 1 threads", "bench 2 ranks", "bench 2 ranks, staged against single copy",
        "bench 2 ranks, 0 helpers", "bench 2 ranks, 1 helpers"]
    assert all(s.get("skipped") == "budget" for s in summary["steps"]), summary
    assert summary["host"]["torch"] == torch.__version__
    assert sorted(p.name for p in out.iterdir()) == ["perf.log", "summary.json"]


def _planned(tmp_path, *args):
    """{run name: (its command, the variables it sets)} of a run planned with no budget to run it."""
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, SCRIPT, "run", "--installed", "--budget", "0", "--out", out, *args],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    return {s["name"]: (s["cmd"], s["env"]) for s in json.loads((out / "summary.json").read_text())["steps"]}


def _option(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_the_two_parts_split_the_set_and_narrow_the_runs_from_4_ranks(tmp_path):
    one, two = _planned(tmp_path / "1", "--part", "1"), _planned(tmp_path / "2", "--part", "2")
    both = _planned(tmp_path / "all", "--part", "all")
    assert set(both) == set(one) | set(two) and not set(one) & set(two), (list(one), list(two), list(both))
    assert [n for n in both if n in one] == list(one), list(both)  # part 1's order within all
    # Part 1 starts with DDP; part 2 with its longest run (bench writes its JSON only at its end),
    # and DDP last: a budget cuts the last runs.
    assert list(one)[:3] == [n for n in one if n.startswith("bench_ddp")], list(one)
    assert list(two) == ["bench 8 ranks", "bench_ddp 2 ranks x 7 threads workers=1"], list(two)
    assert _option(two["bench 8 ranks"][0], "--sizes") == "4K,1M,16M,64M"
    assert _option(one["bench 4 ranks"][0], "--ops") == "allreduce,allgather,reduce_scatter,alltoall,broadcast,sendrecv"
    cmd, _ = one["bench 2 ranks"]
    assert _option(cmd, "--dtypes") == "float32,bfloat16" and _option(cmd, "--backends") == "ccl,pg,oneccl,oneccl+w"
    for n, runs in ((4, one), (8, two)):
        cmd, _ = runs[f"bench {n} ranks"]
        assert _option(cmd, "--dtypes") == "float32" and _option(cmd, "--backends") == "ccl,single,oneccl,oneccl+w"
    # Idle helpers are one more configuration in each DDP run's processes, not a run of their own.
    assert all(_option(c, "--configs") == "ccl,ccl+idle,oneccl,gloo,local" for n, (c, _) in {**one, **two}.items()
               if n.startswith("bench_ddp"))
    assert one["bench_ddp 2 ranks x 8 threads"][1] == {"OMP_NUM_THREADS": "8"}
    assert _planned(tmp_path / "i", "--ddp", "2x8:idle=auto", "--ranks", "")["bench_ddp 2 ranks x 8 threads idle=auto"][
        1] == {"OMP_NUM_THREADS": "8", "ONECCL_BIND_PT_IDLE_HELPERS": "auto"}
    assert "--bucket-view" in one["bench_ddp 2 ranks x 8 threads view=1"][0]
    assert "--bucket-view" not in one["bench_ddp 2 ranks x 8 threads"][0]
    assert two["bench_ddp 2 ranks x 7 threads workers=1"][1] == {"OMP_NUM_THREADS": "7", "ONECCL_BIND_PT_WORKERS": "1"}
    chunk = _planned(tmp_path / "c", "--part", "2", "--helpers", "3:chunk=2M;copy=loop,3:kernels=avx512", "--ranks", "",
                     "--ddp", "")
    assert list(chunk) == ["bench 2 ranks, 3 helpers chunk=2M;copy=loop", "bench 2 ranks, 3 helpers kernels=avx512"]
    assert _planned(tmp_path / "h", "--part", "1", "--helpers", "6", "--ranks", "", "--ddp", "")[
        "bench 2 ranks, 6 helpers"][1] == {"ONECCL_BIND_PT_HELPERS": "6"}
    assert chunk["bench 2 ranks, 3 helpers chunk=2M;copy=loop"][1] == {
        "ONECCL_BIND_PT_HELPERS": "3", "ONECCL_BIND_PT_SHM_CHUNK_BYTES": "2M", "ONECCL_BIND_PT_COPY": "loop"}
    assert chunk["bench 2 ranks, 3 helpers kernels=avx512"][1] == {"ONECCL_BIND_PT_HELPERS": "3",
                                                                  "ONECCL_BIND_PT_KERNELS": "avx512"}
    # --ops narrows every benchmark of ranks and the staged-against-single run, not the helper sweep.
    narrow = _planned(tmp_path / "o", "--part", "1", "--ops", "allgather,alltoall", "--ddp", "", "--helpers", "0",
                      "--single-sizes", "1M")
    assert {n: _option(c, "--ops") for n, (c, _) in narrow.items()} == {
        "bench 2 ranks": "allgather,alltoall", "bench 2 ranks, staged against single copy": "allgather,alltoall",
        "bench 2 ranks, 0 helpers": "allreduce,allgather,reduce_scatter,broadcast,sendrecv",
        "bench 4 ranks": "allgather,alltoall"}


@pytest.mark.parametrize("option, value, says", [
    ("--ddp", "2x8:view=true", "view is 0 or 1"), ("--ddp", "2x8:view", "is not NAME=VALUE"),
    ("--ddp", "2x8:colour=1", "is not NAME=VALUE"), ("--ddp", "2by8", "is not RANKSxTHREADS"),
    ("--ddp", "2x8:view=1,2x8:view=1", "named twice"), ("--helpers", "x", "is not a helper count"),
    ("--helpers", "3:chunk", "is not NAME=VALUE"), ("--helpers", "3:size=2M", "is not NAME=VALUE"),
    ("--helpers", "1,3,1", "named twice"), ("--helpers", "3:kernels=avx-512", "is not NAME=VALUE")])
def test_a_mistyped_run_stops_before_anything_runs(tmp_path, option, value, says):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, SCRIPT, "run", "--installed", "--quick", option, value, "--out", out],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())


def test_report_compares_ccl_with_the_faster_oneccl_column(tmp_path):
    def point(op, size, backend, us):
        return {"op": op, "dtype": "float32", "bytes": size, "backend": backend, "median_us": us}

    run = {"world": 4, "points": [point("allreduce", 4096, "ccl", 10.0), point("allreduce", 4096, "oneccl", 20.0),
                                  point("allreduce", 4096, "oneccl+w", 40.0), point("allgather", 1 << 20, "ccl", 300.0),
                                  point("allgather", 1 << 20, "oneccl", 250.0),
                                  point("allgather", 1 << 20, "oneccl+w", 200.0),
                                  point("allgather", 1 << 20, "single", 150.0)]}
    (tmp_path / "bench-4ranks.json").write_text(json.dumps(run))
    r = subprocess.run([sys.executable, SCRIPT, "report", tmp_path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {line.split()[0]: line.split()[3:] for line in r.stdout.splitlines() if line.startswith("  all")}
    # ccl, oneccl, oneccl+w, ccl/best (starred above 1), and where run, single and single/ccl
    assert rows == {"allreduce": ["10.0", "20.0", "40.0", "0.50"],
                    "allgather": ["300.0", "250.0", "200.0", "1.50", "*", "150.0", "0.50"]}, r.stdout
    assert "worst ccl/best: 1.50" in r.stdout, r.stdout
    # And DDP's communication time, ccl against oneccl and gloo, per run and dtype.
    ddp = {"2x8-view1": {"results": {"float32": {"ccl": {"comm_ms": 30.0}, "oneccl": {"comm_ms": 60.0},
                                                 "gloo": {"comm_ms": 120.0}, "local": {}}}},
           "4x4": {"results": {"float32": {"ccl": {"comm_ms": 30.0}, "ccl+idle": {"comm_ms": 15.0},
                                           "oneccl": {"comm_ms": 60.0}, "gloo": {"comm_ms": 120.0}, "local": {}}}}}
    (tmp_path / "ddp.json").write_text(json.dumps(ddp))
    r = subprocess.run([sys.executable, SCRIPT, "report", tmp_path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("  2x8-view1"))
    # ccl, ccl+idle, oneccl, gloo, then ccl/oneccl, ccl/gloo, idle/oneccl, idle/gloo
    assert row == ["2x8-view1", "float32", "30.0", "-", "60.0", "120.0", "0.50", "0.25", "-", "-"], r.stdout
    row = next(line.split() for line in r.stdout.splitlines() if line.startswith("  4x4"))
    assert row == ["4x4", "float32", "30.0", "15.0", "60.0", "120.0", "0.50", "0.25", "0.25", "0.12"], r.stdout
