"""Where PyTorch defines the behaviour, ccl gives what gloo gives on the same inputs.

Expected values here come from gloo, not from our reading of the API: every
scenario runs once on a gloo group and once on the ccl group, in the same
processes, and the results (tensors, the values Futures carry, objects) must
be equal. A layout misread on both sides of a hand-written test (as
all_gather_coalesced's once was) cannot pass this way. The ccl side runs on both
transports of one host (the `transport` fixture), against the same gloo results. The
scenarios are in vs_gloo.py; test_two_hosts.py runs them across two hosts.
"""

from __future__ import annotations

import pytest

from harness import TRANSPORTS, expect_transport, run_ranks
from vs_gloo import SCENARIOS, compare_with_gloo


def _compare_all(rank, world):
    expect_transport()
    return compare_with_gloo(rank, world)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def reports(request, transport):
    return request.param, run_ranks(_compare_all, request.param, timeout=300, env=TRANSPORTS[transport])


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_as_gloo(reports, name):
    world, by_rank = reports
    problems = {rank: report[name] for rank, report in enumerate(by_rank) if report[name]}
    assert not problems, f"world {world}: {problems}"
