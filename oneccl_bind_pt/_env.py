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
                           this host and has our       through shared memory, not sockets.
                           shared-memory transport     On one host our own transport
                           on, else ``1`` (the ranks   carries every collective and p2p
                           tell each other through     (oneCCL's leaves a 64 MiB file per
                           the Store: oneCCL needs     rank in /dev/shm whenever a rank is
                           it alike on all of them);   killed); across hosts, or with
                           ``0`` too where that group  ONECCL_BIND_PT_SHM=0 on any rank,
                           is one host's of a job      oneCCL's is used. oneCCL sets its own
                           across hosts                up at its first communicator: one
                                                       within a host made a later one
                                                       across hosts hang in its creation.
FI_SHM_DISABLE_CMA         ``1``                       libfabric's shared-memory provider
                                                       (oneCCL's, with CCL_ATL_SHM=1) then
                                                       copies through its shared buffers,
                                                       not cross-memory attach: a message
                                                       larger than the receive it meets
                                                       (ranks that called different
                                                       collectives) made that copy loop
                                                       for good, past any timeout. Not
                                                       slower here (docs/performance.md).
CCL_WORKER_OFFLOAD         ``0``, unless               oneCCL's worker thread busy-polls
                           ONECCL_BIND_PT_WORKERS      while an op is under way; where a
                           asks for workers (then      rank has no spare core that makes
                           also CCL_WORKER_COUNT and   each op ~8 ms. With 0 an op
                           CCL_WORKER_AFFINITY,        progresses in the thread that waits
                           worker_plan)                for it (or our background thread
                                                       for Futures). Workers stay off
                                                       unless asked: on one host our
                                                       transport carries the ops, and
                                                       across hosts their gain is not
                                                       measured yet.
CCL_KVS_IFACE              ``lo`` when every rank is   oneCCL's bootstrap listener binds
                           on this host (the job's,    the interface the job uses, not the
                           where the launcher says:    first NIC it finds (nor all of them),
                           a first group within one    and libfabric's TCP traffic goes over
                           host of a job across hosts  the same one. oneCCL reads it once,
                           gets the NIC), else the NIC for every group after the first.
                           that routes to rank 0's
                           host (MASTER_ADDR; where
                           that is lo, on rank 0's
                           host when its name is
                           127.0.1.1 there, the NIC
                           towards the other hosts)
FI_TCP_IFACE               the same NIC, across hosts
CCL_PMI_FORCE_FINALIZE     ``1``                       A rank's teardown of its communicator
                                                       no longer removes its keys from rank
                                                       0's key-value store (which goes with
                                                       the group anyway). A rank 0 that
                                                       exited meanwhile made that removal
                                                       fail inside a destructor, which
                                                       aborted the process. oneCCL skips it
                                                       whenever the variable is set, to
                                                       any value.
CCL_LOG_LEVEL              ``error``                   oneCCL warns about every variable
                                                       above at startup (and at each
                                                       teardown, for the one above); errors
                                                       still show.
TORCH_INCLUDE_STACK_TRACE  ``0``                       torch 2.15 dumps its flight recorder
                                                       when a ccl op fails. Symbolizing
                                                       every entry's stack took over 15 s
                                                       on a loaded machine; torch then
                                                       abandons the dump's thread, which
                                                       crashed the exiting process (SIGSEGV
                                                       in torch::symbolize). The dump keeps
                                                       every collective; 1 adds the stacks.
=========================  ==========================  =====================================

If CCL_WORKER_COUNT, CCL_WORKER_AFFINITY or CCL_WORKER_OFFLOAD is set, we leave
all three alone: the user is managing oneCCL's worker threads (the classic
torch-ccl tuning on large hosts).

Launcher mapping (RANK, WORLD_SIZE, ... from srun, mpirun, ...) lives in
_launchers.py.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
import time
from collections.abc import Callable, MutableMapping
from datetime import timedelta

