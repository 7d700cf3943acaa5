"""Every collective x reduce op x dtype, on 2, 3 and 4 real ranks."""

import functools

import pytest

from harness import run_ranks
from matrix import cases, run_all

CASE_IDS = [c.id for c in cases()]


@functools.lru_cache(maxsize=None)
def matrix_results(world):
    # One launch per world size runs the whole matrix; items below report each case.
    return run_ranks(run_all, world, timeout=900)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case(case_id, world):
    per_rank = matrix_results(world)
    failures = {rank: r[case_id] for rank, r in enumerate(per_rank) if r[case_id] is not None}
    assert not failures, failures
