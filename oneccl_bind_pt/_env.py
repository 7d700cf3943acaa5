"""Launcher detection and oneCCL defaults.

oneCCL reads its environment once, when the first communicator is created, and
its own defaults are tuned for machines where each rank owns spare cores. On
anything smaller they make every collective cost milliseconds (see
docs/performance.md). So before the first ``ccl`` process group is created
this module sets the variables below, each one only if the user has not set
it; set any of them yourself to override.

=========================  ==========================  =====================================
Variable                   Default we set              Why
=========================  ==========================  =====================================
CCL_PROCESS_LAUNCHER       ``none``                    Ranks meet through the c10d Store
                                                       torch already has, whatever the
                                                       launcher (torchrun, mp.spawn, mpirun).
CCL_ATL_TRANSPORT          ``ofi``                     The same transport under every
                                                       launcher (oneCCL would switch to MPI
                                                       under mpirun).
CCL_LOCAL_RANK,            this rank's place on its    oneCCL needs them when no MPI
CCL_LOCAL_SIZE             host and the rank count     launcher bootstraps it. From
                           there                       LOCAL_RANK/LOCAL_WORLD_SIZE
                                                       (torchrun), MPI_LOCALRANKID/
                                                       MPI_LOCALNRANKS (Intel MPI), else
                                                       counted through the Store.
CCL_ATL_SHM                ``1``                       Ranks on one host exchange data
                                                       through shared memory, not sockets.
CCL_WORKER_OFFLOAD         ``0``                       oneCCL's default worker thread
                                                       busy-polls beside every rank; on
                                                       hosts with fewer spare cores than
                                                       ranks it makes each op ~8 ms. With
                                                       0 the op progresses in the thread
                                                       that waits for it (or in our
                                                       background thread for Futures).
CCL_KVS_IFACE              ``lo`` when every rank is   oneCCL's bootstrap listener binds
                           on this host                the loopback, not the first NIC.
CCL_LOG_LEVEL              ``error``                   oneCCL warns about every variable
                                                       above at startup; errors still show.
=========================  ==========================  =====================================

If CCL_WORKER_COUNT or CCL_WORKER_AFFINITY is set, we leave CCL_WORKER_OFFLOAD
alone: the user is managing oneCCL's worker threads (the classic torch-ccl
tuning on large hosts).

Launcher mapping, done on import (``map_launcher_env``): under Intel MPI's
``mpirun`` (PMI_RANK/PMI_SIZE set) and with RANK/WORLD_SIZE unset, RANK,
WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are copied from the MPI variables,
and when every rank runs on this host MASTER_ADDR defaults to 127.0.0.1 and
MASTER_PORT to 29500, so ``init_process_group("ccl")`` works as written.
"""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

# Variables this module set, and the value: `doctor` shows them as ours.
applied: dict[str, str] = {}

_DEFAULT_MASTER_PORT = "29500"


def _set_default(env: MutableMapping[str, str], name: str, value: str) -> None:
    if name not in env:
        env[name] = value
        applied[name] = value


def map_launcher_env(env: MutableMapping[str, str] = os.environ) -> str:
    """Fill torch's env:// variables from the launcher's; return the launcher's name."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        _set_default(env, "RANK", env["PMI_RANK"])
        _set_default(env, "WORLD_SIZE", env["PMI_SIZE"])
        if "MPI_LOCALRANKID" in env:
            _set_default(env, "LOCAL_RANK", env["MPI_LOCALRANKID"])
        if "MPI_LOCALNRANKS" in env:
            _set_default(env, "LOCAL_WORLD_SIZE", env["MPI_LOCALNRANKS"])
        if env.get("MPI_LOCALNRANKS") == env["PMI_SIZE"]:
            # Every rank is on this host; across hosts the user names rank 0's.
            _set_default(env, "MASTER_ADDR", "127.0.0.1")
        _set_default(env, "MASTER_PORT", _DEFAULT_MASTER_PORT)
        return "mpirun"
    return "none"


def _local_layout(store, rank: int, size: int, env: MutableMapping[str, str]) -> tuple[int, int]:
    """This rank's index among the ranks on its host, and how many there are."""
    for rank_var, size_var in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if rank_var in env and size_var in env and int(env.get("WORLD_SIZE", size)) == size:
            return int(env[rank_var]), int(env[size_var])
    # No launcher told us (mp.spawn, hand-written scripts): compare host names.
    host = socket.gethostname()
    store.set(f"oneccl/host/{rank}", host)
    hosts = [store.get(f"oneccl/host/{r}").decode() for r in range(size)]
    mine = [r for r, h in enumerate(hosts) if h == host]
    return mine.index(rank), len(mine)


def apply_ccl_defaults(store, rank: int, size: int, env: MutableMapping[str, str] = os.environ) -> None:
    """Set oneCCL's variables for the first process group (see the module docstring)."""
    local_rank, local_size = _local_layout(store, rank, size, env)
    _set_default(env, "CCL_PROCESS_LAUNCHER", "none")
    _set_default(env, "CCL_ATL_TRANSPORT", "ofi")
    _set_default(env, "CCL_LOCAL_RANK", str(local_rank))
    _set_default(env, "CCL_LOCAL_SIZE", str(local_size))
    _set_default(env, "CCL_ATL_SHM", "1")
    if "CCL_WORKER_COUNT" not in env and "CCL_WORKER_AFFINITY" not in env:
        _set_default(env, "CCL_WORKER_OFFLOAD", "0")
    if local_size == size:
        _set_default(env, "CCL_KVS_IFACE", "lo")
    _set_default(env, "CCL_LOG_LEVEL", "error")
