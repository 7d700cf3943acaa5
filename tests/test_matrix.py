"""Collectives x reduce ops x dtypes on 2 real ranks, and what the world size changes on 3
and 4, through both transports (matrix.cases() says which case runs where, and why).

All ranks are on this host, so the default is the shared-memory transport, through its
staging buffers ("shm") or reading peers' tensors directly ("cma", forced for every size
here); ONECCL_BIND_PT_SHM=0 sends the same cases through oneCCL. Each case checks its
values against results worked out from the inputs, so passing on both paths
also means both paths agree.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, RankFailure, all_gather_single, expect_transport, run_ranks
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


ISA_FLAGS = {"baseline": set(), "avx2": {"avx2", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
KERNEL_PATHS = [(isa, copy) for isa in ISA_FLAGS for copy in ("loop", "glibc")]
ODD = 3 * 4096 + 37  # elements


def _kernel_path(rank, world, isa, copy):
    from oneccl_bind_pt import _C

    expect_transport()  # the kernels and copies are the shared-memory transport's
    chosen = _C.kernels()
    assert chosen.startswith(f"kernels {isa} (ONECCL_BIND_PT_KERNELS;") and f"copy {'glibc' if copy == 'glibc' else 'loop ' + isa} (" in chosen, chosen
    failures = []
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
