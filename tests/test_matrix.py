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

from harness import run_ranks
from matrix import MOVABLE, MOVEMENTS, REDUCE_OPS, REDUCIBLE, REDUCTIONS, cases, run_all

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
