"""Two hosts on one machine: network namespaces joined by a veth pair (scripts/netns.py), each
with a host name of its own, so every group that spans them runs on oneCCL over libfabric's
TCP provider, as between real nodes.

Each job starts plain processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as a launcher
gives them) running tests/scripts/across_hosts.py, which prints one line per check; one
launch serves several tests (the machine has two cores). Among them, what one host proves
for each transport: the collective matrix (matrix.py) and PyTorch's behaviour as gloo gives
it (vs_gloo.py), at 2 ranks (1 + 1, with and without oneCCL's worker) and 3 (2 + 1). Needs
root (required under CI=true).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import Lines, apt_install, communicate, free_port, popen, require
from matrix import cases
from test_launchers import BIN, ROOT
from vs_gloo import SCENARIOS

import netns  # scripts/, on the path through harness
from ddp_reference import one_process_parameters

SCRIPT = "tests/scripts/across_hosts.py"


def _namespaces(names=False):
    require(os.geteuid() == 0, "network namespaces need root")
    why = apt_install(("iproute2",), ("ip",))
    require(not why, why)
    require(shutil.which("unshare"), "network namespaces need unshare (util-linux)")
    try:
        with netns.hosts(names) as hosts:
            yield hosts
    except subprocess.CalledProcessError as e:
        require(False, f"cannot create network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")
    except OSError as e:
        require(False, f"cannot give network namespaces their /etc/hosts here: {e}")


@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces joined by a veth pair: 'hosts' of their own (scripts/netns.py)."""
    yield from _namespaces()


@pytest.fixture(scope="module")
def two_named_hosts():
    """As two_hosts, with host names resolved as Debian's and Ubuntu's /etc/hosts do: on each
    host its own name is 127.0.1.1, a loopback address; the other host's is its address."""
    yield from _namespaces(names=True)


