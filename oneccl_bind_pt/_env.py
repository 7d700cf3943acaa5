"""oneCCL defaults.

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
CCL_ATL_SHM                ``0`` when every rank is on  Ranks on one host exchange data
                           this host and our shared-   through shared memory, not sockets.
                           memory transport is on,     On one host our own transport
                           else ``1``                  carries every collective and p2p
                                                       (oneCCL's leaves a 64 MiB file per
                                                       rank in /dev/shm whenever a rank is
                                                       killed); across hosts, or with
                                                       ONECCL_BIND_PT_SHM=0, oneCCL's is
                                                       used.
FI_SHM_DISABLE_CMA         ``1``                       libfabric's shared-memory provider
                                                       (oneCCL's, with CCL_ATL_SHM=1) then
                                                       copies through its shared buffers,
                                                       not cross-memory attach: a message
                                                       larger than the receive it meets
                                                       (ranks that called different
                                                       collectives) made that copy loop
                                                       for good, past any timeout. Not
                                                       slower here (docs/performance.md).
CCL_WORKER_OFFLOAD         ``0``                       oneCCL's default worker thread
                                                       busy-polls beside every rank; on
                                                       hosts with fewer spare cores than
                                                       ranks it makes each op ~8 ms. With
                                                       0 the op progresses in the thread
                                                       that waits for it (or in our
                                                       background thread for Futures).
CCL_KVS_IFACE              ``lo`` when every rank is   oneCCL's bootstrap listener binds
                           on this host, else the NIC  the interface the job uses, not the
                           that routes to rank 0's     first NIC it finds (nor all of them),
                           host (MASTER_ADDR)          and libfabric's TCP traffic goes over
FI_TCP_IFACE               the same NIC, across hosts  the same one.
CCL_LOG_LEVEL              ``error``                   oneCCL warns about every variable
                                                       above at startup; errors still show.
TORCH_INCLUDE_STACK_TRACE  ``0``                       torch 2.15 dumps its flight recorder
                                                       when a ccl op fails. Symbolizing
                                                       every entry's stack took over 15 s
                                                       on a loaded machine; torch then
                                                       abandons the dump's thread, which
                                                       crashed the exiting process (SIGSEGV
                                                       in torch::symbolize). The dump keeps
                                                       every collective; 1 adds the stacks.
=========================  ==========================  =====================================

If CCL_WORKER_COUNT or CCL_WORKER_AFFINITY is set, we leave CCL_WORKER_OFFLOAD
alone: the user is managing oneCCL's worker threads (the classic torch-ccl
tuning on large hosts).

Launcher mapping (RANK, WORLD_SIZE, ... from srun, mpirun, ...) lives in
_launchers.py.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import MutableMapping

# Variables this module set, and the value: `doctor` shows them as ours.
applied: dict[str, str] = {}

def _set_default(env: MutableMapping[str, str], name: str, value: str) -> None:
    if name not in env:
        env[name] = value
        applied[name] = value


def _local_layout(store, rank: int, size: int, env: MutableMapping[str, str]) -> tuple[int, int]:
    """This rank's index among the ranks on its host, and how many there are."""
    for rank_var, size_var in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if rank_var in env and size_var in env and int(env.get("WORLD_SIZE", size)) == size:
            return int(env[rank_var]), int(env[size_var])
    # No launcher told us (mp.spawn, hand-written scripts): compare host names.
    host = socket.gethostname()
    keys = [f"oneccl/host/{r}" for r in range(size)]
    store.set(keys[rank], host)
    try:
        store.wait(keys)
    except RuntimeError:  # the store's timeout: say who never came
        import torch.distributed as dist

        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise dist.DistBackendError(
            f"ccl rendezvous: rank {rank} waited {store.timeout.total_seconds():.1f} s for the other ranks "
            f"of this process group (size {size}); missing ranks: {', '.join(map(str, missing)) or 'none'}. "
            "Every rank must create the group (init_process_group / new_group) and none may have exited."
        ) from None
    hosts = [store.get(key).decode() for key in keys]
    mine = [r for r, h in enumerate(hosts) if h == host]
    return mine.index(rank), len(mine)


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The local network interface the kernel would use to reach `host`."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # a UDP connect only picks the route; nothing is sent
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return None


def _master_host(store, env: MutableMapping[str, str]) -> str | None:
    while store is not None:  # PrefixStores wrap the TCPStore that knows rank 0's host
        if getattr(store, "host", None):
            return store.host
        store = getattr(store, "underlying_store", None)
    return env.get("MASTER_ADDR")


def apply_ccl_defaults(store, rank: int, size: int, env: MutableMapping[str, str] = os.environ) -> None:
    """Set oneCCL's variables for the first process group (see the module docstring)."""
    local_rank, local_size = _local_layout(store, rank, size, env)
    _set_default(env, "CCL_PROCESS_LAUNCHER", "none")
    _set_default(env, "CCL_ATL_TRANSPORT", "ofi")
    _set_default(env, "CCL_LOCAL_RANK", str(local_rank))
    _set_default(env, "CCL_LOCAL_SIZE", str(local_size))
    ours = env.get("ONECCL_BIND_PT_SHM", "1").lower() not in ("0", "off", "false")
    _set_default(env, "CCL_ATL_SHM", "0" if ours and local_size == size else "1")
    _set_default(env, "FI_SHM_DISABLE_CMA", "1")
    if "CCL_WORKER_COUNT" not in env and "CCL_WORKER_AFFINITY" not in env:
        _set_default(env, "CCL_WORKER_OFFLOAD", "0")
    if local_size == size:
        _set_default(env, "CCL_KVS_IFACE", "lo")
    else:
        host = _master_host(store, env)
        interface = interface_towards(host) if host else None
        if interface:
            _set_default(env, "CCL_KVS_IFACE", interface)
            _set_default(env, "FI_TCP_IFACE", interface)
    _set_default(env, "CCL_LOG_LEVEL", "error")
    _set_default(env, "TORCH_INCLUDE_STACK_TRACE", "0")