# Variables this module set, and the value: `doctor` shows them as ours.
applied: dict[str, str] = {}
# Why this process has the oneCCL worker threads it has (worker_plan), for `doctor`.
workers_why = ""

WORKER_VARS = ("CCL_WORKER_COUNT", "CCL_WORKER_AFFINITY", "CCL_WORKER_OFFLOAD")
# oneCCL's own default is 1 worker. The one many-core figure (a 16-core Xeon, 4 ranks of 4
# cores, allgather 16 MiB: 1,583 us with 2 workers, 2,692 without) is with 2.
MAX_WORKERS = 2
MAX_WORKERS_ASKED = 64

# What the package set, as JSON {name: value}, in this process's environment and so in its
# children's: a process started from one that made a ccl group (a notebook that then runs
# torchrun or mp.spawn) inherits CCL_LOCAL_RANK, CCL_KVS_IFACE, ... that were right for that
# group, not its own. A variable still holding the value recorded here is the package's, and is
# set afresh; one the user changed since is the user's.
MARK = "ONECCL_BIND_PT_SET"


def _inherited(env: MutableMapping[str, str]) -> dict[str, str]:
    try:
        marked = json.loads(env.get(MARK, "{}"))
    except ValueError:
        return {}
    return marked if isinstance(marked, dict) else {}


def set_by_user(env: MutableMapping[str, str], name: str) -> bool:
    """Whether `name` is set, by the user rather than by this package (here or in a parent)."""
    return name in env and _inherited(env).get(name) != env[name]


def _set_default(env: MutableMapping[str, str], name: str, value: str) -> None:
    if not set_by_user(env, name):
        env[name] = value
        applied[name] = value
        env[MARK] = json.dumps({**_inherited(env), name: value}, sort_keys=True)


# The backend's failure key for a group's first creation (rendezvous.cpp): set when a rank
# announced that it cannot create its side of the group.
_FAILED_KEY = "oneccl/failed"


def _rendezvous_error(text: str, announce: str | None = None):
    import torch.distributed as dist

    error = dist.DistBackendError("ccl rendezvous: " + text)
    error.announce = announce  # what the other ranks are told, if not str(error)
    return error


def _look_every(size: int) -> float:
    """The longest pause between two looks at the store while the first group's ranks come: 50 ms,
    longer for groups over 64 ranks (every rank looks, and rank 0's store serves them all)."""
    return 0.05 * max(1.0, size / 64)


# This process's answers in its first group's exchanges (name -> value), and what it would have
# answered in the ones that group did not hold: a later group may be another rank's first, and
# that rank waits for every rank's answers (post_answers).
_answers: dict[str, str] = {}


def post_answers(store, rank: int) -> None:
    """For a group this process makes after its first: its answers in the defaults' exchanges,
    for the ranks whose first ccl group it is (a gloo default group, then ccl groups that differ
    between ranks). Only those ranks wait for them; this one goes on at once."""
    if not _answers:
        return
    keys = [f"oneccl/defaults/{name}/{rank}" for name in _answers]
    values = list(_answers.values())
    if hasattr(store, "multi_set"):
        store.multi_set(keys, values)
    else:
        for key, value in zip(keys, values):
            store.set(key, value)