def _user_env():
    """The environment without anything that steers oneCCL or the rendezvous: the package
    must choose the interface and find out the hosts itself."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "FI_", "MASTER_", "ONECCL_"))}


def _tx_bytes(ns, dev):
    out = subprocess.run(["ip", "-n", ns, "-s", "link", "show", dev], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return int(out.split("TX:")[1].split("\n")[1].split()[0])


def _start(hosts, per_host, checks, env=None):
    """The ranks of one job, per_host[k] of them on host k (lowest ranks on host 0); each
    process's output read as it comes."""
    world, port = sum(per_host), free_port()
    base = {**_user_env(), "MASTER_ADDR": hosts.addr[0], "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "CHECKS": checks, **(env or {})}
    ranks = [(r, 0 if r < per_host[0] else 1) for r in range(world)]
    # gloo (the reference of the "gloo" check) binds to the interface it is told: the host
    # names of the namespaces resolve to no address. The package is told nothing.
    return [Lines(popen(hosts.on(k, [sys.executable, SCRIPT]), cwd=ROOT,
                        env={**base, "RANK": str(r), "GLOO_SOCKET_IFNAME": hosts.dev[k]},
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for r, k in ranks]


def _finish(ranks, timeout, killed=()):
    """Every rank's output, by rank; kills all of them if one has not exited by the deadline.
    A rank that failed a check exits 1 (that check's test fails); one that crashed fails all."""
    deadline = time.monotonic() + timeout
    try:
        outs = [r.finish(max(0.1, deadline - time.monotonic())) for r in ranks]
    finally:
        for r in ranks:
            r.close()
    for rank, r in enumerate(ranks):
        assert rank in killed or r.proc.returncode in (0, 1), f"rank {rank} exited {r.proc.returncode}:\n{outs[rank]}"
    return outs


def _assert_checks_ok(outs, check, ranks=None):
    for rank in range(len(outs)) if ranks is None else ranks:
        assert f"rank {rank} check {check} ok" in outs[rank], f"rank {rank}:\n{outs[rank]}"


# ---- one rank on each host: DDP, async, the group timeout ----------------------------


# Each check twice: with the package's defaults (no oneCCL worker thread) and with one worker
# per rank (ONECCL_BIND_PT_WORKERS=1), the setting `auto` chooses where hosts have spare cores.
@pytest.fixture(scope="module", params=["default", "worker"])
def one_rank_on_each_of_two_hosts(two_hosts, request):
    """Both ranks' output after DDP training, the p2p and async checks, the collective matrix,
    the comparison with gloo and a timeout, the bytes host 0 sent over the link meanwhile, and
    whether a worker ran."""
    sent_before = _tx_bytes(two_hosts.ns[0], two_hosts.dev[0])
    worker = request.param == "worker"
    env = {"ONECCL_BIND_PT_WORKERS": "1"} if worker else {}
    outs = _finish(_start(two_hosts, (1, 1), "ddp,p2p,async,matrix,gloo,timeout", env=env), 300)
    for rank, out in enumerate(outs):
        assert f"rank {rank} workers {'1 1' if worker else '0 None'}\n" in out, out
    return outs, _tx_bytes(two_hosts.ns[0], two_hosts.dev[0]) - sent_before, worker


def test_ddp_across_two_hosts_matches_one_process_reference(one_rank_on_each_of_two_hosts):
    outs, _, _ = one_rank_on_each_of_two_hosts
    _assert_checks_ok(outs, "ddp")
    # Not another ccl run: one process training on both ranks' batches (the mean of their
    # losses: what DDP's averaged gradients compute). At lr 0.5 over 8 steps, rank 1's
    # gradient 10% too large moves a parameter by 2e-2; a right sum differs by 5e-11.
    want = one_process_parameters(2, lr=0.5, steps=8, seed_of_rank=lambda r: 100 + r)
    for rank, out in enumerate(outs):
        got = torch.tensor([float(v) for v in re.search(rf"rank {rank} parameters (.*)", out).group(1).split()],
                           dtype=torch.float64)
        assert torch.allclose(got, want, rtol=0, atol=1e-5), (
            f"rank {rank}: largest difference {(got - want).abs().max().item():.3g}\ngot  {got}\nwant {want}")


def test_async_p2p_and_futures_across_two_hosts(one_rank_on_each_of_two_hosts):
    outs, sent, _ = one_rank_on_each_of_two_hosts
    _assert_checks_ok(outs, "p2p")
    _assert_checks_ok(outs, "async")
    # The data crossed the veth link, over TCP: rank 0's isends alone are 192 KiB, its share
    # of the 256 KiB allreduce at least 128 KiB more.
    assert sent > 256 * 1024, sent


def _report(outs, what, rank):
    """The JSON a rank printed for the "matrix" or "gloo" check."""
    m = re.search(rf"^rank {rank} {what} (.*)$", outs[rank], re.M)
    assert m, f"rank {rank} printed no {what} report:\n{outs[rank][-4000:]}"
    return json.loads(m.group(1))


def _assert_reported_ok(outs, what, key):
    problems = {rank: _report(outs, what, rank)[key] for rank in range(len(outs))}
    assert not any(problems.values()), problems


def _matrix_and_gloo(world):
    """What one host proves of each transport, by item: every case of the collective matrix
    (tests/matrix.py: every op x reduce op x dtype, refusals included) and every scenario of
    tests/vs_gloo.py (PyTorch's behaviour, as a gloo group of the same processes gives it)."""
    return ([pytest.param("matrix", c.id, id=f"matrix-{c.id}") for c in cases(world)]
            + [pytest.param("gloo", name, id=f"gloo-{name}") for name in SCENARIOS])


# Over oneCCL between two hosts, with and without oneCCL's worker thread.
@pytest.mark.parametrize("what, key", _matrix_and_gloo(2))
def test_matrix_and_gloo_across_two_hosts(one_rank_on_each_of_two_hosts, what, key):
    _assert_reported_ok(one_rank_on_each_of_two_hosts[0], what, key)


def test_group_timeout_across_two_hosts_names_the_op(one_rank_on_each_of_two_hosts):
    outs, _, _ = one_rank_on_each_of_two_hosts
    _assert_checks_ok(outs, "timeout")
    m = re.search(r"rank 0 timed out after ([\d.]+) s: (.*)", outs[0])
    assert m, outs[0]
    waited, msg = float(m.group(1)), m.group(2)
    assert "allreduce" in msg and "did not complete within 3000 ms" in msg, msg
    # Raised at the timeout (3 s), not when the peer left (it stays until then).
    assert 2.5 < waited < 15, waited


# Rank 0's host name, which the other host resolves to its address, is 127.0.1.1 on rank 0's
# host (Debian's /etc/hosts): the route there towards "rank 0's host" is lo, which the other host
# cannot reach. Rank 0 must listen and send on the interface towards rank 1's host instead.
def test_a_master_addr_that_is_a_loopback_address_on_its_own_host(two_named_hosts):
    outs = _finish(_start(two_named_hosts, (1, 1), "world,ddp", env={"MASTER_ADDR": two_named_hosts.ns[0]}), 120)
    _assert_world(outs, (1, 1))
    _assert_checks_ok(outs, "ddp")


# ---- three ranks (2 + 1), then a dead peer; six ranks (3 + 3) --------------------------


def _assert_world(outs, per_host):
    world = sum(per_host)
    _assert_checks_ok(outs, "world")
    for rank, out in enumerate(outs):
        m = re.search(rf"rank {rank} of {world} on (\S+): hosts (\d), world path (\w+)", out)
        assert m, out
        assert m.group(2) == "2" and m.group(3) == "oneccl", m.group(0)
    hosts = [re.search(rf"rank {r} of {world} on (\S+):", out).group(1) for r, out in enumerate(outs)]
    assert [hosts.count(h) for h in dict.fromkeys(hosts)] == list(per_host), hosts


@pytest.fixture(scope="module")
def three_ranks_on_two_hosts(two_hosts, tmp_path_factory):
    """Ranks 0 and 1 on host 0, rank 2 on host 1: the world check, the matrix's 3-rank cases
    and the comparison with gloo, then rank 2 is SIGKILLed and the survivors run an allreduce
    (group timeout 5 s). Every rank's output."""
    killed = tmp_path_factory.mktemp("dead-peer") / "killed"
    ranks = _start(two_hosts, (2, 1), "world,matrix,gloo,dead-peer", env={"KILLED_FILE": str(killed)})
    pid = None
    try:
        ranks[2].wait_for("waits to be killed", timeout=300)
        pid = int(re.search(r"rank 2 pid (\d+) waits to be killed", ranks[2].text).group(1))
        os.kill(pid, signal.SIGKILL)  # same pid namespace: the namespaces split the network only
        ranks[2].proc.wait(60)
        killed.write_text("")
        return _finish(ranks, 120, killed=(2,)), ranks[2].proc.returncode
    finally:
        for r in ranks:
            r.close()
        if pid is not None:
            # Its libfabric segment (oneCCL's shared memory between the ranks of one host): on
            # a real host 1 nobody is left to remove it, the survivors being on host 0; here the
            # "hosts" share this machine's /dev/shm, which must not fill up run after run.
            for leftover in Path("/dev/shm").glob(f"{pid}:*"):
                leftover.unlink(missing_ok=True)


def test_three_ranks_on_two_hosts_2_plus_1(three_ranks_on_two_hosts):
    outs, _ = three_ranks_on_two_hosts
    _assert_world(outs, (2, 1))


@pytest.mark.parametrize("what, key", _matrix_and_gloo(3))
def test_matrix_and_gloo_on_three_ranks_across_two_hosts(three_ranks_on_two_hosts, what, key):
    _assert_reported_ok(three_ranks_on_two_hosts[0], what, key)


def test_dead_peer_on_the_other_host_makes_the_survivors_raise(three_ranks_on_two_hosts):
    outs, dead_rc = three_ranks_on_two_hosts
    assert dead_rc == -signal.SIGKILL, outs[2]
    _assert_checks_ok(outs, "dead-peer", ranks=(0, 1))
    for rank in (0, 1):
        m = re.search(rf"rank {rank} raised after ([\d.]+) s: (.*)", outs[rank])
        assert m, outs[rank]
        waited, msg = float(m.group(1)), m.group(2)
        assert "allreduce" in msg, msg
        assert waited < 15, f"rank {rank} raised after {waited} s; the group timeout is 5 s"


# On one host the shared-memory transport sees the peer's process exit and names it
# (test_reliability.py's killed-rank test). Over oneCCL the survivors only see the op time out;
# the roll call at the timeout (Communicator::roll_call) names the rank that did not time out too.
def test_dead_peer_on_the_other_host_is_named(three_ranks_on_two_hosts):
    outs, _ = three_ranks_on_two_hosts
    for rank in (0, 1):
        msg = re.search(rf"rank {rank} raised after [\d.]+ s: (.*)", outs[rank]).group(1)
        assert re.search(r"\brank 2\b", msg), msg


def test_six_ranks_on_two_hosts_3_plus_3(two_hosts):
    outs = _finish(_start(two_hosts, (3, 3), "world"), 240)
    _assert_world(outs, (3, 3))


# ---- torchrun on each host: subgroups within a host ------------------------------------


def _torchrun_on_hosts(hosts, port, nproc, script, timeout, args=(), master=None, host_env=None):
    """One torchrun agent per network namespace, rank 0's host reached at `master` (by default
    its address). With a master name, each agent gives its ranks its host's name as MASTER_ADDR
    (no --local_addr), as torchrun does by default. host_env: {k: variables for host k's agent}.
    Returns each host's output (all must exit 0)."""
    addr = hosts.addr
    procs = [
        popen(
            hosts.on(k, [BIN / "torchrun", "--nnodes", "2", "--nproc_per_node", str(nproc),
                         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{master or addr[0]}:{port}", "--rdzv_id", "hosts",
                         "--rdzv_conf", f"is_host={k == 0}", *([] if master else ["--local_addr", addr[k]]),
                         script, *args]),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**_user_env(), "GLOO_SOCKET_IFNAME": hosts.dev[k],  # for a gloo group beside ours
                 **(host_env or {}).get(k, {})},
        )
        for k in (0, 1)
    ]
    outs = communicate(procs, timeout)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


# "gloo-default": the first ccl group of each process is its host's, and the world's ccl group
# comes after it (oneCCL reads its variables once, for the first group).
@pytest.mark.parametrize("default", ["ccl", "gloo"], ids=["ccl-default", "gloo-default-host-groups-first"])
def test_subgroup_on_one_host_takes_shared_memory_inside_a_two_host_world(two_hosts, default):
    _check_host_subgroups(two_hosts, default)


# torchrun's default MASTER_ADDR is rank 0's host name, which leads to lo on that host (Debian's
# /etc/hosts). The first ccl group lies within a host: no rank of it knows an address on the
# other host, so rank 0's host takes the default route's interface, else the first not loopback
# (these namespaces have no default route).
def test_host_groups_first_where_rank_0s_host_name_is_a_loopback_address_there(two_named_hosts):
    _check_host_subgroups(two_named_hosts, "gloo", master=two_named_hosts.ns[0])


# A user's setting sends one host's libfabric traffic over lo: the world's ccl group, made after
# each host's, fails in oneCCL's first send. Every rank raises and exits. Before, a failed rank's
# oneCCL key-value store waited for rank 0's answer for good as it was freed (a hang), and freeing
# the host's group after the failure crashed the process at exit (SIGSEGV in oneCCL's teardown).
@pytest.mark.parametrize("bad", [0, 1], ids=["on-rank-0s-host", "on-the-other-host"])
def test_a_group_that_fails_in_oneccl_raises_on_every_rank_without_a_crash_or_hang(two_hosts, bad):
    outs = _torchrun_on_hosts(two_hosts, free_port(), 2, "tests/scripts/host_subgroups.py", timeout=240,
                              args=["gloo", "world-fails"], host_env={bad: {"FI_TCP_IFACE": "lo"}})
    # Ranks run with python -u: a line and its newline are two writes, so two ranks' lines may
    # run together; each ends where the next begins.
    raised = re.findall(r"rank (\d) world group raised: (.*?)(?=rank \d world group raised: |\n|$)", "".join(outs))
    assert sorted(r for r, _ in raised) == ["0", "1", "2", "3"], outs
    for rank, said in raised:
        assert said.startswith(f"ccl: creating the oneCCL communicator (rank {rank} of 4)"), (rank, said)


def _check_host_subgroups(hosts, default, master=None):
    ns, dev = hosts.ns, hosts.dev
    port = free_port()
    sent_before = _tx_bytes(ns[0], dev[0])
    outs = _torchrun_on_hosts(hosts, port, 2, "tests/scripts/host_subgroups.py", timeout=240, args=[default],
                              master=master)
    # Ranks share a pipe, so a line may run into the next rank's: match each value exactly
    # (\S+ here once swallowed "n/arank 1 ...", losing rank 1's line).
    lines = re.findall(r"rank (\d) world_path=(\w+) local_path=(\w+) ok=(True|False) any_source_refused=(yes|no|n/a|other)",
                       "".join(outs))
    assert sorted(r for r, *_ in lines) == ["0", "1", "2", "3"], outs
    for rank, world_path, local_path, ok, refused in lines:
        assert (world_path, local_path, ok) == ("oneccl", "shm", "True"), (rank, outs)
        assert refused == ("yes" if rank == "0" else "n/a"), (rank, outs)
    # The world's allreduces crossed the link; the subgroups' did not need it.
    assert _tx_bytes(ns[0], dev[0]) - sent_before > 256 * 1024


# ---- the benchmark across hosts ----------------------------------------------------------


# two_hosts for its checks only (root, iproute2): the script makes hosts of its own.
def test_bench_hosts_script_at_a_tiny_size(two_hosts, tmp_path):
    # 2x2: four ranks placed alternately, so sendrecv's pair (ranks 0 and 1) spans the hosts.
    report = tmp_path / "bench.json"
    proc = popen([sys.executable, "scripts/bench_hosts.py", "--layouts", "2x2", "--ops", "allreduce,sendrecv",
                  "--min-bytes", "4K", "--max-bytes", "4K", "--seconds", "0.01", "--rounds", "1", "--json", report],
                 cwd=ROOT, env=_user_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = communicate([proc], 180)
    assert proc.returncode == 0, out
    points = json.loads(report.read_text())["layouts"]["2x2"]
    assert sorted((p["op"], p["backend"], p["bytes"]) for p in points) == [
        ("allreduce", "ccl", 4096), ("allreduce", "gloo", 4096), ("sendrecv", "ccl", 4096), ("sendrecv", "gloo", 4096)]
    assert all(p["correct"] and p["median_us"] > 0 for p in points), points
    assert "2x2 gloo/ccl" in out, out  # the table's header
