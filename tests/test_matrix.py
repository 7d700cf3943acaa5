"""Every collective x reduce op x dtype, on 2, 3 and 4 real ranks, through both transports.

All ranks are on this host, so the default is the shared-memory transport;
ONECCL_BIND_PT_SHM=0 sends the same cases through oneCCL. Each case checks its
values against results worked out from the inputs, so passing on both paths
also means both paths agree.
"""

import functools

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from matrix import cases, run_all

CASE_IDS = [c.id for c in cases()]
PATHS = {"shm": {}, "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}


def _run_all_on(rank, world, path):
    # A case list that silently ran on the other transport would prove nothing.
    taken = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert taken._path("allreduce", 64) == path, (taken._path("allreduce", 64), path)
    return run_all(rank, world)


@functools.lru_cache(maxsize=None)
def matrix_results(world, path):
    # One launch per world size and path runs the whole matrix; items below report each case.
    return run_ranks(_run_all_on, world, path, timeout=900, env=PATHS[path])


@pytest.mark.timeout(1200)  # the first item of a (world, path) pays its launch (up to 900 s)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(case_id, world, path):
    per_rank = matrix_results(world, path)
    failures = {rank: r[case_id] for rank, r in enumerate(per_rank) if r[case_id] is not None}
    assert not failures, failures