def _exchange(store, rank: int, size: int, name: str, mine: str, timeout: timedelta) -> list[str]:
    """Every rank's `mine`, by rank, through the store. Waits at most `timeout` (the group's), and
    less when a rank announces that it cannot create the group. For the first group only."""
    keys = [f"oneccl/defaults/{name}/{r}" for r in range(size)]
    store.set(keys[rank], mine)
    _answers[name] = mine
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 0.001
    while True:
        # Looked at, not waited for: a rank that failed before it came here is seen at the next
        # look, and a wait that runs out has torch's store client log two warnings each time
        # (ranks a torchrun starts come seconds apart under load). Two requests a look, whatever
        # the group's size: rank 0's store serves every rank's.
        if store.check(keys):
            return [value.decode() for value in store.multi_get(keys)]
        if store.check([_FAILED_KEY]):
            raise _rendezvous_error(
                f"{store.get(_FAILED_KEY).decode()} (rank {rank} gives up on this process group with it)")
        left = deadline - time.monotonic()
        if left <= 0:
            missing = ", ".join(str(r) for r, key in enumerate(keys) if not store.check([key])) or "none"
            seconds = f"{timeout.total_seconds():.1f}"
            raise _rendezvous_error(
                f"rank {rank} waited {seconds} s for the other ranks of this process group (size {size}); missing "
                f"ranks: {missing}. Every rank must create the group (init_process_group / new_group) and none may "
                "have exited.", announce=f"it waited {seconds} s for the other ranks; missing ranks: {missing}")
        time.sleep(min(pause, left))
        pause = min(2 * pause, _look_every(size))


def host_identity() -> str:
    """What tells hosts apart, as the backend's shared memory reads it (src/shm.cpp): the boot,
    the PID and network namespaces, and the host name. A name alone is not enough: cloned VMs
    left as `localhost`, containers started with one --hostname, network-namespace hosts."""
    def first_line(path):
        try:
            with open(path) as f:
                return f.readline().strip()
        except OSError:
            return ""

    def link(path):
        try:
            return os.readlink(path)
        except OSError:
            return ""

    return "|".join((first_line("/proc/sys/kernel/random/boot_id"), link("/proc/self/ns/pid"),
                     link("/proc/self/ns/net"), socket.gethostname()))


def _job_layout(env: MutableMapping[str, str]) -> tuple[int, int, int | None] | None:
    """(local rank, ranks on this host, ranks in the job) as a launcher told them (WORLD_SIZE may
    be missing: None), or None."""
    for rank_var, size_var in (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
        if rank_var in env and size_var in env:
            world = env.get("WORLD_SIZE")
            return int(env[rank_var]), int(env[size_var]), int(world) if world else None
    return None


def _local_layout(store, rank: int, size: int, env: MutableMapping[str, str], timeout: timedelta,
                  shm: str) -> tuple[int, int, list[str] | None]:
    """This rank's index among the ranks on its host, how many there are, and every rank's `shm`
    ("1": our shared memory on) where the ranks had to be asked (else None)."""
    job = _job_layout(env)
    if job and job[2] in (None, size):
        return job[0], job[1], None
    # No launcher told us (mp.spawn, hand-written scripts): compare hosts, and say whether
    # shared memory is on in the same round.
    host = host_identity()
    answers = [a.split(" ", 1) for a in _exchange(store, rank, size, "host", f"{shm} {host}", timeout)]
    mine = [r for r, (_, h) in enumerate(answers) if h == host]
    return mine.index(rank), len(mine), [flag for flag, _ in answers]


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


# How long a rank on rank 0's host whose route there is loopback waits for another rank's
# address (the group's ranks create it together; a few seconds cover their arrival).
_PEER_ROUTE_WAIT_S = 10.0


def _route_towards(host: str) -> tuple[str, str | None] | None:
    """(this host's address, its interface) that the kernel would use to reach `host`."""
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # a UDP connect only picks the route; nothing is sent
            local = s.getsockname()[0]
    except OSError:
        return None
    return local, next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == local), None)


