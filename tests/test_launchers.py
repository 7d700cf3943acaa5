"""The examples, run the way users run them: torchrun, mpirun, mp.spawn."""

import os
import re
import socket
import sys
from pathlib import Path

import pytest

from harness import run_job

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=180, env=None):
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    # Launchers must not inherit a torchrun/MPI context from the test process.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE"):
        if env is None or var not in env:
            full_env.pop(var, None)
    return run_job(cmd, ROOT, full_env, timeout)


def checksums(out, world):
    # Ranks share stdout, so lines may run together: match the number exactly.
    sums = dict(re.findall(r"rank (\d+) parameter checksum (-?\d+\.\d{10})", out))
    assert sorted(sums) == [str(r) for r in range(world)], out
    assert len(set(sums.values())) == 1, f"ranks disagree: {sums}"
    return sums


def test_torchrun_ddp_example():
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/ddp.py"])
    checksums(out, 2)


def test_mpirun_ddp_example():
    out = run([BIN / "mpirun", "-n", "2", sys.executable, "examples/ddp.py"], env={"MASTER_PORT": str(free_port())})
    checksums(out, 2)


def test_spawn_ddp_example():
    out = run([sys.executable, "examples/ddp_spawn.py", "--port", str(free_port())])
    checksums(out, 2)


def test_single_process_example():
    out = run([sys.executable, "examples/ddp.py"], env={"MASTER_PORT": str(free_port())})
    assert "rank 0 parameter checksum" in out


def test_mpirun_torch_ccl_style_script():
    out = run(
        [BIN / "mpirun", "-n", "3", sys.executable, "tests/scripts/mpi_style.py"],
        env={"MASTER_PORT": str(free_port())},
    )
    assert "my rank = 2  my size = 3" in out
    checksums(out, 3)


@pytest.mark.parametrize("launcher", ["mpirun", "torchrun"])
def test_profiler_rows(launcher):
    if launcher == "mpirun":
        cmd = [BIN / "mpirun", "-n", "2", sys.executable, "examples/profiling.py"]
        env = {"MASTER_PORT": str(free_port())}
    else:
        cmd = [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/profiling.py"]
        env = None
    out = run(cmd, env=env)
    # Both ranks print a table; each row shows the calls of one rank.
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s*(pg::\S+)\s.*?\s(\d+)\s+(\[.*\])\s*$", line)
        if m:
            rows.setdefault(m.group(1), []).append((int(m.group(2)), m.group(3)))
    assert sorted(rows["pg::allreduce"]) == [(10, "[[2, 2]]")] * 2 + [(10, "[[4, 4]]")] * 2, rows
    assert rows["pg::wait::allreduce::sz:4"] == [(10, "[]")] * 2, rows
    assert rows["pg::wait::allreduce::sz:16"] == [(10, "[]")] * 2, rows
