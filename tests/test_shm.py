"""The shared-memory transport for groups whose ranks share a host.

Results equal to the oneCCL path (same backend, switch off) at sizes that
cross its chunk boundaries; both transports in flight at once; mismatched
calls refused on every rank; nothing left in /dev/shm whatever ends a rank;
no other user can open a segment; groups created and destroyed in a loop.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from oneccl_bind_pt.bench import oneccl_group as _oneccl_group

from harness import run_ranks
from test_launchers import ROOT, free_port

NO_SHM = {"ONECCL_BIND_PT_SHM": "0"}


def _backend(group=None):
    g = group or dist.distributed_c10d._get_default_group()
    return g._get_backend(torch.device("cpu"))


def _paths(rank, world):
    pg = _backend()
    g = _oneccl_group(world)
    return {
        "shm": [pg._path(k, 1 << 20) for k in ("allreduce", "allgather", "broadcast", "send")],
        "large": [pg._path(k, 1 << 30) for k in ("allreduce", "alltoall", "reduce_scatter")],
        "off": _backend(g)._path("allreduce", 4),
    }


def test_paths_and_the_switch():
    got = run_ranks(_paths, 2)[0]
    assert got["shm"] == ["shm"] * 4
    assert got["large"] == ["shm"] * 3  # large messages move in chunks
    assert got["off"] == "oneccl"


def _crossover(rank, world):
    pg = _backend()
    t = torch.full((4096,), rank + 1.0)  # 16 KiB, above the limit below
    dist.all_reduce(t)
    return pg._path("allreduce", 4096), pg._path("allreduce", 16384), t[0].item()


def test_crossover_setting():
    for small, large, value in run_ranks(_crossover, 2, env={"ONECCL_BIND_PT_SHM_MAX_BYTES": "8K"}):
        assert (small, large, value) == ("shm", "oneccl", 3.0)


# Sizes around the 2 MiB staging buffer and its chunks, odd so that slices and
# windows end mid-cache-line.
SIZES = [0, 1, 7, 8191, 262_147, 524_289, 1_572_867]


def _same_on_both_paths(rank, world):
    g = _oneccl_group(world)
    problems = []

    def both(name, fn, reference=None):
        try:
            a, b = fn(None), fn(g)
        except Exception as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {e}")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            if reference is not None:
                # bfloat16 sums of 3+ ranks can round differently: shared memory
                # adds in float32 and rounds once (the correctly rounded sum);
                # oneCCL rounds after each step, within one bfloat16 ulp of it.
                want = reference[i]
                if not torch.equal(x, want):
                    problems.append(f"{name}: shm is not the correctly rounded result")
                torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=0)
            elif not (x.shape == y.shape and torch.equal(x, y)):
                problems.append(f"{name}: shm and oneCCL paths differ")
                return

    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            def allreduce(group, n=n, dtype=dtype):
                t = (torch.arange(n) % 97 + rank).to(dtype)
                dist.all_reduce(t, group=group)
                m = (torch.arange(n) % 89 - rank).to(dtype)
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
                return [t, m]
            reference = None
            if dtype == torch.bfloat16:
                ins = [(torch.arange(n) % 97 + r).to(dtype).double() for r in range(world)]
                maxes = [(torch.arange(n) % 89 - r).to(dtype) for r in range(world)]
                reference = [sum(ins).to(dtype), torch.stack(maxes).max(0).values]
            both(f"allreduce {n} {dtype}", allreduce, reference)

        def others(group, n=n):
            b = torch.arange(n, dtype=torch.float32) * (rank + 1)
            dist.broadcast(b, group_src=world - 1, group=group)
            r = torch.arange(n, dtype=torch.float32) + rank
            dist.reduce(r, group_dst=0, group=group)
            g_out = torch.empty(world * n)
            dist.all_gather_into_tensor(g_out, torch.arange(n, dtype=torch.float32) - rank, group=group)
            uneven = [torch.empty(n + q) for q in range(world)]
            dist.all_gather(uneven, torch.full((n + rank,), float(rank)), group=group)
            rs = torch.empty(n)
            # Values stay small: float32 sums are exact in any order.
            dist.reduce_scatter_tensor(rs, (torch.arange(world * n) % 1000).float() * (rank + 1), group=group)
            a2a = torch.empty(world * (n // world + 1))
            dist.all_to_all_single(a2a, torch.arange(world * (n // world + 1), dtype=torch.float32) + 10 * rank,
                                   group=group)
            return [b, r if rank == 0 else torch.empty(0), g_out, *uneven, rs, a2a]
        both(f"others {n}", others)
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_shm_and_oneccl_paths_agree_across_chunk_boundaries(world):
    for rank, problems in enumerate(run_ranks(_same_on_both_paths, world, timeout=600)):
        assert not problems, f"rank {rank}: {problems}"


def _mixed_in_flight(rank, world):
    # With a 64 KiB crossover, big allreduces go through oneCCL and small ones
    # through shared memory, all in flight together with p2p.
    peer = 1 - rank
    works, expected = [], []
    for i in range(12):
        n = 100_000 if i % 3 == 0 else 50
        t = torch.full((n,), float(rank + i))
        works.append((dist.all_reduce(t, async_op=True), t))
        expected.append(float(2 * i + 1))
        if i % 4 == 1:
            out, got = torch.full((10,), float(rank * 100 + i)), torch.empty(10)
            p2p = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)])
            works.append((p2p[-1], got))  # one Work for the whole batch
            expected.append(float(peer * 100 + i))
    for (w, t), want in reversed(list(zip(works, expected))):
        w.wait()
        assert t[0].item() == want and t[-1].item() == want, (t[0].item(), want)
    return _backend()._path("allreduce", 400_000), _backend()._path("allreduce", 200)


def test_both_transports_in_flight_together():
    for big, small in run_ranks(_mixed_in_flight, 2, env={"ONECCL_BIND_PT_SHM_MAX_BYTES": "64K"}):
        assert (big, small) == ("oneccl", "shm")


def _mismatches(rank, world):
    cases = {
        "sizes": lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 6)),
        "ops": lambda: dist.all_reduce(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), src=0),
        "dtypes": lambda: dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64)),
        "roots": lambda: dist.broadcast(torch.ones(4), src=rank),
        # One rank's call fits under the crossover, the other's does not.
        "paths": lambda: dist.all_reduce(torch.ones(16 if rank == 0 else 100_000)),
        # Rank 0 expects 3 elements from rank 1, which sends 2.
        "uneven": lambda: dist.all_gather([torch.empty(2), torch.empty(3 if rank == 0 else 2)], torch.ones(2)),
    }
    seen = {}
    for name, call in cases.items():
        try:
            call()
            seen[name] = "returned"
        except dist.DistBackendError as e:
            msg = str(e)
            assert "called different collectives" in msg and "remains usable" in msg, msg
            assert all(f"rank {r}: " in msg for r in range(world)), msg
            seen[name] = "raised"
        t = torch.full((3,), rank + 1.0)
        dist.all_reduce(t)  # still usable
        assert t.tolist() == [3.0] * 3
    return seen


def test_mismatched_calls_raise_on_every_rank_and_the_group_survives():
    for seen in run_ranks(_mismatches, 2, env={"ONECCL_BIND_PT_SHM_MAX_BYTES": "64K"}):
        assert set(seen.values()) == {"raised"}, seen


# ---- what is left behind ------------------------------------------------------------

def _shm_files():
    # Python's multiprocessing semaphores (sem.mp-*) come from other processes
    # on the machine: these ranks use none.
    return {f for f in os.listdir("/dev/shm") if not f.startswith("sem.mp-")}


def _job(script_body, world=2, env=None, kill=None, timeout=120):
    """Runs a script on `world` ranks (plain processes); returns (pids, returncodes, outputs)."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-P", "-c", script_body], cwd=ROOT,
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    if kill is not None:
        kill(procs)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return [p.pid for p in procs], [p.returncode for p in procs], outs


