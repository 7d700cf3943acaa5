"""Which launcher started this process, and torch's env:// variables from its own.

``init_process_group("ccl")`` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(and the backend LOCAL_RANK, LOCAL_WORLD_SIZE). torchrun sets them; other launchers
set their own, which ``import oneccl_bind_pt`` copies, each only if unset: variables
you set always win.

===============  ===========================  ===============================  =================================
launcher         recognised by                RANK, WORLD_SIZE,                MASTER_ADDR / MASTER_PORT
                                              LOCAL_RANK, LOCAL_WORLD_SIZE
===============  ===========================  ===============================  =================================
torchrun         TORCHELASTIC_RUN_ID          set by torchrun                  set by torchrun
Open MPI         OMPI_COMM_WORLD_RANK,        OMPI_COMM_WORLD_RANK, _SIZE,     127.0.0.1 on one node; a port
                 OMPI_COMM_WORLD_SIZE         _LOCAL_RANK, _LOCAL_SIZE         from OMPI_MCA_ess_base_jobid
Intel MPI        PMI_RANK, PMI_SIZE,          PMI_RANK, PMI_SIZE,              127.0.0.1 on one node; a port
(hydra)          MPI_LOCALRANKID,             MPI_LOCALRANKID,                 from I_MPI_HYDRA_UUID
                 I_MPI_HYDRA_UUID             MPI_LOCALNRANKS
MPICH (hydra)    PMI_RANK, PMI_SIZE,          as Intel MPI                     127.0.0.1 on one node; a port
                 MPI_LOCALRANKID                                               from the launcher's process
Slurm (srun)     SLURM_PROCID and             SLURM_PROCID,                    127.0.0.1 on one node, else
                 SLURM_STEP_ID (a job step)   SLURM_STEP_NUM_TASKS,            the first host of
                                              SLURM_LOCALID, this node's       SLURM_STEP_NODELIST; a port
                                              count in                         from SLURM_JOB_ID and
                                              SLURM_STEP_TASKS_PER_NODE        SLURM_STEP_ID
===============  ===========================  ===============================  =================================

Checked in that order: mpirun started inside a Slurm allocation leaves Slurm's
variables (rank 0 of the whole job) in every rank, so MPI launchers come first, and
``srun --mpi=pmi2`` (PMI_RANK without MPI_LOCALRANKID) counts as Slurm. A Slurm
batch script or salloc shell is not a launch (no SLURM_STEP_ID): start the ranks with
srun. Ports lie in 10000-29999, below Linux's ephemeral range, and differ between
two jobs on one node. Across nodes under MPICH, which names no job, set
MASTER_ADDR and MASTER_PORT yourself.
"""

from __future__ import annotations

import os
import re
import warnings
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass, field


# What import mapped in this process: {variable: (value, source)}; the doctor shows it.
mapped: dict[str, tuple[str, str]] = {}


@dataclass
class Launch:
    name: str
    # torch's variable -> (value, where it came from), before applying.
    values: dict[str, tuple[str, str]] = field(default_factory=dict)


# Below Linux's ephemeral range (the kernel never hands these out by itself), and below the
# ports the tests and scripts hold for their jobs (scripts/ports.py, from 30000), so a
# launcher's job beside a test run never takes the port a test was given.
JOB_PORTS = range(10000, 30000)


