"""The shared-memory transport for groups whose ranks share a host.

Results equal to the oneCCL path (same backend, switch off) at sizes that
cross its chunk boundaries; both transports in flight at once; mismatched
calls refused on every rank; nothing left in /dev/shm whatever ends a rank;
no other user can open a segment; groups created and destroyed in a loop. Large
messages against values known in advance, on both transports (the `transport` fixture).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
import pwd
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from oneccl_bind_pt.bench import oneccl_group as _oneccl_group

from harness import TRANSPORTS, Lines, RankFailure, expect_transport, popen, require, run_ranks
from test_launchers import ROOT, free_port

NO_SHM = {"ONECCL_BIND_PT_SHM": "0"}


def _backend(group=None):
    g = group or dist.distributed_c10d._get_default_group()
    return g._get_backend(torch.device("cpu"))


def _paths(rank, world):
    from oneccl_bind_pt import _C

    pg = _backend()
    g = _oneccl_group(world)
    return {
        "small": [pg._path(k, 4096) for k in ("allreduce", "allgather", "broadcast", "send")],
        "large": {**{f"{k} {s >> 20}M": pg._path(k, s) for k in ("allreduce", "allgather", "reduce_scatter", "send")
                     for s in (1 << 20, 1 << 30)},
                  # allreduce's Intel band ends at 8 MiB
                  "allreduce 8M": pg._path("allreduce", 8 << 20), "allreduce 8M+1": pg._path("allreduce", (8 << 20) + 1),
                  # the band with helpers: reduce_scatter of 256-512 KiB (both ends in it)
                  **{f"reduce_scatter {s}": pg._path("reduce_scatter", b) for s, b in (
                      ("256K-1", (256 << 10) - 1), ("256K", 256 << 10), ("512K", 512 << 10), ("512K+1", (512 << 10) + 1))},
                  "alltoall 256K": pg._path("alltoall", 256 << 10)},
        "off": _backend(g)._path("allreduce", 4),
        "single_copy": pg._single_copy(),
        "helpers": int(_C.helpers().split()[1]),  # "helpers N (why)"
        "chunk": pg._staging_chunk(),
        # The package's own reading of this host (more local ranks than CPUs), which the chunk follows.
        "crowded": _C.rank_cores(int(os.environ["CCL_LOCAL_SIZE"]))[3],
    }


INTEL = "GenuineIntel" in Path("/proc/cpuinfo").read_text()

SINGLE_COPY = {
    # The measured bands (src/route.cpp): on Intel CPUs without helper threads allgather,
    # reduce_scatter and all-to-all from 256 KiB up, allreduce from 1 to 8 MiB and send up to
    # 1 MiB; on other CPUs without helpers allgather and reduce_scatter around 1 MiB; with
    # helpers reduce_scatter of 256-512 KiB.
    "default": {},
    "from-256K": {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "256K"},
    "off": {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"},
    "helpers": {"ONECCL_BIND_PT_HELPERS": "1"},  # the default bands with a helper thread
}


@pytest.mark.parametrize("setting", SINGLE_COPY)
def test_paths_and_the_switch(setting):
    got = run_ranks(_paths, 2, env=SINGLE_COPY[setting])[0]
    assert got["small"] == ["shm"] * 4
    assert got["off"] == "oneccl"
    # Large messages: staged in chunks, or read from peers' tensors (this machine lets
    # ranks of one user read each other) where the setting says.
    kib = {"reduce_scatter 256K", "reduce_scatter 512K", "reduce_scatter 512K+1", "alltoall 256K"}
    intel = {f"{k} {s}M" for k in ("allgather", "reduce_scatter") for s in (1, 1024)} | {"allreduce 1M", "allreduce 8M",
                                                                                         "send 1M"} | kib
    narrow = {"allgather 1M", "reduce_scatter 1M", "reduce_scatter 256K", "reduce_scatter 512K", "reduce_scatter 512K+1"}
    helped = {"reduce_scatter 256K", "reduce_scatter 512K"}
    default = helped if got["helpers"] > 0 else intel if INTEL else narrow
    cma = {"default": default, "helpers": helped,
           "from-256K": {f"{k} {s}M" for k in ("allreduce", "allgather", "reduce_scatter", "send")
                         for s in (1, 1024)} | {"allreduce 8M", "allreduce 8M+1"} | kib,
           "off": set()}[setting]
    assert got["large"] == {name: "cma" if name in cma else "shm" for name in got["large"]}, got["large"]
    assert got["single_copy"] == ("off: ONECCL_BIND_PT_SHM_SINGLE_COPY=0" if setting == "off" else "on")
    crowded = got["crowded"]  # 2 ranks crowd a host of 1 CPU
    assert (CROWDED in got["chunk"]) == crowded, got["chunk"]
    assert got["chunk"].startswith(f"{_expected_chunk_kib(got['helpers'], crowded)} KiB: "), got["chunk"]


def _crossover(rank, world):
    pg = _backend()
    t = torch.full((4096,), rank + 1.0)  # 16 KiB, above the limit below
    dist.all_reduce(t)
    return pg._path("allreduce", 4096), pg._path("allreduce", 16384), t[0].item()


def test_crossover_setting():
    for small, large, value in run_ranks(_crossover, 2, env={"ONECCL_BIND_PT_SHM_MAX_BYTES": "8K"}):
        assert (small, large, value) == ("shm", "oneccl", 3.0)


# ---- the staging chunk ----------------------------------------------------------------------
# A staged step moves a chunk sized to the L2 cache, 1-2 MiB where ranks have CPUs of their own
# (src/route.cpp, default_chunk); ranks
# may choose differently (ONECCL_BIND_PT_SHM_CHUNK_BYTES per process) and must still cut
# every message alike: the group takes the smallest.

def _l2_bytes():
    out = subprocess.run(["getconf", "LEVEL2_CACHE_SIZE"], capture_output=True, text=True).stdout.strip()
    return int(out) if out.lstrip("-").isdigit() else 0


# Where a host's ranks outnumber its CPUs, single copy's reduce windows are the whole buffer
# and _staging_chunk() says so after the chunk.
CROWDED = "; single copy's reduce windows 2048 KiB: the whole buffer: "


def _expected_chunk_kib(helpers, crowded):
    """The L2 rule: an eighth of the L2 per thread, within 128-512 KiB, times the threads; from
    1 MiB to 2 MiB, but where ranks outnumber CPUs only up to 2 MiB."""
    l2 = _l2_bytes()
    per = 256 if l2 <= 0 else next(k for k in (512, 256, 128) if k == 128 or k * 1024 <= l2 // 8)
    return max(per if crowded else 1024, min(2048, per * (helpers + 1)))


def _chunks(rank, world, by_rank):
    from oneccl_bind_pt import _C

    default = _backend()._staging_chunk()
    got = {}
    # Each group reads this rank's variables when made, CCL_LOCAL_SIZE among them (the package
    # set it for the first group; each group reads it again to judge crowding). First every
    # rank with CPUs to itself, whatever this host has (one local rank: the 1 MiB floor); then
    # every rank crowded: more local ranks than the CPUs of its affinity.
    local = os.environ["CCL_LOCAL_SIZE"]
    host_crowded = _C.rank_cores(int(local))[3]
    os.environ["CCL_LOCAL_SIZE"] = "1"
    g = dist.new_group(list(range(world)))
    got["alone"] = (_backend(g)._staging_chunk(), _closed_forms(rank, world, g))
    # More ranks than the host's CPUs: crowded whatever the affinity (a narrow one that each rank
    # could have alone reads as a launcher's pinning, not as crowding).
    os.environ["CCL_LOCAL_SIZE"] = str(os.cpu_count() + 1)
    os.environ.update(SINGLE_COPY["from-256K"])
    g = dist.new_group(list(range(world)))
    got["crowded"] = (_backend(g)._staging_chunk(), _closed_forms(rank, world, g))
    if rank != 0:
        os.environ["CCL_LOCAL_SIZE"] = local  # rank 0 stays crowded: its windows differ from the others'
    if by_rank[rank]:
        os.environ["ONECCL_BIND_PT_SHM_CHUNK_BYTES"] = by_rank[rank]
    # Then every step staged, and single copy from 256 KiB (reduce_scatter reads its peers
    # in windows: rank 0's whole buffer, the others' chunk; the group must take one).
    for name, variables in (("staged", SINGLE_COPY["off"]), ("single copy", SINGLE_COPY["from-256K"])):
        os.environ.pop("ONECCL_BIND_PT_SHM_SINGLE_COPY", None)
        os.environ.update(variables)
        g = dist.new_group(list(range(world)))
        got[name] = (_backend(g)._staging_chunk(), _closed_forms(rank, world, g))
    return default, got, int(_C.helpers().split()[1]), host_crowded


def _closed_forms(rank, world, g):
    # Sizes that end mid-chunk: a rank cutting its chunks differently from the others reads
    # the wrong bytes or meets the wrong step.
    problems = []
    n = 800_003
    j = torch.arange(n, dtype=torch.float32)
    t = j + rank
    dist.all_reduce(t, group=g)
    if not torch.equal(t, j * world + sum(range(world))):
        problems.append("all_reduce")
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, j + rank, group=g)
    if not torch.equal(out, (j + torch.arange(world, dtype=torch.float32).view(world, 1)).flatten()):
        problems.append("all_gather_into_tensor")
    k = n // world
    share = torch.empty(k)
    dist.reduce_scatter_tensor(share, j[: world * k] + rank, group=g)
    if not torch.equal(share, j[rank * k:(rank + 1) * k] * world + sum(range(world))):
        problems.append("reduce_scatter_tensor")
    a2a = torch.empty(world * k)
    dist.all_to_all_single(a2a, j[: world * k] + n * rank, group=g)
    want = torch.cat([j[rank * k:(rank + 1) * k] + n * q for q in range(world)])
    if not torch.equal(a2a, want):
        problems.append("all_to_all_single")
    return problems


def test_the_staging_chunk_is_the_l2_rule_and_a_group_takes_its_smallest():
    got = run_ranks(_chunks, 3, ["", "128K", "64K"], env=TRANSPORTS["shm"], timeout=300)
    for rank, (default, groups, helpers, host_crowded) in enumerate(got):
        # 3 ranks crowd a host of 2 CPUs (or a quota of 2): the default group's windows say so.
        assert (CROWDED in default) == host_crowded, (rank, default)
        assert default.startswith(f"{_expected_chunk_kib(helpers, host_crowded)} KiB: "), (rank, default)
        alone, problems = groups.pop("alone")
        assert alone.startswith(f"{_expected_chunk_kib(helpers, False)} KiB: ") and CROWDED not in alone, (rank, alone)
        assert not problems, f"rank {rank}, alone: {problems}"
        crowded, problems = groups.pop("crowded")
        kib = _expected_chunk_kib(helpers, True)  # named after the chunk when they differ
        assert crowded.startswith(f"{kib} KiB: ") and (CROWDED in crowded) == (kib < 2048), (rank, crowded)
        assert not problems, f"rank {rank}, crowded: {problems}"
        for name, (agreed, problems) in groups.items():
            assert not problems, f"rank {rank}, {name}: {problems}"
            if rank == 2:
                assert agreed == "64 KiB: ONECCL_BIND_PT_SHM_CHUNK_BYTES", (name, agreed)
            else:
                assert agreed.startswith("64 KiB, rank 2's (the smallest of the group's; "), (rank, name, agreed)


def _never_runs(rank, world):
    raise AssertionError("the group was created despite a bad value")


def test_a_bad_staging_chunk_fails_the_group_with_its_name(monkeypatch):
    # On ranks: init_process_group raises it, before any rendezvous.
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_runs, 2, env={**TRANSPORTS["shm"], "ONECCL_BIND_PT_SHM_CHUNK_BYTES": "abc"}, timeout=120)
    text = str(caught.value)
    assert "ValueError: ONECCL_BIND_PT_SHM_CHUNK_BYTES=abc is not a size from 64K to 2M" in text, text
    # The others here, where the backend's constructor checks it before anything else: none
    # of them gets as far as a communicator, so no ranks are needed.
    from oneccl_bind_pt import _C

    for value in ("1K", "4M", "-64K", "256KQ"):  # (256KB, 256 KiB as bench reads it, is a size)
        monkeypatch.setenv("ONECCL_BIND_PT_SHM_CHUNK_BYTES", value)
        with pytest.raises(ValueError, match=f"ONECCL_BIND_PT_SHM_CHUNK_BYTES={value} is not a size from 64K to 2M"):
            # (Were it not checked, the rendezvous would fail after 2 s, not with this error.)
            _C.ProcessGroupCCL(dist.HashStore(), 0, 2, timeout=datetime.timedelta(seconds=2))


def _alltoall(rank, world):
    n = 1 << 20  # 4 MiB of float32 per rank
    out = torch.empty(n)
    dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + rank * n)
    share = n // world
    want = torch.cat([torch.arange(rank * share, (rank + 1) * share, dtype=torch.float32) + r * n for r in range(world)])
    from oneccl_bind_pt import _C

    wide = INTEL and _C.helpers().startswith("helpers 0 ")  # single copy's Intel bands (route.cpp)
    return _backend()._path("alltoall", 1 << 20), _backend()._path("alltoall", 4 << 20), torch.equal(out, want), wide


@pytest.mark.parametrize("atl_shm", [None, "1"])
def test_alltoall_route(atl_shm, monkeypatch):
    # The one default crossover (src/route.cpp): all-to-all above 1 MiB per rank goes to
    # oneCCL only when oneCCL has its own shared memory (CCL_ATL_SHM=1); on one host the
    # package sets 0 (None: left to it), and shared memory keeps every size (read from the
    # peers directly on Intel CPUs without helper threads).
    monkeypatch.delenv("CCL_ATL_SHM", raising=False)
    env = {"CCL_ATL_SHM": atl_shm} if atl_shm else {}
    for *got, wide in run_ranks(_alltoall, 2, env=env):
        ours = "cma" if wide else "shm"
        assert tuple(got) == (ours, "oneccl" if atl_shm else ours, True), got


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


@pytest.mark.parametrize("single_copy", ["from-256K", "off"])
@pytest.mark.parametrize("world", [2, 3])
def test_shm_and_oneccl_paths_agree_across_chunk_boundaries(world, single_copy):
    # Every collective from 256 KiB on reads peers' tensors directly (their windows end
    # mid-line too), or with single copy off everything moves through the staging buffers.
    env = SINGLE_COPY[single_copy]
    for rank, problems in enumerate(run_ranks(_same_on_both_paths, world, timeout=600, env=env)):
        assert not problems, f"rank {rank}: {problems}"


def _large_closed_form(rank, world):
    # Rank r holds j + r at index j: sums of `world` ranks stay below 2**24, exact in float32,
    # and every element differs from its neighbours, so a misplaced chunk shows.
    expect_transport()
    n = (1 << 24) // world - 5  # 32 MiB of float32 on 2 ranks, 21 MiB on 3, an odd tail
    k = n // world
    j = torch.arange(n, dtype=torch.float32)
    problems = []

    def check(name, got, want):
        if not torch.equal(got, want):
            wrong = (got != want).nonzero().flatten()
            problems.append(f"{name}: {len(wrong)} of {want.numel()} elements wrong, the first at {wrong[0].item()}")

    t = j + rank
    dist.all_reduce(t)
    check(f"all_reduce {n}", t, j * world + sum(range(world)))
    by_rank = torch.arange(world, dtype=torch.float32).view(world, 1)
    out = torch.empty(world * k)
    dist.all_gather_into_tensor(out, j[:k] + rank)
    check(f"all_gather_into_tensor {k} per rank", out, (j[:k] + by_rank).flatten())
    share = torch.empty(k)
    dist.reduce_scatter_tensor(share, j[: world * k] + rank)
    check(f"reduce_scatter_tensor {k} per rank", share, j[rank * k:(rank + 1) * k] * world + sum(range(world)))
    return problems


# Above, shared memory is judged by its agreement with oneCCL; this checks both against
# values known in advance, at sizes far above the 2 MiB staging buffer and single copy's band.
@pytest.mark.parametrize("world", [2, 3])
def test_large_messages_match_closed_form(world, transport):
    for rank, problems in enumerate(run_ranks(_large_closed_form, world, env=TRANSPORTS[transport])):
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
        # One op of two parts whose second does not match: the first was exchanged.
        "second part": lambda: dist.distributed_c10d._get_default_group().reduce_scatter_tensor_coalesced(
            [torch.empty(2), torch.empty(3 if rank == 0 else 2)],
            [torch.ones(4), torch.ones(6 if rank == 0 else 4)]).wait(),
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
            said = "Its first 1 of 2 parts were exchanged" in msg, "Nothing was exchanged" in msg
            assert said == ((True, False) if name == "second part" else (False, True)), msg
            seen[name] = "raised"
        t = torch.full((3,), rank + 1.0)
        dist.all_reduce(t)  # still usable
        assert t.tolist() == [3.0] * 3
    return seen


def test_mismatched_calls_raise_on_every_rank_and_the_group_survives():
    for seen in run_ranks(_mismatches, 2, env={"ONECCL_BIND_PT_SHM_MAX_BYTES": "64K"}):
        assert set(seen.values()) == {"raised"}, seen


# ---- single copy refused ------------------------------------------------------------

# Rank 0 forbids itself process_vm_readv with a seccomp filter, as a container's profile
# may: the group's probe must see it and stage every size, on every rank, with right sums.
NO_CMA = """
import ctypes, torch, torch.distributed as dist, oneccl_bind_pt, os
if os.environ["RANK"] == "0":
    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
    # x86_64: process_vm_readv is syscall 310; other syscalls are allowed.
    code = (Filter * 4)(Filter(0x20, 0, 0, 0), Filter(0x15, 0, 1, 310),
                        Filter(0x06, 0, 0, 0x00050000 | 1), Filter(0x06, 0, 0, 0x7FFF0000))
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Prog(4, code))) == 0  # PR_SET_SECCOMP, FILTER
dist.init_process_group("ccl")
pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
rank = dist.get_rank()
t = torch.full((1 << 20,), float(rank + 1))
dist.all_reduce(t)
out = torch.empty(2 << 20)
dist.all_gather_into_tensor(out, torch.full((1 << 20,), float(rank)))
ok = t.eq(3).all().item() and out[: 1 << 20].eq(0).all().item() and out[1 << 20 :].eq(1).all().item()
print("result", pg._single_copy(), "|", pg._path("allreduce", 4 << 20), "|", ok, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names x86_64's syscall number")
def test_single_copy_refused_by_the_kernel_falls_back_to_staging():
    pids, rcs, outs = _job(NO_CMA)
    assert rcs == [0, 0], outs
    for out in outs:
        line = next(l for l in out.splitlines() if l.startswith("result "))
        status, path, ok = line.removeprefix("result ").split(" | ")
        assert status.startswith("off: rank 0 may not read rank 1's memory (process_vm_readv: Operation not "
                                 "permitted"), status
        assert (path, ok) == ("shm", "True"), line


# ---- what is left behind ------------------------------------------------------------

def _left_in_dev_shm(pids, seen=()):
    """What these processes left in /dev/shm: files named by one of their pids (oneCCL's
    shared-memory transport names its files "<pid>:<n>:<n>") or seen open or mapped by
    them. Other processes' files, another test run's included, do not count."""
    pids = {str(p) for p in pids}
    names = set(os.listdir("/dev/shm"))
    return {n for n in names if pids & set(re.split(r"\D+", n))} | (names & set(seen))


def _dev_shm_in_use(pid):
    """Names of the /dev/shm files a process holds open or mapped now."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as maps:
            found |= {line.split()[-1] for line in maps if " /dev/shm/" in line}
        found |= {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        pass
    return {f.removeprefix("/dev/shm/").removesuffix(" (deleted)") for f in found if f.startswith("/dev/shm/")}


def _job(script_body, world=2, env=None, kill=None, timeout=120):
    """Runs a script on `world` ranks (plain processes); returns (pids, returncodes, outputs).

    `kill(procs, lines)` runs while they do (lines: each rank's output as it comes)."""
    port = free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
            "PYTHONUNBUFFERED": "1", **(env or {})}
    procs = [popen([sys.executable, "-P", "-c", script_body], cwd=ROOT,
                   env={**base, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world)},
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    lines = [Lines(p) for p in procs]
    try:
        if kill is not None:
            kill(procs, lines)
        outs = [out.finish(timeout) for out in lines]
    finally:
        for out in lines:
            out.close()
    return [p.pid for p in procs], [p.returncode for p in procs], outs


LOOP = """
import os, sys, time, torch, torch.distributed as dist, datetime
import oneccl_bind_pt
dist.init_process_group("ccl", timeout=datetime.timedelta(seconds=5))
g = dist.new_group([0, 1])
dist.all_reduce(torch.ones(8), group=g)
print("ready", flush=True)
big = torch.ones(1 << 20)
got = torch.empty(1 << 20)
peer = 1 - dist.get_rank()
for i in range(100000):
    dist.all_reduce(big if i % 2 else torch.ones(8), group=g if i % 3 else None)
    if i % 4 == 0:  # 4 MiB both ways: streamed, or read from the peer's tensor (single copy)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, big, peer), dist.P2POp(dist.irecv, got, peer)]):
            w.wait()
"""


def _segments_of(pid):
    """The address ranges of the memfd segments a process has mapped."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split()[0] for line in maps if "memfd:oneccl_bind_pt" in line}
    except OSError:
        return set()


def _kill_mid_collective(seen, every=False):
    def kill(procs, lines):
        # Once both run the loop, SIGKILL one (or all) at a random moment: what is left
        # may depend on where in a collective it dies.
        for out in lines:
            out.wait_for("ready", timeout=120)
        for p in procs:
            seen.update(_dev_shm_in_use(p.pid))
        time.sleep(random.uniform(0.2, 1.5))  # random on purpose, no event to wait for
        for p in procs if every else [procs[random.randrange(2)]]:
            p.send_signal(signal.SIGKILL)

    return kill


def test_nothing_left_in_dev_shm_after_exit_destroy_or_sigkill():
    clean = ("import torch, torch.distributed as dist, oneccl_bind_pt\n"
             "dist.init_process_group('ccl'); g = dist.new_group([0, 1])\n"
             "dist.all_reduce(torch.ones(1 << 20), group=g); dist.destroy_process_group(g)\n"
             "dist.all_reduce(torch.ones(8)); dist.destroy_process_group()\n")
    pids, rcs, outs = _job(clean)
    assert rcs == [0, 0], outs
    assert not _left_in_dev_shm(pids)

    # The default routes (on Intel CPUs the 4 MiB allreduces read the peer's tensor
    # directly), then single copy from 256 KiB.
    for env in SINGLE_COPY["default"], SINGLE_COPY["from-256K"]:
        seen = set()
        pids, rcs, outs = _job(LOOP, kill=_kill_mid_collective(seen), timeout=90, env=env)
        assert -9 in rcs, (rcs, outs)
        survivor = outs[rcs.index(-9) ^ 1]
        # Killed while the survivor waited for it, or while it read the killed rank's tensor.
        assert "DistBackendError" in survivor and ("exited while this rank waited" in survivor
                                                  or "exited while this rank read its tensor" in survivor
                                                  or "did not complete within" in survivor), survivor
        left = _left_in_dev_shm(pids, seen)
        assert not left, f"left in /dev/shm: {sorted(left)}"


def test_the_leftover_check_sees_what_oneccls_own_transport_leaves():
    # With ours off, oneCCL's own shared-memory transport carries the ranks and leaves a
    # file per rank when they are killed (docs): the check above must see those, or it
    # has gone blind (e.g. oneCCL renamed them).
    seen = set()
    pids, rcs, outs = _job(LOOP, env={"ONECCL_BIND_PT_SHM": "0"}, kill=_kill_mid_collective(seen, every=True))
    left = _left_in_dev_shm(pids, seen)
    for name in left:
        os.unlink(f"/dev/shm/{name}")
    assert rcs == [-9, -9], (rcs, outs)
    assert left, f"no file of theirs found in /dev/shm; in use while they ran: {sorted(seen)}"


@pytest.fixture
def other_user():
    """(uid, gid) of a local user created for this test, removed afterwards."""
    require(os.geteuid() == 0, "acting as a second local user needs root")
    require(shutil.which("useradd") and shutil.which("userdel"), "needs useradd and userdel (passwd)")
    require(shutil.which("setpriv"), "needs setpriv (util-linux)")
    name = f"obpt{uuid.uuid4().hex[:8]}"
    r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                       capture_output=True, text=True, timeout=60)
    require(r.returncode == 0, f"useradd {name} failed: {r.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)


def _as_user(uid, gid, path, pass_fds=()):
    """Tries, as another user, to read a byte of `path`; returns (exit code, last line of stderr)."""
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                        sys.executable, "-c", f"open({path!r}, 'rb').read(1)"],
                       capture_output=True, text=True, pass_fds=pass_fds, timeout=60)
    return r.returncode, (r.stderr.strip().splitlines() or [""])[-1]


def test_another_user_cannot_open_the_segments(other_user):
    uid, gid = other_user
    # The probe can succeed: a segment readable by others would be read this way.
    control = os.memfd_create("oneccl_bind_pt-control")
    os.write(control, b"x")
    os.fchmod(control, 0o644)
    try:
        assert _as_user(uid, gid, f"/proc/self/fd/{control}", (control,))[0] == 0, "the probe cannot read anything"
    finally:
        os.close(control)

    results = []

    def probe(procs, lines):
        for out in lines:
            out.wait_for("ready", timeout=120)
        for p in procs:
            segments = _segments_of(p.pid)
            assert segments, f"rank pid {p.pid} maps no segment"
            for rng in segments:
                # Reopening a segment checks its own mode and owner, whoever holds it:
                # root hands the other user an fd to reopen.
                fd = os.open(f"/proc/{p.pid}/map_files/{rng}", os.O_RDONLY)
                try:
                    results.append((f"segment {rng} of {p.pid}",) + _as_user(uid, gid, f"/proc/self/fd/{fd}", (fd,)))
                finally:
                    os.close(fd)
                results.append((f"map_files {rng} of {p.pid}",) + _as_user(uid, gid, f"/proc/{p.pid}/map_files/{rng}"))
        for p in procs:
            p.send_signal(signal.SIGKILL)

    _job(LOOP, kill=probe, timeout=60)
    assert any(what.startswith("segment") for what, *_ in results), "found no segment to probe"
    for what, rc, err in results:
        assert rc != 0 and ("Permission denied" in err or "Operation not permitted" in err), (what, rc, err)


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
