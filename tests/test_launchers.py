"""The examples, run the way users run them: torchrun, mpirun, mp.spawn."""

import os
import re
import sys
from pathlib import Path

import pytest

from harness import free_port, run_job

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.append(str(ROOT / "scripts"))
from ddp_reference import ddp_example_checksum, one_process_checksum  # noqa: E402


def run(cmd, timeout=180, env=None):
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    # Launchers must not inherit a torchrun/MPI context from the test process.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PMI_RANK", "PMI_SIZE"):
        if env is None or var not in env:
            full_env.pop(var, None)
    return run_job(cmd, ROOT, full_env, timeout)


def checksums(out, world, reference):
    """Each rank's printed parameter checksum: all equal, and equal to `reference` (the same
    training done in this process), unless the caller passes None and compares elsewhere."""
    # Ranks share stdout, so lines may run together: match the number exactly.
    sums = dict(re.findall(r"rank (\d+) parameter checksum (-?\d+\.\d{10})", out))
    assert sorted(sums) == [str(r) for r in range(world)], out
    assert len(set(sums.values())) == 1, f"ranks disagree: {sums}"
    if reference is not None:
        got = float(sums["0"])
        assert got == pytest.approx(reference, rel=1e-6, abs=1e-7), f"ranks agree on {got}, one process gets {reference}"
    return sums


def ddp_reference(world):
    """examples/ddp.py's final checksum, computed in this process without distribution."""
    return ddp_example_checksum(world)


def mpi_style_reference(world):
    """tests/scripts/mpi_style.py's final checksum, computed in this process."""
    return one_process_checksum(world, lr=0.1, steps=3, seed_of_rank=lambda r: r)


def nothing_of_oneccl(out):
    # A default run prints no oneCCL line: the package's CCL_LOG_LEVEL=error hides oneCCL's
    # notices, and the one about that variable itself is filtered out at oneCCL's init.
    assert "|CCL_" not in out, out


def test_torchrun_ddp_example():
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/ddp.py"])
    checksums(out, 2, ddp_reference(2))
    nothing_of_oneccl(out)


# Each init under torchrun uses the agent's store, and the default group is named "0" again after
# each destroy: the same keys every time. Before, a later init read the last group's keys: it lost
# shared memory (the old segments), or hung on the old oneCCL address. (gloo reads the last group's addresses there too: on torch 2.13 its second init fails
# with "Gloo connectFullMesh failed ... Connection refused", so it cannot serve as the reference.)
def test_torchrun_init_destroy_and_init_again():
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
               "tests/scripts/init_again.py", "ccl"])
    rounds = re.findall(r"rank (\d) round (\d) sum (\S+) path (\S+) in ([\d.]+) s", out)
    assert sorted((r, i) for r, i, *_ in rounds) == [(r, i) for r in "01" for i in "012"], out
    for rank, round_, ok, path, took in rounds:
        assert ok == "ok", out
        assert path == ("oneccl" if os.environ.get("ONECCL_BIND_PT_SHM") == "0" else "shm"), out
        assert float(took) < 30, out  # the group timeout is 60 s


def test_mpirun_ddp_example():
    out = run([BIN / "mpirun", "-n", "2", sys.executable, "examples/ddp.py"], env={"MASTER_PORT": str(free_port())})
    checksums(out, 2, ddp_reference(2))
    nothing_of_oneccl(out)


def test_oneccl_notices_show_when_the_user_sets_the_level():
    # The other side of nothing_of_oneccl: the same run at the level a user may choose prints
    # oneCCL's notices, so their absence above is the package's doing, not a lost stream.
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), "examples/ddp.py"],
              env={"CCL_LOG_LEVEL": "warn"})
    checksums(out, 2, ddp_reference(2))
    assert "|CCL_WARN| value of CCL_PROCESS_LAUNCHER changed" in out, out


def test_spawn_ddp_example():
    out = run([sys.executable, "examples/ddp_spawn.py", "--port", str(free_port())])
    checksums(out, 2, ddp_reference(2))


def test_single_process_example():
    out = run([sys.executable, "examples/ddp.py"], env={"MASTER_PORT": str(free_port())})
    checksums(out, 1, ddp_reference(1))


def test_mpirun_torch_ccl_style_script():
    out = run(
        [BIN / "mpirun", "-n", "3", sys.executable, "tests/scripts/mpi_style.py"],
        env={"MASTER_PORT": str(free_port())},
    )
    assert "my rank = 2  my size = 3" in out
    checksums(out, 3, mpi_style_reference(3))


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