def interface_towards(host: str) -> str | None:
    """The local network interface the kernel would use to reach `host`."""
    route = _route_towards(host)
    return route[1] if route else None


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def _interface_across_hosts(store, rank: int, size: int, env: MutableMapping[str, str],
                            timeout: timedelta) -> str | None:
    """The interface towards rank 0's host, for a first group that spans hosts (or whose job does).
    On rank 0's host its name may resolve to a loopback address (Debian's /etc/hosts gives a
    host's own name 127.0.1.1), and the route towards it is `lo`, which the other hosts cannot
    reach: there the interface is the one towards a rank on another host, from the addresses the
    group's ranks reach rank 0's host from (each rank leaves its own in the store; only a rank
    whose route is loopback waits, briefly, for another's: ranks whose first ccl group is another
    one never come here). Failing that (a first group within rank 0's host), the interface of the
    default route, else the first with an address that is not loopback (about oneCCL's own
    choice, the first not named lo; left unset, libfabric's choice made the later group across
    hosts fail in its first send)."""
    host = _master_host(store, env)
    route = _route_towards(host) if host else None
    keys = [f"oneccl/defaults/route/{r}" for r in range(size)]
    store.set(keys[rank], route[0] if route else "")
    _answers["route"] = route[0] if route else ""
    if route is None or not _loopback(route[0]):
        return route[1] if route else None
    others: list[str] = []
    deadline = time.monotonic() + min(timeout.total_seconds(), _PEER_ROUTE_WAIT_S)
    pause = 0.001
    present: list[str] = []
    while True:
        new = [key for key in keys if key not in present and store.check([key])]
        present += new
        others += [a for a in (store.get(key).decode() for key in new) if a and not _loopback(a)]
        left = deadline - time.monotonic()
        if others or len(present) == size or left <= 0:
            break
        time.sleep(min(pause, left))  # looked at, not waited for (see _exchange)
        pause = min(2 * pause, _look_every(size))
    for destination in others + ["192.0.2.1"]:  # a documentation address: the default route
        peer = _route_towards(destination)
        if peer and not _loopback(peer[0]) and peer[1]:
            return peer[1]
    for _, name in socket.if_nameindex():
        address = _ipv4_of(name)
        if address and not _loopback(address):
            return name
    return None


def _master_host(store, env: MutableMapping[str, str]) -> str | None:
    while store is not None:  # PrefixStores wrap the TCPStore that knows rank 0's host
        if getattr(store, "host", None):
            return store.host
        store = getattr(store, "underlying_store", None)
    return env.get("MASTER_ADDR")


def core_of(cpu: int) -> tuple[int, int]:
    """(package, core) of a logical CPU, from sysfs; (0, cpu) where that is not readable."""
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    try:
        with open(topology + "physical_package_id") as package, open(topology + "core_id") as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return 0, cpu


def _workers_asked(env: MutableMapping[str, str]) -> int | str | None:
    asked = env.get("ONECCL_BIND_PT_WORKERS", "")
    if not asked or asked == "auto":
        return asked or None
    if not asked.isdigit() or int(asked) > MAX_WORKERS_ASKED:
        raise ValueError(f"ONECCL_BIND_PT_WORKERS={asked} is not auto or a whole number from 0 to {MAX_WORKERS_ASKED}")
    return int(asked)


# Why workers are off unless asked for (docs/multi-node.md, "oneCCL's worker threads").
OFF_BY_DEFAULT = ("off unless asked: each busy-polls a core while an op is under way, and across hosts their gain "
                  "is not measured yet; ONECCL_BIND_PT_WORKERS=auto chooses by the cores, =N sets the count")


