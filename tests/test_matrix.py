"""Collectives x reduce ops x dtypes on 2 real ranks, and what the world size changes on 3
and 4, through both transports (matrix.cases() says which case runs where, and why).

All ranks are on this host, so the default is the shared-memory transport, through its
staging buffers ("shm") or reading peers' tensors directly ("cma", forced for every size
here); ONECCL_BIND_PT_SHM=0 sends the same cases through oneCCL. Each case checks its
values against results worked out from the inputs, so passing on both paths
also means both paths agree.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, RankFailure, all_gather_single, expect_transport, helper_threads, run_ranks
from matrix import (FLOATS, MOVABLE, MOVEMENTS, REDUCE_OPS, REDUCIBLE, REDUCTIONS, accepted, cases, data,
                    expected_reduction, raw_data, reduce_op, run_all, same_bytes)

# cma: the shared-memory transport reading peers' tensors directly at every size (by
# default only large messages do, and only where the kernel lets ranks read each other).
PATHS = {"shm": {}, "cma": {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "0"}, "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}
WORLDS = [2, 3, 4]


def _run_all_on(rank, world, path):
    # A case list that silently ran on the other transport would prove nothing.
    taken = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert taken._path("allreduce", 64) == path, (taken._path("allreduce", 64), path)
    return run_all(rank, world)


@functools.lru_cache(maxsize=None)
def matrix_results(world, path):
    # One launch per world size and path runs the whole matrix; items below report each case.
    return run_ranks(_run_all_on, world, path, timeout=900, env=PATHS[path])


def _params():
    # Ids as before the thinning ("<case>-<world>-<path>"), which -k selections rely on.
    for world in WORLDS:
        for case in cases(world):
            for path in PATHS:
                yield pytest.param(case.id, world, path, id=f"{case.id}-{world}-{path}")


@pytest.mark.timeout(1200)  # the first item of a (world, path) pays its launch (up to 900 s)
@pytest.mark.parametrize("case_id, world, path", list(_params()))
def test_case(case_id, world, path):
    per_rank = matrix_results(world, path)
    failures = {rank: r[case_id] for rank, r in enumerate(per_rank) if r[case_id] is not None}
    assert not failures, failures


def test_every_op_and_dtype_is_covered_on_every_transport():
    at_two = {c.id for c in cases(2)}
    for name in REDUCTIONS:
        assert {op for op in REDUCE_OPS if any(i.startswith(f"{name}-{op}-") for i in at_two)} == set(REDUCE_OPS)
    for dt in REDUCIBLE:
        assert all(f"all_reduce-{op}-{dt}" in at_two for op in REDUCE_OPS), dt
    for dt in MOVABLE:
        assert any(i.endswith(f"-{dt}") and not i.startswith(tuple(REDUCTIONS)) for i in at_two), dt
    for name in MOVEMENTS:
        assert any(i.startswith(f"{name}-") for i in at_two), name
    for world in WORLDS[1:]:
        ids = {c.id for c in cases(world)}
        assert {i.split("-")[0] for i in ids} == set(REDUCTIONS) | set(MOVEMENTS), world


# ---- every kernel and copy path this CPU runs --------------------------------------------
# The shared-memory transport picks its reduce kernels (AVX-512, AVX2, baseline x86-64) and its
# copy (glibc's memcpy, or its own vector loop) once per process, from the CPU; the environment
# forces a lower path. The matrix above runs only the path this machine picks, and its tensors
# are too small to reach the vector loops: here each path reduces and moves tensors of an odd
# length (vector bodies plus remainders, several kernel blocks, copies above 4 KiB).

def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


ISA_FLAGS = {"baseline": set(), "avx2": {"avx2", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
             "avx512bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}}
KERNEL_PATHS = [(isa, copy) for isa in ISA_FLAGS for copy in ("loop", "glibc")]
ODD = 3 * 4096 + 37  # elements


def _bf16(words) -> torch.Tensor:
    words = torch.tensor(words, dtype=torch.int32)
    return torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16).view(torch.bfloat16)


# bfloat16 values where AVX512_BF16's conversion differs from rounding to nearest even (it
# flushes denormals and keeps NaN payloads) or could: each in a 16-value group of its own
# (the conversion's width), at lane 5 among ordinary values: (rank 0's, rank 1's).
BF16_SPECIALS = [(0x0001, 0x0002), (0x7F81, 0x3F80), (0xFFC1, 0x3F80), (0x8000, 0x0000), (0x7F80, 0x3F80),
                 (0x7F7F, 0x7B00), (0x0081, 0x8080), (0x3F81, 0x3F81)]  # denormals, signalling NaN, NaN
# with a sign and payload, zeros, infinity, a sum halfway to infinity, normals summing to a
# denormal, ordinary


def _bf16_specials(rank: int, specials=BF16_SPECIALS, tail=(0x0001, 0x0000)) -> torch.Tensor:
    words = []
    for g, pair in enumerate(specials):
        group = [0x3F80 + ((g * 16 + k + rank) % 64) for k in range(16)]
        group[5] = pair[rank] if rank < 2 else 0x3F80
        words += group
    return _bf16(words + [tail[rank] if rank < 2 else 0x3F80] + [0x4000 + rank] * 4)  # and a tail of 5


def _rounded_bf16(acc: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 bits, rounded to nearest even, a NaN as 0x7FC0 (c10::BFloat16's
    scalar rounding; torch's vectorized one makes 0xFFFF, so it is worked out here)."""
    words = acc.view(torch.int32)
    rounded = ((words + 0x7FFF + ((words >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(acc.isnan(), torch.full_like(rounded, 0x7FC0), rounded)


def _check_bf16_specials(rank, world, op, make, failures, what):
    t = make(rank)
    dist.all_reduce(t, op=reduce_op(op))
    torch.set_flush_denormal(False)  # the expected values without flushing, whatever the rank uses
    acc = make(0).float()
    for r in range(1, world):
        x = make(r).float()
        acc = acc + x if op == "SUM" else torch.minimum(acc, x) if op == "MIN" else torch.maximum(acc, x)
    expected, got = _rounded_bf16(acc), t.view(torch.int16).to(torch.int32) & 0xFFFF
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero().flatten()[:5].tolist()
        failures.append(f"all_reduce {op} bfloat16 {what}: elements {bad} are {[hex(v) for v in got[bad].tolist()]}, "
                        f"expected {[hex(v) for v in expected[bad].tolist()]}")


def _kernel_path(rank, world, isa, copy):
    from oneccl_bind_pt import _C

    expect_transport()  # the kernels and copies are the shared-memory transport's
    chosen = _C.kernels()
    named = "avx512, bfloat16 avx512bf16" if isa == "avx512bf16" else isa  # the loop is avx512's
    loop = "avx512" if isa == "avx512bf16" else isa
    assert chosen.startswith(f"kernels {named} (ONECCL_BIND_PT_KERNELS;") and f"copy {'glibc' if copy == 'glibc' else 'loop ' + loop} (" in chosen, chosen
    failures = []
    for op in ("SUM", "MIN", "MAX"):
        _check_bf16_specials(rank, world, op, _bf16_specials, failures, "specials")
    # MIN and MAX carry a denormal through under denormals-are-zero (torch.set_flush_denormal),
    # in a group with no NaN: the kernels must still round it, not flush it.
    torch.set_flush_denormal(True)
    _check_bf16_specials(rank, world, "MAX", functools.partial(_bf16_specials, specials=[(0x007F, 0xBF80)] * 2,
                                                               tail=(0x3F80, 0x3F80)), failures, "denormal under DAZ")
    torch.set_flush_denormal(False)
    for dtype_name, dtype in {**FLOATS, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}.items():
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "BXOR"):
            if not accepted(op, dtype):
                continue
            mine = data(rank, dtype, (ODD,), salt=len(op), op=op)
            t = mine.clone()
            dist.all_reduce(t, op=reduce_op(op))
            expected = expected_reduction([data(r, dtype, (ODD,), salt=len(op), op=op) for r in range(world)], op, world)
            if not same_bytes(t, expected):
                bad = (t != expected).nonzero().flatten()[:5].tolist()
                failures.append(f"all_reduce {op} {dtype_name}: first wrong elements {bad}")
    # Movements go through the copy: byte patterns of odd length, every alignment of the tail.
    for extra in range(0, 64, 13):
        n = (1 << 16) + extra
        mine = raw_data(rank, torch.uint8, (n,), salt=extra)
        out = torch.empty(world * n, dtype=torch.uint8)
        all_gather_single(out, mine)
        if not torch.equal(out, torch.cat([raw_data(r, torch.uint8, (n,), salt=extra) for r in range(world)])):
            failures.append(f"all_gather {n} bytes")
        b = mine.clone()
        dist.broadcast(b, src=1)
        if not torch.equal(b, raw_data(1, torch.uint8, (n,), salt=extra)):
            failures.append(f"broadcast {n} bytes")
    return failures


@pytest.mark.parametrize("isa, copy", KERNEL_PATHS, ids=[f"{i}-{c}" for i, c in KERNEL_PATHS])
def test_every_kernel_and_copy_path_this_cpu_runs(isa, copy):
    if not ISA_FLAGS[isa] <= _cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    env = {**TRANSPORTS["shm"], "ONECCL_BIND_PT_KERNELS": isa, "ONECCL_BIND_PT_COPY": copy}
    assert run_ranks(_kernel_path, 2, isa, copy, env=env, timeout=300) == [[], []]


def _never_runs(rank, world):
    raise AssertionError("the group was created despite a bad value")


@pytest.mark.parametrize("var", ["ONECCL_BIND_PT_KERNELS", "ONECCL_BIND_PT_COPY"])
def test_an_unknown_kernel_or_copy_name_fails_the_group_with_its_name(var):
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_runs, 2, env={var: "avx9000"}, timeout=120)
    text = str(caught.value)
    assert f"ValueError: {var}=avx9000 is not one of" in text and "the group was created" not in text, text


# ---- helper threads ------------------------------------------------------------------------
# Large copies and reductions split across helper threads (src/helpers.hpp) where a rank has
# spare cores. This machine has none, so the default is no helper: here
# ONECCL_BIND_PT_HELPERS=3 forces them (more threads than cores: slower, not less exact).
# Sizes are above the 256 KiB split and the 2 MiB staging chunk, with odd tails, through the
# staging buffers and through single copy; values are worked out from the inputs.

def _helper_split(rank, world, path, helpers, idle=0):
    from oneccl_bind_pt import _C

    said = f"helpers {helpers} (ONECCL_BIND_PT_HELPERS)"
    if idle:
        said += (f"; up to {idle} more while this rank's compute or the host is idle (ONECCL_BIND_PT_IDLE_HELPERS); "
                 "idle cores counted among 64 CPUs (ONECCL_BIND_PT_IDLE_CPUS)")
    # (then, where the rank's own cores leave fewer, how many it takes while its compute is idle)
    assert _C.helpers() == said or _C.helpers().startswith(said + "; "), _C.helpers()
    taken = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert taken._path("allreduce", 8 << 20) == path, taken._path("allreduce", 8 << 20)
    problems = []

    def check(name, got, want):
        if not same_bytes(got, want):
            wrong = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero().flatten()
            problems.append(f"{name}: {len(wrong)} bytes wrong, the first at byte {wrong[0].item()}")

    n = 3 * (1 << 20) + 7  # 12 MiB of float32: six staging chunks and an odd tail
    j = torch.arange(n, dtype=torch.float32)
    t = j + rank
    dist.all_reduce(t)
    check("all_reduce float32 SUM", t, j * world + sum(range(world)))
    for dtype, op in ((torch.bfloat16, "SUM"), (torch.int32, "MAX"), (torch.float64, "MIN")):
        m = (1 << 19) + 11
        mine = data(rank, dtype, (m,), salt=m, op=op)
        got = mine.clone()
        dist.all_reduce(got, op=reduce_op(op))
        check(f"all_reduce {dtype} {op}", got, expected_reduction([data(r, dtype, (m,), salt=m, op=op)
                                                                   for r in range(world)], op, world))
    t = j + rank
    dist.reduce(t, dst=world - 1)
    if rank == world - 1:
        check("reduce to the last rank", t, j * world + sum(range(world)))
    k = n // world
    share = torch.empty(k)
    dist.reduce_scatter_tensor(share, j[: world * k] + rank)
    check("reduce_scatter_tensor", share, j[rank * k:(rank + 1) * k] * world + sum(range(world)))
    out = torch.empty(world * k)
    all_gather_single(out, j[:k] + rank)
    check("all_gather_into_tensor", out, (j[:k] + torch.arange(world, dtype=torch.float32).view(world, 1)).flatten())
    b = (5 << 20) + 13
    payload = raw_data(1, torch.uint8, (b,), salt=b)
    got = payload.clone() if rank == 1 else torch.zeros(b, dtype=torch.uint8)
    dist.broadcast(got, src=1)
    check("broadcast 5 MiB + 13 B", got, payload)
    per = (1 << 20) + 3
    send = torch.cat([raw_data(rank, torch.uint8, (per,), salt=q) for q in range(world)])
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    check("all_to_all_single", recv, torch.cat([raw_data(q, torch.uint8, (per,), salt=rank) for q in range(world)]))
    if rank < 2:
        # send/recv: runs of ring slots split across the helpers, both ways at once, two
        # messages in flight each way (the second may come before its recv: held, then
        # copied), odd tails.
        peer = 1 - rank
        sizes = [(3 << 20) + 5, (700 << 10) + 1]
        sent = [raw_data(rank, torch.uint8, (s,), salt=s) for s in sizes]
        got = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
        works = [dist.isend(t, peer, tag=i) for i, t in enumerate(sent)] + [dist.irecv(got[0], peer, tag=0)]
        works[-1].wait()
        works.append(dist.irecv(got[1], peer, tag=1))
        for w in works:
            w.wait()
        for i, s in enumerate(sizes):
            check(f"recv of {s} B from rank {peer}", got[i], raw_data(peer, torch.uint8, (s,), salt=s))
    return problems, helper_threads(), _C._split_counts()


@pytest.mark.parametrize("path", ["shm", "cma"])
@pytest.mark.parametrize("world", [2, 3])
def test_helper_threads_split_large_messages_exactly(world, path):
    # shm: staged at every size (on Intel CPUs the default reads an 8 MiB allreduce directly).
    forced = {"shm": {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"}, "cma": PATHS["cma"]}[path]
    env = {**TRANSPORTS["shm"], "ONECCL_BIND_PT_HELPERS": "3", **forced}
    for rank, (problems, threads, _) in enumerate(run_ranks(_helper_split, world, path, 3, env=env, timeout=600)):
        assert not problems, f"rank {rank}: {problems}"
        assert threads == 3, f"rank {rank}: {threads} helper threads, 3 asked for: the work was never split"


# Idle helpers (ONECCL_BIND_PT_IDLE_HELPERS): more threads that a split takes only while the
# host's runnable threads leave CPUs free (src/helpers.hpp). With 2 ranks on this machine's 2
# CPUs none is ever free, so ONECCL_BIND_PT_IDLE_CPUS=64 counts free CPUs among 64: every split
# takes them, alone (no helper otherwise, as DDP at 2 x 8 on 16 cores) and beside one always used.
@pytest.mark.parametrize("helpers", [0, 1])
def test_idle_helpers_split_large_messages_exactly(helpers):
    env = {**TRANSPORTS["shm"], "ONECCL_BIND_PT_HELPERS": str(helpers), "ONECCL_BIND_PT_IDLE_HELPERS": "2",
           "ONECCL_BIND_PT_IDLE_CPUS": "64", "ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"}
    for rank, (problems, threads, (splits, idle)) in enumerate(
            run_ranks(_helper_split, 2, "shm", helpers, 2, env=env, timeout=600)):
        assert not problems, f"rank {rank}: {problems}"
        assert threads == helpers + 2, f"rank {rank}: {threads} helper threads, {helpers} and 2 idle ones asked for"
        # Every split has pieces for them (64 CPUs less a few runnable threads, halved: more than 2).
        assert splits > 0 and idle == splits, f"rank {rank}: {idle} of {splits} splits took idle helpers"


# Where the rank's compute is idle, its idle helpers split whatever the host's count says, as
# many as its cores leave: the op runs on the thread that issued it, or that thread sleeps (as
# DDP waits for its last buckets). While the issuing thread computes, the count decides: here
# each rank takes itself for the host's only one (CCL_LOCAL_SIZE=1: 2 cores, room for 1 idle
# helper), and ONECCL_BIND_PT_IDLE_CPUS=2 counts the host as 2 CPUs, which both ranks busy
# leave none of. On the build before this rule no split took an idle helper; on one that took
# the main thread for the compute, a thread computing while the main thread waits let them in.
def _idle_by_compute(rank, world):
    import threading

    from oneccl_bind_pt import _C

    n = 4 << 20  # 16 MiB of float32: eight staging chunks
    want = torch.arange(n, dtype=torch.float32) * world + sum(range(world))

    def counted(run, on_thread=False):
        before = _C._split_counts()
        t = torch.arange(n, dtype=torch.float32) + rank
        if on_thread:  # issued and run there; this thread waits, asleep
            worker = threading.Thread(target=run, args=(t,))
            worker.start()
            worker.join()
        else:
            run(t)
        assert torch.equal(t, want)
        return [now - then for now, then in zip(_C._split_counts(), before)]

    def busy(t):  # the op on the background thread, the issuing thread computing beside it
        fut = dist.all_reduce(t, async_op=True).get_future()
        while not fut.done():
            pass
        fut.wait()

    counts = {"issuer runs it": counted(dist.all_reduce),
              "issuer asleep": counted(lambda t: dist.all_reduce(t, async_op=True).get_future().wait()),
              "issuer computing": counted(busy),
              "issuer computing, main thread asleep": counted(busy, on_thread=True)}
    dist.barrier()
    return counts


def test_idle_helpers_split_while_the_ranks_compute_is_idle():
    env = {**TRANSPORTS["shm"], "ONECCL_BIND_PT_IDLE_HELPERS": "1", "ONECCL_BIND_PT_HELPERS": "0",
           "ONECCL_BIND_PT_SHM_SINGLE_COPY": "0", "CCL_LOCAL_SIZE": "1", "ONECCL_BIND_PT_IDLE_CPUS": "2"}
    for rank, counts in enumerate(run_ranks(_idle_by_compute, 2, env=env, timeout=300)):
        (splits, idle) = counts["issuer runs it"]
        assert splits > 0 and idle == splits, (rank, counts)
        # Asleep for two readings in a row, 200 us apart: the first splits may not know it yet.
        (splits, idle) = counts["issuer asleep"]
        assert splits > 0 and idle >= splits // 4, (rank, counts)
        # Computing: hardly any (of 48 splits) but while the issuer truly waits: as it takes the
        # Future it may wait for the lock that the op's poll holds (seen: 4 with a CPU hog beside).
        assert counts["issuer computing"][1] <= 8, (rank, counts)
        assert counts["issuer computing, main thread asleep"][1] <= 8, (rank, counts)


@pytest.mark.parametrize("allowed, running, awake, local, most, share", [
    (16, 2, 0, 2, 6, 6),    # DDP's last buckets on 2 ranks x 8 threads: only the ops' threads run
    (16, 18, 0, 2, 6, 0),   # its backward pass: 16 torch threads and the 2 ops' threads
    (16, 14, 6, 2, 6, 6),   # the ranks' own helpers, awake, count as idle cores
    (16, 16, 2, 2, 6, 2),   # 16 runnable of which 2 x 2 helpers: 4 free, 2 each
    (16, 10, 0, 4, 6, 1),   # 6 free cores among 4 ranks
    (2, 3, 0, 1, 4, 0),     # more runnable than CPUs
    (2, 1, 0, 1, 4, 1),
    (8, 0, 0, 0, 6, 6),     # no local ranks known: one
    (16, 1, 0, 1, 0, 0),    # none asked for
])
def test_idle_helpers_share_the_cores_the_host_leaves_idle(allowed, running, awake, local, most, share):
    from oneccl_bind_pt import _C

    assert _C._idle_share(allowed, running, awake, local, most) == share


def test_runnable_threads_count_busy_processes():
    # Three busy processes are always runnable, and so is the reader: 4 or more (the kernel sums
    # its CPUs' queues without a lock, so one read may miss a process moving between them).
    from oneccl_bind_pt import _C

    spin = "import sys; print('spinning', flush=True)\nwhile True: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        for h in hogs:
            assert h.stdout.readline().strip() == "spinning"
        reads = [_C._runnable_threads() for _ in range(50)]
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert min(reads) >= 1 and max(reads) >= 4, reads


def _default_helpers(rank, world):
    from oneccl_bind_pt import _C

    t = torch.ones(4 << 20)
    dist.all_reduce(t)
    assert t[0].item() == t[-1].item() == world
    return _C.helpers(), helper_threads(), torch.get_num_threads(), os.environ.get("CCL_LOCAL_SIZE")


def _expected_helpers(local, compute, affinity=None, workers=0):
    # The rule of src/helpers.hpp, for this machine's CPUs (a container's limits aside: the
    # callers skip where the description names a CPU quota).
    cpus = len(affinity or os.sched_getaffinity(0))
    pinned = cpus < os.cpu_count() and cpus * local <= os.cpu_count()
    mine = cpus if pinned else max(1, cpus // local)
    return min(6, max(0, mine - max(1, compute) - workers))  # kMaxHelpers


def test_default_helpers_leave_the_cores_compute_uses():
    for rank, (said, threads, compute, local) in enumerate(run_ranks(_default_helpers, 2, timeout=300)):
        if "a CPU quota" in said:
            pytest.skip(f"a container's CPU quota decides here: {said}")
        want = _expected_helpers(int(local), compute)
        assert said.startswith(f"helpers {want} ("), (rank, said, local, compute)
        assert threads == want, f"rank {rank}: {threads} helper threads, {said}"


@pytest.mark.parametrize("local, threads, pinned, workers", [(1, 1, False, 0), (2, 1, False, 0), (1, 64, False, 0),
                                                             (1, 1, True, 0), (4, 1, True, 0), (1, 1, False, 1)],
                         ids=["alone-1-thread", "2-ranks-1-thread", "alone-64-threads", "pinned-to-one-cpu",
                              "one-cpu-shared-by-4-ranks", "alone-1-thread-1-oneccl-worker"])
def test_helper_count_follows_the_cores_a_rank_has(local, threads, pinned, workers):
    cpus = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_WORKER_", "ONECCL_BIND_PT_HELPERS"))}
    env.update(CCL_LOCAL_SIZE=str(local), OMP_NUM_THREADS=str(threads))
    if workers:  # oneCCL's worker threads take spare cores too
        env.update(CCL_WORKER_OFFLOAD="1", CCL_WORKER_COUNT=str(workers))
    cmd = [sys.executable, "-c", "import oneccl_bind_pt, torch; print(oneccl_bind_pt._C.helpers(), torch.get_num_threads())"]
    if pinned:
        if len(cpus) < 2:
            pytest.skip("one CPU: no narrower affinity to pin to")
        cmd = ["taskset", "-c", str(cpus[0]), *cmd]
    # From /, so that the installed package is imported, not this checkout.
    said = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    compute = int(said.rsplit(" ", 1)[1])
    if "a CPU quota" in said:
        pytest.skip(f"a container's CPU quota decides here: {said}")
    want = _expected_helpers(local, compute, affinity=cpus[:1] if pinned else None, workers=workers)
    assert said.startswith(f"helpers {want} ("), said
    assert ("oneCCL worker" in said) == (workers > 0), said
    if (local, threads, pinned, workers) == (1, 1, False, 0) and len(cpus) >= 2 and len(cpus) == os.cpu_count():
        assert want >= 1, "a rank alone with one torch thread on a multi-core host gets a helper"


def test_idle_helpers_auto_take_the_cores_but_the_ops_thread():
    # ONECCL_BIND_PT_IDLE_HELPERS=auto: every core of the rank but the op's own thread and the
    # helpers it always has, at most 6 helpers in all; with every core computing (the torch
    # threads take them all) the helpers proper are none and the idle ones the rest.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_WORKER_", "ONECCL_BIND_PT_HELPERS"))}
    cpus = len(os.sched_getaffinity(0))
    env.update(CCL_LOCAL_SIZE="1", OMP_NUM_THREADS=str(cpus), ONECCL_BIND_PT_IDLE_HELPERS="auto")
    cmd = [sys.executable, "-c", "import oneccl_bind_pt; print(oneccl_bind_pt._C.helpers())"]
    said = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    if "a CPU quota" in said:
        pytest.skip(f"a container's CPU quota decides here: {said}")
    idle = min(6, cpus - 1)
    assert said.startswith("helpers 0 (") and f"; up to {idle} more while this rank's compute or the host is idle (" in said, said
    assert said.endswith("ONECCL_BIND_PT_IDLE_HELPERS=auto)"), said


# ---- oneCCL's worker threads ----------------------------------------------------------------
# Where oneCCL carries the collectives (ranks on other hosts, or ONECCL_BIND_PT_SHM=0) and a
# rank has spare cores, oneCCL's worker threads progress its ops (oneccl_bind_pt/_env.py,
# worker_plan; the rule's cases are in test_package.py). This machine has no spare core, so
# ONECCL_BIND_PT_WORKERS=1 forces one here: ops through a worker, checked byte for byte.

def _with_workers(rank, world, count):
    import glob

    from oneccl_bind_pt import _env

    expect_transport()
    said = {v: os.environ.get(v) for v in _env.WORKER_VARS}
    assert said["CCL_WORKER_OFFLOAD"] == ("1" if count else "0") and said["CCL_WORKER_COUNT"] == (str(count) if count else None), said
    assert _env.workers_why == "ONECCL_BIND_PT_WORKERS", _env.workers_why
    failures = []
    n = (1 << 18) + 5
    for dtype, op in ((torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int32, "MAX")):
        t = data(rank, dtype, (n,), salt=n, op=op)
        work = dist.all_reduce(t, op=reduce_op(op), async_op=True)
        work.wait()
        if not same_bytes(t, expected_reduction([data(r, dtype, (n,), salt=n, op=op) for r in range(world)], op, world)):
            failures.append(f"all_reduce {dtype} {op}")
    mine = raw_data(rank, torch.uint8, (n,))
    out = torch.empty(world * n, dtype=torch.uint8)
    all_gather_single(out, mine)
    if not torch.equal(out, torch.cat([raw_data(r, torch.uint8, (n,)) for r in range(world)])):
        failures.append("all_gather")
    b = mine.clone()
    dist.broadcast(b, src=world - 1)
    if not torch.equal(b, raw_data(world - 1, torch.uint8, (n,))):
        failures.append("broadcast")
    sent = torch.cat([raw_data(rank, torch.uint8, (n,), salt=q) for q in range(world)])
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent)
    if not torch.equal(got, torch.cat([raw_data(q, torch.uint8, (n,), salt=rank) for q in range(world)])):
        failures.append("all_to_all_single")
    return failures, len(glob.glob("/proc/self/task/*"))


def test_oneccl_worker_threads_carry_collectives_exactly():
    threads = {}
    for count in (0, 1):
        env = {**TRANSPORTS["oneccl"], "ONECCL_BIND_PT_WORKERS": str(count)}
        ranks = run_ranks(_with_workers, 2, count, env=env, timeout=300)
        assert [failures for failures, _ in ranks] == [[], []], (count, ranks)
        threads[count] = [n for _, n in ranks]
    # oneCCL started the worker: one thread more in each rank than without
    assert [b - a for a, b in zip(threads[0], threads[1])] == [1, 1], threads


@pytest.mark.parametrize("var, value, accepts", [
    ("ONECCL_BIND_PT_HELPERS", "many", "from 0 to 64"), ("ONECCL_BIND_PT_IDLE_HELPERS", "many", "from 0 to 64 or auto"),
    ("ONECCL_BIND_PT_IDLE_CPUS", "0", "from 1 to 65536")])
def test_an_unknown_helper_count_fails_the_group_with_its_name(var, value, accepts):
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_runs, 2, env={var: value}, timeout=120)
    text = str(caught.value)
    assert f"ValueError: {var}={value} is not a whole number {accepts}" in text, text
