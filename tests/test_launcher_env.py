"""Launcher variables -> torch's env:// variables (oneccl_bind_pt/_launchers.py).

Each environment below is what a real launcher gave a rank (recorded under
srun, sbatch, Open MPI's mpirun, MPICH's and Intel MPI's hydra on this machine
kind); the launcher tests (test_launchers.py) run the real ones end to end.
"""

from __future__ import annotations

import pytest
from harness import free_port

from oneccl_bind_pt import _launchers

INTEL = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "11", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
         "I_MPI_HYDRA_UUID": "a15a0000-52a8-e08d-d560-0600013e2a4e", "HYDRA_BSTRAP_NODE_ID": "0"}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
         "HYDI_CONTROL_FD": "7"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1071185921", "PMIX_RANK": "1",
        "PMIX_NAMESPACE": "1071185921", "OMPI_MCA_orte_num_nodes": "1"}
SRUN = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "41", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NNODES": "1", "SLURM_STEP_NODELIST": "vm", "SLURM_JOB_NODELIST": "vm",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_GTIDS": "0,1"}
# srun -N 2 -n 4: task 3 on the second node.
SRUN_TWO_NODES = {**SRUN, "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
                  "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
                  "SLURM_STEP_NODELIST": "node[07-08]", "SLURM_JOB_NODELIST": "node[07-08]",
                  "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_GTIDS": "2,3"}
# The batch script itself: Slurm calls it rank 0 of the job, but it is no step.
SBATCH_SCRIPT = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2"}


def mapped(env):
    env = dict(env)
    name = _launchers.map_launcher_env(env, record={})
    return name, {k: env.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}


@pytest.mark.parametrize("env, launcher, want", [
    (INTEL, "intel-mpi", ("1", "2", "1", "2", "127.0.0.1")),
    (MPICH, "mpich", ("1", "2", "1", "2", "127.0.0.1")),
    (OMPI, "openmpi", ("1", "2", "1", "2", "127.0.0.1")),
    (SRUN, "slurm", ("1", "2", "1", "2", "127.0.0.1")),
    (SRUN_TWO_NODES, "slurm", ("3", "4", "1", "2", "node07")),
    # srun --mpi=pmi2 adds PMI_RANK/PMI_SIZE but no MPI_LOCALRANKID: still Slurm's.
    ({**SRUN, "PMI_RANK": "1", "PMI_SIZE": "2", "PMI_JOBID": "41.0", "SLURM_MPI_TYPE": "pmi2"}, "slurm",
     ("1", "2", "1", "2", "127.0.0.1")),
    # mpirun inside an sbatch allocation: every rank also sees SLURM_PROCID=0.
    ({**SBATCH_SCRIPT, "SLURM_STEP_ID": "0", **INTEL}, "intel-mpi", ("1", "2", "1", "2", "127.0.0.1")),
    ({**SBATCH_SCRIPT, **OMPI}, "openmpi", ("1", "2", "1", "2", "127.0.0.1")),
], ids=["intel", "mpich", "openmpi", "srun", "srun-2-nodes", "srun-pmi2", "intel-in-sbatch", "openmpi-in-sbatch"])
def test_launchers_map_to_torch_variables(env, launcher, want):
    name, values = mapped(env)
    assert name == launcher
    assert tuple(values.values()) == want


def test_ports_agree_within_a_job_and_differ_between_jobs():
    ports = {}
    for job in ("41", "42"):
        for rank in ("0", "1"):
            env = {**SRUN, "SLURM_JOB_ID": job, "SLURM_PROCID": rank, "SLURM_LOCALID": rank}
            _launchers.map_launcher_env(env, record={})
            ports.setdefault(job, set()).add(env["MASTER_PORT"])
    assert len(ports["41"]) == len(ports["42"]) == 1
    assert ports["41"] != ports["42"]
    assert all(10000 <= int(p) < 30000 for s in ports.values() for p in s)
    step1 = {**SRUN, "SLURM_STEP_ID": "1"}
    _launchers.map_launcher_env(step1, record={})
    assert {step1["MASTER_PORT"]} != ports["41"]  # two steps of one job at once


def test_derived_ports_and_the_ports_tests_hold_are_disjoint():
    # A launcher's job beside a test run must not be able to take a port a test holds.
    derived = {int(_launchers.job_port(f"slurm-{i}.0")) for i in range(50_000)}
    assert min(derived) >= _launchers.JOB_PORTS.start and max(derived) < _launchers.JOB_PORTS.stop
    assert max(derived) > _launchers.JOB_PORTS.stop - 10  # the whole range is used
    held = [free_port() for _ in range(20)]
    assert len(set(held)) == 20 and min(held) >= _launchers.JOB_PORTS.stop, held


def test_what_the_user_set_wins():
    env = {**SRUN, "RANK": "7", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "1234"}
    record = {}
    _launchers.map_launcher_env(env, record=record)
    assert (env["RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == ("7", "10.0.0.9", "1234")
    assert env["WORLD_SIZE"] == "2" and "RANK" not in record
    assert record["WORLD_SIZE"] == ("2", "SLURM_STEP_NUM_TASKS")


def test_across_hosts_without_a_shared_job_id_address_and_port_are_left_to_the_user():
    # MPICH names no job that every host shares.
    env = {**MPICH, "PMI_SIZE": "4", "PMI_RANK": "3"}
    _, values = mapped(env)
    after = dict(env)
    _launchers.map_launcher_env(after, record={})
    assert values["MASTER_ADDR"] is None and "MASTER_PORT" not in after
    intel = {**INTEL, "PMI_SIZE": "4", "PMI_RANK": "3"}
    _launchers.map_launcher_env(intel, record={})
    assert "MASTER_ADDR" not in intel and "MASTER_PORT" in intel  # the job id is shared
    # Open MPI without a job id: the fallback key differs per host, so no port either.
    ompi = {k: v for k, v in OMPI.items() if k not in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")}
    ompi.update(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_RANK="3")
    _launchers.map_launcher_env(ompi, record={})
    assert "MASTER_ADDR" not in ompi and "MASTER_PORT" not in ompi


@pytest.mark.parametrize("env, words", [
    (SBATCH_SCRIPT, ["not in a job step", "srun"]),
    ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-x"}, ["PMIX_RANK", "RANK, WORLD_SIZE"]),
    ({"PALS_RANKID": "2"}, ["PALS_RANKID", "MASTER_ADDR"]),
])
def test_unknown_launch_warns_with_the_variables_to_set(env, words):
    env = dict(env)
    with pytest.warns(UserWarning) as caught:
        assert _launchers.map_launcher_env(env, record={}) == "none"
    message = str(caught[0].message)
    assert all(w in message for w in words), message
    assert "RANK" not in env  # nothing guessed: a wrong guess would hang in the rendezvous


def test_no_warning_without_signs_of_a_launch():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _launchers.map_launcher_env({"HOME": "/root"}, record={}) == "none"


@pytest.mark.parametrize("nodelist, first", [
    ("vm", "vm"), ("node[07-09,12],gpu1", "node07"), ("127.0.0.[1-2]", "127.0.0.1"),
    ("rack[2-3]-n[08-10]", "rack2-n08"), ("a,b[1-2]", "a"),
])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert _launchers.first_host(nodelist) == first


def test_tasks_per_node():
    assert _launchers.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert _launchers.tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        _launchers.tasks_per_node("two")