LOOP = """
import os, sys, time, torch, torch.distributed as dist, datetime
import oneccl_bind_pt
dist.init_process_group("ccl", timeout=datetime.timedelta(seconds=5))
g = dist.new_group([0, 1])
print("ready", flush=True)
big = torch.ones(1 << 20)
for i in range(100000):
    dist.all_reduce(big if i % 2 else torch.ones(8), group=g if i % 3 else None)
"""


def _segments_of(pid):
    """The memfd segments a process holds open or mapped."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            found |= {line.split()[-1] for line in maps if "oneccl_bind_pt" in line and "memfd" in line}
    except OSError:
        pass
    return found


def test_nothing_left_in_dev_shm_after_exit_destroy_or_sigkill():
    before = _shm_files()
    clean = ("import torch, torch.distributed as dist, oneccl_bind_pt\n"
             "dist.init_process_group('ccl'); g = dist.new_group([0, 1])\n"
             "dist.all_reduce(torch.ones(1 << 20), group=g); dist.destroy_process_group(g)\n"
             "dist.all_reduce(torch.ones(8)); dist.destroy_process_group()\n")
    _, rcs, outs = _job(clean)
    assert rcs == [0, 0], outs
    assert _shm_files() - before == set()

    def kill_one_mid_collective(procs):
        # Wait until both run the loop, then SIGKILL one at a random moment.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_segments_of(p.pid) for p in procs):
            time.sleep(0.05)
        time.sleep(random.uniform(0.2, 1.5))
        procs[random.randrange(2)].send_signal(signal.SIGKILL)

    pids, rcs, outs = _job(LOOP, kill=kill_one_mid_collective, timeout=90)
    assert -9 in rcs, (rcs, outs)
    survivor = outs[rcs.index(-9) ^ 1]
    assert "DistBackendError" in survivor and ("exited while this rank waited" in survivor
                                              or "did not complete within" in survivor), survivor
    left = _shm_files() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"


def _other_user():
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        return None
    name = "obptshm"
    try:
        pwd.getpwnam(name)
    except KeyError:
        if subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True).returncode != 0:
            return None
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def test_another_user_cannot_open_the_segments():
    ids = _other_user()
    if ids is None:
        pytest.skip("needs root, useradd and setpriv to act as a second local user")
    uid, gid = ids

    def probe(procs):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(_segments_of(p.pid) for p in procs):
            time.sleep(0.05)
        results = []
        for p in procs:
            fds = [f for f in os.listdir(f"/proc/{p.pid}/fd")
                   if "memfd:oneccl_bind_pt" in os.readlink(f"/proc/{p.pid}/fd/{f}")] if os.path.exists(
                f"/proc/{p.pid}/fd") else []
            targets = [f"/proc/{p.pid}/fd/{f}" for f in fds] + [f"/proc/{p.pid}/map_files"]
            for target in targets:
                r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                    sys.executable, "-c", f"open({target!r}, 'rb').read(1)"],
                                   capture_output=True, text=True)
                results.append((target, r.returncode, r.stderr.strip().splitlines()[-1:] ))
        probe.results = results
        for p in procs:
            p.send_signal(signal.SIGKILL)

    _job(LOOP, kill=probe, timeout=60)
    assert probe.results, "found no segment to probe"
    for target, rc, err in probe.results:
        assert rc != 0 and any("Permission denied" in line or "Operation not permitted" in line
                               or "IsADirectoryError" in line for line in err), (target, rc, err)


def _usage():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps, "rss_kb": rss}


def _create_destroy(rank, world):
    t = torch.ones(300_000)
    for i in range(40):
        g = dist.new_group(list(range(world)))
        dist.all_reduce(t, group=g)
        dist.all_reduce(torch.ones(8), group=g)
        dist.destroy_process_group(g)
        if i == 4:
            before = _usage()
    return before, _usage()


def test_group_create_destroy_loop_keeps_fds_mappings_and_rss_flat():
    for before, after in run_ranks(_create_destroy, 2, timeout=300):
        assert after["fds"] <= before["fds"], (before, after)
        assert after["maps"] <= before["maps"] + 2, (before, after)
        assert after["rss_kb"] < before["rss_kb"] * 1.05 + 4096, (before, after)
