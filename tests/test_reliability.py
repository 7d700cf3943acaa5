"""Faults, leaks, concurrency, long runs, and two hosts (network namespaces)."""

import ctypes
import os
import random
import re
import shutil
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from harness import all_gather_single, apt_install, communicate, popen, reduce_scatter_single, require, run_ranks
from test_launchers import BIN, ROOT, free_port, run

sys.path.insert(0, str(ROOT / "scripts"))
import netns  # noqa: E402


def _usage():
    statm = open("/proc/self/statm").read().split()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "rss_kb": int(statm[1]) * os.sysconf("SC_PAGE_SIZE") // 1024,
    }


def _trimmed_usage():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS shows leaks only
    return _usage()


# ---- a rank dies, never comes, or leaves work behind ----------------------------------


# Time limits below are the subprocess timeouts (a hang fails, and its ranks are killed);
# how soon a survivor raises is judged from its own clock, around the collective alone.


def _two_processes(script, *args, env=None, timeout=120):
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", **(env or {})}
    procs = [
        popen([sys.executable, script, *args], cwd=ROOT, env={**base, "RANK": str(r), "LOCAL_RANK": str(r),
              "LOCAL_WORLD_SIZE": "2"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    outs = communicate(procs, timeout)
    return [(out, p.returncode) for out, p in zip(outs, procs)]


def test_killed_rank_makes_the_survivor_raise_within_the_timeout():
    (out0, rc0), (_, rc1) = _two_processes("tests/scripts/rank_dies.py", env={"PG_TIMEOUT": "5"})
    assert rc1 == -9
    assert rc0 == 3, out0  # raised DistBackendError, destroyed the group, exited on its own
    m = re.search(r"rank 0 raised after ([\d.]+) s: .*allreduce", out0)
    assert m and float(m.group(1)) <= 10, out0


def test_torchrun_tears_the_job_down_when_a_rank_is_killed():
    p = popen([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "tests/scripts/rank_dies.py"],
              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
              env={**os.environ, "PG_TIMEOUT": "5"})
    (out,) = communicate([p], 180)
    assert p.returncode != 0, out
    assert "SIGKILL" in out, out


def test_missing_rank_is_named_at_rendezvous(tmp_path):
    p = popen([sys.executable, "tests/scripts/lonely_rank.py", tmp_path / "store"], cwd=ROOT,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (out,) = communicate([p], 120)
    assert p.returncode == 3, out
    assert "missing ranks: 1" in out, out


def _destroy_with_work_in_flight(rank, world):
    t = torch.ones(1 << 18)
    works = [dist.all_reduce(t, async_op=True) for _ in range(5)]
    dist.destroy_process_group()  # nobody waited: must neither hang nor crash
    del works
    # A new group in the same process works.
    dist.init_process_group("ccl", init_method=f"file://{os.environ['SECOND_STORE']}", rank=rank, world_size=world)
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [3.0] * 4
    return True


def test_destroy_with_work_in_flight_then_start_again(tmp_path):
    assert all(run_ranks(_destroy_with_work_in_flight, 2, env={"SECOND_STORE": str(tmp_path / "second")}))


# ---- many groups, threads, long runs ------------------------------------------------


def _many_groups(rank, world):
    t = torch.ones(1000)
    for i in range(55):
        g = dist.new_group(list(range(world)))
        dist.all_reduce(t, group=g)
        dist.destroy_process_group(g)
        if i == 4:
            before = _trimmed_usage()
    after = _trimmed_usage()
    assert t[0].item() == world**55
    return before, after


def test_fifty_groups_created_and_destroyed_without_leaks():
    for before, after in run_ranks(_many_groups, 2, timeout=300):
        assert after["fds"] <= before["fds"], (before, after)
        assert after["threads"] <= before["threads"], (before, after)
        assert after["rss_kb"] < before["rss_kb"] * 1.05, (before, after)


def _two_threads(rank, world):
    groups = [dist.new_group(list(range(world))) for _ in range(2)]
    errors = []

    def worker(k):
        try:
            for i in range(300):
                x = torch.full((257,), float(rank + i + k))
                work = dist.all_reduce(x, group=groups[k], async_op=i % 2 == 0)
                if work is not None:
                    work.wait()
                assert x[0].item() == sum(r + i + k for r in range(world))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return True


def test_two_threads_on_two_groups_concurrently():
    assert all(run_ranks(_two_threads, 2))


def _soak(rank, world, count, distinct_sizes):
    """Mixed collectives of random sizes, sync and async, on two groups; every result checked.

    Sizes come from a pool of `distinct_sizes`: oneCCL's buffer cache keeps one scratch
    buffer per distinct allreduce size (see docs/reliability.md), so memory stays flat
    only once every size has been seen.
    """
    groups = [dist.group.WORLD, dist.new_group(list(range(world)))]
    rng = random.Random(1234)  # the same sequence on every rank
    sizes = [world * rng.randint(1, (1 << 20) // world) for _ in range(distinct_sizes)]  # up to 4 MiB
    pending, checked = [], 0

    def settle():
        nonlocal checked
        for work, check in pending:
            if work is not None:
                work.wait()
            check()
            checked += 1
        pending.clear()

    warm = count * 3 // 10  # by then every (op, size, group) has been seen: caches are full
    for i in range(count):
        op = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
        n = rng.choice(sizes)
        group = groups[rng.randrange(2)]
        async_op = rng.random() < 0.5
        v = float((i % 97) + rank)
        if op == "all_reduce":
            x = torch.full((n,), v)
            want = sum((i % 97) + r for r in range(world))
            work = dist.all_reduce(x, group=group, async_op=async_op)
            check = (lambda x=x, want=want: _expect(x[0].item() == want and x[-1].item() == want, op))
        elif op == "all_gather":
            out = torch.empty(n)
            work = all_gather_single(out, torch.full((n // world,), v), group=group, async_op=async_op)
            check = (lambda out=out, i=i, k=n // world: _expect(
                all(out[r * k].item() == (i % 97) + r for r in range(world)), op))
        elif op == "reduce_scatter":
            out = torch.empty(n // world)
            work = reduce_scatter_single(out, torch.full((n,), v), group=group, async_op=async_op)
            want = sum((i % 97) + r for r in range(world))
            check = (lambda out=out, want=want: _expect(out[-1].item() == want, op))
        elif op == "all_to_all":
            out = torch.empty(n)
            work = dist.all_to_all_single(out, torch.full((n,), v), group=group, async_op=async_op)
            k = n // world
            check = (lambda out=out, i=i, k=k: _expect(
                all(out[r * k].item() == (i % 97) + r for r in range(world)), op))
        else:
            x = torch.full((n,), v)
            work = dist.broadcast(x, group_src=i % world, group=group, async_op=async_op)
            check = (lambda x=x, want=(i % 97) + i % world: _expect(x[-1].item() == want, op))
        pending.append((work, check))
        if len(pending) >= 4 or not async_op:
            settle()
        if i == warm:
            settle()
            before = _trimmed_usage()
    settle()
    after = _trimmed_usage()
    return checked, before, after


def _expect(ok, op):
    assert ok, f"wrong {op} result"


# oneCCL 2022.1.2 itself keeps about 1 KB per call (the same growth with oneCCL called
# directly, none with gloo; docs/reliability.md): over the long run's 7,000 calls after
# warm-up that passes 5%. The long run allows it, with margin, and no more.
ONECCL_KB_PER_CALL = 4


@pytest.mark.parametrize(
    "count,kb_per_call",
    [pytest.param(1500, 0, id="short"),
     pytest.param(10_000, ONECCL_KB_PER_CALL, id="long", marks=[pytest.mark.slow, pytest.mark.timeout(3900)])],
)
def test_soak_mixed_collectives(count, kb_per_call):
    for checked, before, after in run_ranks(_soak, 2, count, 16, timeout=3600 if count > 5000 else 800):
        assert checked == count
        assert after["fds"] <= before["fds"], (before, after)
        assert after["threads"] <= before["threads"], (before, after)
        after_warm_up = count - count * 3 // 10
        assert after["rss_kb"] < before["rss_kb"] * 1.05 + kb_per_call * after_warm_up, (before, after)


def test_soak_every_size_new_with_buffer_cache_off():
    # Every allreduce a new size: flat only without oneCCL's per-size buffer cache.
    for checked, before, after in run_ranks(_soak, 2, 600, 600, env={"CCL_BUFFER_CACHE": "0"}):
        assert checked == 600
        assert after["rss_kb"] < before["rss_kb"] * 1.05, (before, after)


# ---- two hosts ---------------------------------------------------------------------


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: one 'host' per rank (scripts/netns.py)."""
    require(os.geteuid() == 0, "network namespaces need root")
    why = apt_install(("iproute2",), ("ip",))
    require(not why, why)
    require(shutil.which("unshare"), "network namespaces need unshare (util-linux)")
    try:
        with netns.hosts() as hosts:
            yield hosts
    except subprocess.CalledProcessError as e:
        require(False, f"cannot create network namespaces here: {' '.join(e.cmd)}: {e.stderr.strip()}")


def _tx_bytes(ns, dev):
    out = subprocess.run(["ip", "-n", ns, "-s", "link", "show", dev], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    return int(out.split("TX:")[1].split("\n")[1].split()[0])


def _torchrun_on_hosts(hosts, port, nproc, script, timeout):
    """One torchrun agent per network namespace; returns each host's output (all must exit 0)."""
    addr = hosts.addr
    procs = [
        popen(
            hosts.on(k, [BIN / "torchrun", "--nnodes", "2", "--nproc_per_node", str(nproc),
                         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr[0]}:{port}", "--rdzv_id", "hosts",
                         "--rdzv_conf", f"is_host={k == 0}", "--local_addr", addr[k], script]),
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={k2: v for k2, v in os.environ.items() if not k2.startswith(("CCL_", "FI_", "MASTER_", "ONECCL_"))},
        )
        for k in (0, 1)
    ]
    outs = communicate(procs, timeout)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    return outs


def test_two_hosts_over_veth_match_one_host(two_hosts):
    ns, dev = two_hosts.ns, two_hosts.dev
    port = free_port()
    sent_before = _tx_bytes(ns[0], dev[0])
    outs = _torchrun_on_hosts(two_hosts, port, 1, "tests/scripts/two_hosts.py", timeout=180)
    two = dict(re.findall(r"rank (\d) allreduce_ok=True grad_checksum=(-?\d+\.\d{10})", "".join(outs)))
    assert sorted(two) == ["0", "1"], outs
    # The allreduce (256 KiB per rank) really crossed the veth link, over TCP.
    assert _tx_bytes(ns[0], dev[0]) - sent_before > 256 * 1024
    one = run([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()),
               "tests/scripts/two_hosts.py"])
    single = dict(re.findall(r"rank (\d) allreduce_ok=True grad_checksum=(-?\d+\.\d{10})", one))
    assert two == single, (two, single)


def test_subgroup_on_one_host_takes_shared_memory_inside_a_two_host_world(two_hosts):
    ns, dev = two_hosts.ns, two_hosts.dev
    port = free_port()
    sent_before = _tx_bytes(ns[0], dev[0])
    outs = _torchrun_on_hosts(two_hosts, port, 2, "tests/scripts/host_subgroups.py", timeout=240)
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
