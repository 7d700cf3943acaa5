"""The examples, run the way users run them: torchrun, mpirun, mp.spawn."""

import json
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


# Ranks that torchrun starts may come to the first group seconds apart (imports under load). The
# ranks there wait for each other without torch's store client logging a warning every half second
# (it logs two for each wait on the store that runs out; gloo's meeting logs none).
def test_a_late_rank_under_torchrun_brings_no_store_warnings(tmp_path):
    out = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
               "tests/scripts/late_rank.py", str(tmp_path / "rank0_in_init")])
    took = dict(re.findall(r"rank (\d) init took ([\d.]+) s sum 2", out))
    assert sorted(took) == ["0", "1"], out
    assert float(took["0"]) >= 1.4, out  # rank 0 did wait for the late one
    assert "waitForInput" not in out and "timed out after" not in out, out


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


# torch-ccl's recipes exported CCL_ATL_TRANSPORT=mpi (oneCCL over Intel MPI) on every rank; that
# still trains, through shared memory and, with it off, through oneCCL's MPI transport.
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "oneccl"])
def test_mpirun_with_oneccls_mpi_transport(shm):
    out = run([BIN / "mpirun", "-n", "3", sys.executable, "tests/scripts/mpi_style.py"],
              env={"MASTER_PORT": str(free_port()), "CCL_ATL_TRANSPORT": "mpi", "ONECCL_BIND_PT_SHM": shm})
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


# ---- the cores a rank takes as its own ------------------------------------------------------
# Helper threads and oneCCL's worker threads are sized from them (src/helpers.cpp, rank_cores).
# Ranks given one CPU set between them (taskset or numactl around the launcher) divide it;
# ranks pinned each to CPUs of their own (Intel MPI's default, a script pinning itself) keep
# theirs. Read as each rank's own, a shared set gave every rank all of it: on a 2-socket host
# under `numactl -C <socket 0> torchrun --nproc_per_node 2`, helpers beside each rank's compute
# threads for twice the cores there are.

AFFINITY = "tests/scripts/affinity.py"


def _launch(launcher):
    """(command, env) for tests/scripts/affinity.py's 2 ranks under `launcher`."""
    if launcher == "torchrun":
        return [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), AFFINITY], None
    if launcher == "mpirun":
        return [BIN / "mpirun", "-n", "2", sys.executable, AFFINITY], {"MASTER_PORT": str(free_port())}
    return [sys.executable, AFFINITY, "--spawn", str(free_port())], None


def _rank_reports(out):
    # Ranks share stdout, so lines may run together: each report ends with its "sum_ok".
    reports = sorted((json.loads(m) for m in re.findall(r'\{"rank".*?"sum_ok": (?:true|false)\}', out)),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], out
    for r in reports:
        assert r["sum_ok"], r
        if "a CPU quota" in r["why"]:
            pytest.skip(f"a container's CPU quota decides here: {r['why']}")
        # The count follows the cores read (src/helpers.hpp), and that many threads run.
        want = min(6, max(0, r["cores"] - max(1, r["torch_threads"])))
        assert r["helpers"].startswith(f"helpers {want} ("), r
        assert r["helper_threads"] == want, r
    return reports


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "spawn"])
def test_ranks_given_one_cpu_set_between_them_divide_it(launcher):
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one CPU: no set narrower than the host's to give the job")
    shared = mine[:len(mine) // 2]
    cmd, env = _launch(launcher)
    if launcher == "mpirun":
        env["I_MPI_PIN"] = "0"  # Intel MPI would otherwise pin each rank to a part of the set
    out = run(["taskset", "-c", ",".join(map(str, shared)), *cmd], env=env)
    for r in _rank_reports(out):
        assert r["cpus"] == shared, (r, shared)
        assert (r["pinned"], r["cores"], r["crowded"]) == (False, max(1, len(shared) // 2), len(shared) < 2), r
        assert r["why"] == f"{len(shared)} CPU{'s' * (len(shared) > 1)} in its affinity / 2 ranks given the same CPUs", r


@pytest.mark.parametrize("launcher", ["mpirun", "spawn"])
def test_ranks_pinned_each_to_a_cpu_of_their_own_keep_it(launcher):
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("one CPU: no two CPUs to pin the ranks to")
    cmd, env = _launch(launcher)
    if launcher == "mpirun":
        env["I_MPI_PIN_PROCESSOR_LIST"] = f"{mine[0]},{mine[1]}"
    else:
        # Each rank pins itself; mp.spawn's resource tracker, a sibling of the ranks, keeps
        # the wider set and must not count as a rank sharing theirs.
        cmd.append("--own-cpu")
    reports = _rank_reports(run(cmd, env=env))
    assert sorted(r["cpus"][0] for r in reports) == mine[:2] and all(len(r["cpus"]) == 1 for r in reports), reports
    for r in reports:
        assert (r["pinned"], r["cores"], r["crowded"], r["why"]) == (True, 1, False, "1 CPU in its affinity"), r