def job_port(key: str) -> str:
    """A port every rank of one job derives alike and another job likely not."""
    return str(JOB_PORTS.start + zlib.crc32(key.encode()) % len(JOB_PORTS))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: 'node[07-09,12],gpu1' -> 'node07'."""
    first = re.split(r",(?![^\[]*\])", nodelist.strip())[0]
    return re.sub(r"\[([^\]\-,]*)[^\]]*\]", r"\1", first)


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            raise ValueError(f"cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _mpi(env, name, rank, size, local_rank, local_size, job_key):
    values = {
        "RANK": (env[rank], rank),
        "WORLD_SIZE": (env[size], size),
        "LOCAL_RANK": (env[local_rank], local_rank),
        "LOCAL_WORLD_SIZE": (env[local_size], local_size),
    }
    if env[local_size] == env[size]:  # every rank on this host
        values["MASTER_ADDR"] = ("127.0.0.1", f"{local_size} == {size}")
        values["MASTER_PORT"] = (job_port(job_key[0]), job_key[1])
    elif job_key[1] != "launcher process":  # a job id all hosts share
        values["MASTER_PORT"] = (job_port(job_key[0]), job_key[1])
    return Launch(name, values)


def _launcher_daemon(names: tuple[str, ...]) -> int:
    """The pid of this process's nearest ancestor named one of `names` (an MPI launcher's daemon on
    this host, which every local rank shares), else of its parent. A wrapper between the daemon
    and Python (a shell script, `uv run`, `conda run`, a container's entry) gives each rank a
    parent of its own, and ranks that keyed their port on it would not meet."""
    pid = os.getppid()
    for _ in range(32):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            break
        if stat[stat.index("(") + 1:stat.rindex(")")] in names:
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])  # after the name: state, then ppid
        if pid <= 1:
            break
    return os.getppid()


def detect(env: MutableMapping[str, str] = os.environ) -> Launch:
    """The launcher of this process and the values it implies (nothing is set here)."""
    if "TORCHELASTIC_RUN_ID" in env:
        return Launch("torchrun")
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        # A job id every host shares; failing that, the local daemon (same port on one host only).
        source = next((v for v in ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE") if env.get(v)), None)
        key = (env[source], source) if source else (f"ompi-{_launcher_daemon(('orted', 'prted'))}", "launcher process")
        return _mpi(env, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", key)
    if "PMI_RANK" in env and "PMI_SIZE" in env and "MPI_LOCALRANKID" in env and "MPI_LOCALNRANKS" in env:
        if "I_MPI_HYDRA_UUID" in env:
            return _mpi(env, "intel-mpi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                        (env["I_MPI_HYDRA_UUID"], "I_MPI_HYDRA_UUID"))
        # MPICH's hydra names no job: its proxy process is the same for the ranks of one host.
        return _mpi(env, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                    (f"mpich-{_launcher_daemon(('hydra_pmi_proxy',))}", "launcher process"))
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" in env and step is not None:
        size = env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES", "1"))
        values = {
            "RANK": (env["SLURM_PROCID"], "SLURM_PROCID"),
            "WORLD_SIZE": (size, "SLURM_STEP_NUM_TASKS"),
            "LOCAL_RANK": (env["SLURM_LOCALID"], "SLURM_LOCALID"),
        }
        if "SLURM_STEP_TASKS_PER_NODE" in env and "SLURM_NODEID" in env:
            here = tasks_per_node(env["SLURM_STEP_TASKS_PER_NODE"])[int(env["SLURM_NODEID"])]
            values["LOCAL_WORLD_SIZE"] = (str(here), "SLURM_STEP_TASKS_PER_NODE")
        if nodes == 1:
            values["MASTER_ADDR"] = ("127.0.0.1", "SLURM_STEP_NUM_NODES == 1")
        elif "SLURM_STEP_NODELIST" in env:
            values["MASTER_ADDR"] = (first_host(env["SLURM_STEP_NODELIST"]), "SLURM_STEP_NODELIST")
        values["MASTER_PORT"] = (job_port(f"slurm-{env['SLURM_JOB_ID']}.{step}"), "SLURM_JOB_ID, SLURM_STEP_ID")
        return Launch("slurm", values)
    return Launch("none")


# Variables that mean "one rank of a parallel job" to launchers we do not map.
_FOREIGN = ("PMIX_RANK", "PMI_RANK", "PALS_RANKID", "ALPS_APP_PE", "JSM_NAMESPACE_RANK", "MV2_COMM_WORLD_RANK")


def unmapped_launch_hint(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Why init_process_group would not know this rank, when it looks like a parallel launch."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env \
            and int(env.get("SLURM_NTASKS", "1")) > 1:
        return ("this process runs inside Slurm job {} but not in a job step (a batch script or salloc "
                "shell): start the ranks with `srun python ...`, which gives each its rank".format(env["SLURM_JOB_ID"]))
    seen = [v for v in _FOREIGN if v in env]
    if seen:
        return (f"this process looks like one rank of a parallel job ({', '.join(seen)} set), but not from a "
                "launcher oneccl_bind_pt maps (torchrun, srun, mpirun of Intel MPI, Open MPI or MPICH); set "
                "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each rank")
    return None


def map_launcher_env(env: MutableMapping[str, str] = os.environ, record: dict | None = None) -> str:
    """Copies the launcher's values into torch's unset variables; returns the launcher's name.

    `record` (by default, for os.environ, `mapped`) receives {variable: (value, source)}.
    """
    if record is None and env is os.environ:
        record = mapped
    launch = detect(env)
    for name, (value, source) in launch.values.items():
        if name not in env:
            env[name] = value
            if record is not None:
                record[name] = (value, source)
    hint = unmapped_launch_hint(env) if launch.name == "none" else None
    if hint:
        warnings.warn(f"oneccl_bind_pt: {hint}.", stacklevel=3)
    return launch.name
