"""The launchers HPC sites run: Slurm (srun, sbatch), Open MPI and MPICH.

Real launchers from Debian's packages (installed here when missing and the test
runs as root; skipped with the command to run otherwise, failed under CI=true) start the DDP example
as users do, with nothing exported by hand. Slurm runs as a one-node cluster
these tests start and tear down (tests/slurm.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from harness import Lines, apt_install, communicate, popen, require
from slurm import SlurmCluster, missing_programs
from test_launchers import BIN, ROOT, checksums, ddp_reference

PACKAGES = {"slurm": ["slurm-wlm", "munge"], "openmpi": ["openmpi-bin"], "mpich": ["mpich"]}
PROGRAMS = {"slurm": ["srun", "munged"], "openmpi": ["mpirun.openmpi"], "mpich": ["mpiexec.mpich"]}


def needs(what: str):
    why = apt_install(tuple(PACKAGES[what]), tuple(PROGRAMS[what]))
    require(not why, why)


# Variables a launcher sets per rank: the test process's own must not leak into a job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "I_MPI_HYDRA", "HYDRA_", "SLURM_", "TORCHELASTIC_")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS) and not k.startswith("CCL_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python` is this venv's
    env.update(extra)
    return env


def launch(cmd, env, timeout=240):
    start = time.monotonic()
    p = popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = communicate([p], timeout)
    return p.returncode, out, time.monotonic() - start


# ---- Open MPI and MPICH -------------------------------------------------------------

OMPI_ENV = {
    # Root in a container; more ranks than cores; loopback only; no ssh needed locally.
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_plm_rsh_agent": "false",
    "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo",
}


@pytest.mark.parametrize("world", [2, 3])
def test_openmpi_runs_the_ddp_example(world):
    needs("openmpi")
    rc, out, _ = launch(["mpirun.openmpi", "-n", world, sys.executable, "examples/ddp.py"], clean_env(**OMPI_ENV))
    assert rc == 0, out
    checksums(out, world, ddp_reference(world))


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "shell-wrapper"])
def test_mpich_runs_the_ddp_example(wrapped):
    # Wrapped: each rank's Python is the child of a shell of its own (a job script without exec,
    # `uv run`, `conda run`), not of hydra's proxy, and the ranks must still agree on a port.
    needs("mpich")
    cmd = [sys.executable, "examples/ddp.py"]
    if wrapped:
        cmd = ["sh", "-c", f'"{sys.executable}" examples/ddp.py; exit $?']
    rc, out, _ = launch(["mpiexec.mpich", "-n", 2, *cmd], clean_env())
    assert rc == 0, out
    checksums(out, 2, ddp_reference(2))


# ---- Slurm ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    needs("slurm")
    require(not missing_programs(), f"Slurm's programs not found: {missing_programs()}")
    start = time.monotonic()
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        cluster.setup_seconds = time.monotonic() - start
        yield cluster


def test_srun_runs_the_ddp_example(slurm):
    rc, out, _ = launch(["srun", "-n", 2, "--immediate=60", "python", "examples/ddp.py"], slurm.env(clean_env()))
    assert rc == 0, out
    checksums(out, 2, ddp_reference(2))


def test_sbatch_runs_the_example_batch_script(slurm):
    jid, state, out = slurm.sbatch_wait(ROOT / "examples/slurm/ddp.sbatch", cwd=ROOT, env=clean_env())
    assert state == "COMPLETED", f"job {jid}: {state}\n{out}"
    checksums(out, 2, ddp_reference(2))


def test_a_killed_task_makes_the_other_raise_and_the_job_end(slurm):
    # Task 1 SIGKILLs itself after the first allreduce; Slurm leaves task 0 running.
    # The job ending at all is bounded by launch()'s timeout; how soon task 0 raised,
    # by its own clock around the collective (the timeout, with room for a loaded machine).
    rc, out, _ = launch(["srun", "-n", 2, "--immediate=60", "python", "tests/scripts/rank_dies.py"],
                        slurm.env(clean_env(PG_TIMEOUT="10")), timeout=180)
    assert rc != 0, out
    m = re.search(r"rank 0 raised after ([\d.]+) s: .*allreduce", out)
    assert m and float(m.group(1)) <= 20, out


def test_scancel_of_a_step_ends_it(slurm):
    script = ("import torch, torch.distributed as dist, oneccl_bind_pt, time\n"
              "dist.init_process_group('ccl'); t = torch.ones(1024); dist.all_reduce(t)\n"
              "print('ready', dist.get_rank(), flush=True)\n"
              "while True: dist.all_reduce(t)\n")
    srun = popen(["srun", "-n", "2", "--immediate=60", "--job-name=spin", "python", "-P", "-c", script],
                 cwd=ROOT, env=slurm.env(clean_env()), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(srun)
    try:
        # Both tasks inside the loop: each printed after a collective with the other.
        out.wait_for("ready", count=2, timeout=180)
        job = slurm.run(["squeue", "-h", "-n", "spin", "-o", "%i"]).stdout.strip()
        assert job, f"squeue does not list the running job:\n{out.text}"
        slurm.run(["scancel", f"{job}.0"])
        text = out.finish(timeout=120)  # the step ends (or this fails, naming what it waited for)
        assert srun.returncode != 0, text
    finally:
        out.close()