def worker_plan(env: MutableMapping[str, str], *, local_rank: int, local_size: int, oneccl_carries: bool,
                cores: int, pinned: bool, torch_threads: int, cpus: list[int],
                core_of=core_of) -> tuple[int, list[int], str]:
    """oneCCL worker threads for this rank: (count, the CPUs they run on, why).

    None unless ONECCL_BIND_PT_WORKERS asks (OFF_BY_DEFAULT says why). With `auto`: none where
    our shared memory carries the collectives (oneCCL has nothing to progress) and none where
    the rank's cores (`cores`, from _C.rank_cores) less torch's intra-op threads leave fewer
    than 2: a worker busy-polls while an op is under way, and so does the thread that waits
    for it; otherwise 1 worker, 2 from 3 spare cores. With a number, that many. They go on
    distinct physical cores (`core_of`: SMT siblings count as one), the last ones of the rank's
    own: its block of the host's (or of a set the ranks share) cores by local rank, or, when a
    launcher pinned it (`pinned`), its own CPUs, taken further from the end for each local rank
    before it, so that ranks given one set that reads as pinned (ranks not one launcher's
    children, so not seen sharing it) do not share workers' cores.
    """
    asked = _workers_asked(env)
    spare = cores - torch_threads
    if asked is None:
        count, why = 0, OFF_BY_DEFAULT
    elif asked != "auto":
        count, why = asked, "ONECCL_BIND_PT_WORKERS"
    elif not oneccl_carries:
        count, why = 0, "auto: every rank is on this host: our shared memory carries the collectives"
    else:
        count = 0 if spare < 2 else min(MAX_WORKERS, spare - 1)
        why = (f"auto: {cores} core{'s' * (cores != 1)} for this rank less {torch_threads} torch "
               f"thread{'s' * (torch_threads != 1)}: {max(spare, 0)} spare; 1 worker from 2 spare, "
               f"{MAX_WORKERS} from 3")
    if count == 0:
        return 0, [], why
    siblings: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus, key=lambda c: (*core_of(c), c)):
        siblings.setdefault(core_of(cpu), []).append(cpu)
    physical = list(siblings.values())  # each core's logical CPUs, cores in order
    skip = 0
    if pinned:
        skip = local_rank * count if (local_rank + 1) * count < len(physical) else 0
    elif local_size > 1:
        per = max(1, len(physical) // local_size)
        physical = physical[local_rank * per:(local_rank + 1) * per] or physical[-per:]
    end = len(physical) - skip
    # One CPU (the first thread) of each of the last cores; cycled when a forced count is
    # larger than the cores there are.
    return count, [physical[(end - count + i) % len(physical)][0] for i in range(count)], why


def _apply_worker_defaults(env: MutableMapping[str, str], oneccl_carries: bool,
                           agree: Callable[[int], int] | None = None) -> None:
    """`agree`: the group's count from this rank's (every rank calls it once, with `auto`)."""
    global workers_why
    asked = _workers_asked(env)  # a bad value fails the group whoever manages the workers
    if any(set_by_user(env, v) for v in WORKER_VARS):
        workers_why = "CCL_WORKER_* set by you"
        return
    import torch

    from . import _C

    # The local layout oneCCL will read (the user's CCL_LOCAL_* if set).
    local_rank, local_size = int(env["CCL_LOCAL_RANK"]), int(env["CCL_LOCAL_SIZE"])
    cores, pinned, cores_why, _ = _C.rank_cores(local_size)
    count, cpus, why = worker_plan(env, local_rank=local_rank, local_size=local_size, oneccl_carries=oneccl_carries,
                                   cores=cores, pinned=pinned, torch_threads=max(1, torch.get_num_threads()),
                                   cpus=list(os.sched_getaffinity(0)))
    workers_why = f"{why}; cores: {cores_why}" if env.get("ONECCL_BIND_PT_WORKERS") == "auto" and oneccl_carries else why
    if asked == "auto" and oneccl_carries and agree is not None:  # (the same on every rank of the group)
        # oneCCL splits a collective into one part per worker on every rank: ranks with different
        # counts would exchange parts that do not match. The fewest of any rank, for all.
        group = agree(count)
        if group < count:
            count, cpus = group, cpus[:group]
            workers_why += f"; {group}: the fewest of any rank (oneCCL needs one count on every rank)"
    if count == 0:
        _set_default(env, "CCL_WORKER_OFFLOAD", "0")
        return
    _set_default(env, "CCL_WORKER_OFFLOAD", "1")
    _set_default(env, "CCL_WORKER_COUNT", str(count))
    # oneCCL reads one list for every rank of the host, each taking `count` entries at its
    # local rank's offset: this rank's CPUs in its own slice (the other slices are not read here).
    _set_default(env, "CCL_WORKER_AFFINITY", ",".join(map(str, cpus * local_size)))


def apply_ccl_defaults(store, rank: int, size: int, env: MutableMapping[str, str] = os.environ,
                       timeout: timedelta | None = None) -> None:
    """Set oneCCL's variables for the first process group (see the module docstring). `timeout`:
    the group's (by default the store's), for the exchanges with the other ranks."""
    timeout = timeout or store.timeout
    _answers.clear()  # a failed try's answers do not stand
    # Left by a parent that made a ccl group: every value still as it set it goes, and is set
    # afresh below for this process's group (or not at all, as CCL_WORKER_COUNT may not be).
    for name in [n for n in _inherited(env) if n in env and not set_by_user(env, n)]:
        del env[name]
    env.pop(MARK, None)
    ours = env.get("ONECCL_BIND_PT_SHM", "1").lower() not in ("0", "off", "false")
    local_rank, local_size, flags = _local_layout(store, rank, size, env, timeout, "1" if ours else "0")
    # oneCCL reads its variables once, for this first group; later groups get the same. A first
    # group within one host (gloo's default group, then a ccl group per host) must not leave a
    # later group across hosts with CCL_KVS_IFACE=lo: where the launcher says the job spans
    # hosts, it is treated as spanning them, and this host's ranks are the job's.
    job = _job_layout(env)
    job_spans_hosts = bool(job and job[2] is not None and job[2] > job[1])
    group_on_one_host = local_size == size
    if job_spans_hosts:
        local_rank, local_size = job[0], job[1]
    one_host = group_on_one_host and not job_spans_hosts
    _set_default(env, "CCL_PROCESS_LAUNCHER", "none")
    _set_default(env, "CCL_ATL_TRANSPORT", "ofi")
    _set_default(env, "CCL_LOCAL_RANK", str(local_rank))
    _set_default(env, "CCL_LOCAL_SIZE", str(local_size))
    if one_host:
        # Our transport carries a group only where every rank has it on (shm.cpp); oneCCL's
        # shared memory must then be on for all of them alike, or their communicator cannot
        # connect (rendezvous.cpp refuses the group). Across hosts it is on everywhere anyway.
        if flags is None:
            flags = _exchange(store, rank, size, "shm", "1" if ours else "0", timeout)
        ours = "0" not in flags
    # oneCCL's shared memory (its own, beside libfabric's TCP) is chosen once, at its first
    # communicator, from that one's ranks: measured, a first one within a host made a later one
    # across hosts hang in its creation. So it is on only where this first group spans hosts.
    _set_default(env, "CCL_ATL_SHM", "0" if group_on_one_host and (ours or job_spans_hosts) else "1")
    _set_default(env, "FI_SHM_DISABLE_CMA", "1")
    _apply_worker_defaults(env, oneccl_carries=not (ours and one_host),
                           agree=lambda count: min(int(c) for c in _exchange(store, rank, size, "workers", str(count),
                                                                              timeout)))
    if one_host:
        _set_default(env, "CCL_KVS_IFACE", "lo")
    else:
        interface = _interface_across_hosts(store, rank, size, env, timeout)
        if interface:
            _set_default(env, "CCL_KVS_IFACE", interface)
            _set_default(env, "FI_TCP_IFACE", interface)
    # What this rank would answer in the exchanges its first group did not hold (see _answers).
    shm_flag = "1" if env.get("ONECCL_BIND_PT_SHM", "1").lower() not in ("0", "off", "false") else "0"
    _answers.setdefault("host", f"{shm_flag} {host_identity()}")
    _answers.setdefault("shm", shm_flag)
    _answers["workers"] = env.get("CCL_WORKER_COUNT", "0")  # the count it runs with: after the group's agreement
    if "route" not in _answers:
        host = _master_host(store, env)
        route = _route_towards(host) if host else None
        _answers["route"] = route[0] if route else ""
    _set_default(env, "CCL_PMI_FORCE_FINALIZE", "1")
    _set_default(env, "CCL_LOG_LEVEL", "error")
    _set_default(env, "TORCH_INCLUDE_STACK_TRACE", "0")
