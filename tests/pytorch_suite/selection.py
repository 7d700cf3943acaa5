"""Which cases run where: the plans tests/test_pytorch_suite.py and `python -m pytorch_suite check` run.

91 of the suite's 285 cases spawn ranks on CPU, the same 91 at world size 2
and 3 (the "_group" variants need 8 ranks; the rest need GPUs); a case skipped
before spawning costs nothing. A spawning case costs 5-45 s on the 2-core CI
machine kind, almost all of it each rank importing torch, so a plan's cost is
about its number of cases. The whole suite is 12-36 min per backend and world
size there, by load: too much for every CI run, hence:

- ci-ws2 and ci-ws3, run by default: 9 min 11 s together with the checks
  that spawn nothing (ci-ws2 404 s, ci-ws3 131 s), measured there while a
  whole-suite gloo run shared the cores for 6 of those minutes; about a
  minute per 6 cases;
- oneccl-ws2, run by default: 22 of ci-ws2's cases (each collective and p2p form once,
  the barrier and its timeout, DDP, futures) on the oneCCL path (ONECCL_BIND_PT_SHM=0), the
  one every group across hosts takes; 34 s forked;
- full-ws2 and full-ws3, the whole suite, with --runslow (and by hand);
- smoke, a minute or so: the plan a second torch release's environment runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    name: str
    world_size: int
    cases: tuple[str, ...] | None  # None: every case of the suite
    quick: bool = False  # run by default; the others are marked slow (--runslow)
    timeout: float = 3 * 3600  # for each backend's run as a whole
    # Seconds before a hung case is killed (PyTorch's own per-case overrides
    # still apply). Every case gloo passes takes well under a minute.
    case_timeout: int = 240
    # Fewer cases passing on ccl fails the plan, whatever gloo does: a run where
    # everything is skipped (a gate, a harness fault) would otherwise compare equal.
    # Set from measured counts with a margin; see PLANS.
    min_passed: int = 1
    # How each case starts its ranks: "spawn" as torch's CI does (every rank imports torch and
    # the suite again, ~6 s a case), or "fork" of the runner's process (~1 s a case; the same
    # cases passed both ways on torch 2.13.0). The plans CI runs fork; the full plans spawn.
    start: str = "spawn"
    # Where the ccl group's data goes: "shm", the default on one host (the package's shared
    # memory), or "oneccl" (ONECCL_BIND_PT_SHM=0: the path every group across hosts takes).
    transport: str = "shm"


# Set either way, so that a caller's ONECCL_BIND_PT_SHM cannot move a plan to the other one.
TRANSPORT_ENV = {"shm": {"ONECCL_BIND_PT_SHM": "1"}, "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}


# World size 2. Each collective once per thing that changes the code path
# (reduce op kinds, complex, async, a group object, the coalesced and list
# forms, argument checks), every p2p form (tags, any source, batched, the
# profiler rows of each), object collectives, DDP with and without a comm
# hook, futures, the barrier's timeout, and one case of known_issues.py (2 s), so
# that a listed case that starts passing fails CI too. Left to the full plans: the
# other reduce ops of the same op (sum/max/min/product share one path), the
# "_full_group" twins of cases kept here, and the other listed cases.
CI_WS2 = (
    "test_all_reduce_sum",
    "test_all_reduce_max",
    "test_all_reduce_product",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_complex_unsupported_ops",
    "test_all_reduce_full_group_sum",
    "test_all_reduce_coalesced_sum",
    "test_all_reduce_coalesced_max_complex_unsupported",
    "test_reduce_sum",
    "test_reduce_sum_twice",
    "test_reduce_full_group_min",
    "test_broadcast",
    "test_broadcast_full_group",
    "test_all_gather",
    "test_all_gather_complex",
    "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty",
    "test_gather",
    "test_gather_checks",
    "test_scatter",
    "test_scatter_checks",
    "test_scatter_complex",
    "test_barrier",
    "test_barrier_timeout_global",
    "test_barrier_timeout_full_group",
    "test_send_recv",
    "test_send_recv_with_tag_autograd_profiler",
    "test_send_recv_torch_profiler",
    "test_send_recv_any_source_autograd_profiler",
    "test_isend_autograd_profiler",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_all_gather_object_default_pg",
    "test_all_gather_object_subgroup",
    "test_scatter_object_list",
    "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_static_graph_api_cpu",
    "test_get_future",
    "test_destroy_group",
    "test_get_backend",
    "test_monitored_barrier_gloo_rank_0_timeout",  # listed in known_issues.py
)

# World size 3: only what a third rank changes, as PyTorch's own cases check it: roots
# other than 0 and uneven shares (broadcast, reduce, gather, scatter loop over every
# root), any source choosing between two senders, batched p2p with two peers, groups
# that leave a rank out, the barrier timing out with two absent peers. The rest of
# what a third rank could change (every op, dtype and transport at 3 and 4 ranks) is
# tests/test_matrix.py's, compared with gloo; DDP at 3 ranks is in
# tests/test_pytorch_features.py. Plus one case of known_issues.py, as in CI_WS2.
CI_WS3 = (
    "test_broadcast",
    "test_reduce_sum",
    "test_gather",
    "test_scatter",
    "test_barrier_timeout_global",
    "test_send_recv_any_source",
    "test_batch_isend_irecv_gloo",
    "test_get_rank_size_group",
    "test_all_gather_object_subgroup",
    "test_monitored_barrier_gloo_subgroup",  # listed in known_issues.py
)

# One case per area, world size 2, about a minute: for an environment built
# against another torch release, where the loader, the preskips and this list
# meet a different distributed_test.py.
SMOKE = (
    "test_all_reduce_sum",
    "test_all_gather_coalesced_simple",
    "test_barrier_timeout_global",
    "test_send_recv_with_tag_autograd_profiler",
    "test_batch_isend_irecv_gloo",
    "test_DistributedDataParallelCPU",
)

# World size 2 on the oneCCL path: each collective and p2p form once, the barrier and its
# timeout, DDP, futures; plus any source, which oneCCL refuses (known_issues.py), so the refusal
# stays listed and true.
ONECCL_WS2 = (
    "test_all_reduce_sum",
    "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex",
    "test_all_reduce_coalesced_sum",
    "test_reduce_sum",
    "test_broadcast",
    "test_all_gather",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_scatter",
    "test_barrier",
    "test_barrier_timeout_global",
    "test_send_recv",
    "test_send_recv_with_tag_autograd_profiler",
    "test_isend_autograd_profiler",
    "test_irecv",
    "test_batch_isend_irecv_gloo",
    "test_batch_isend_irecv_gloo_tags",
    "test_all_gather_object_default_pg",
    "test_DistributedDataParallelCPU",
    "test_get_future",
    "test_send_recv_any_source",  # listed in known_issues.py for this transport
)

PLANS = {
    plan.name: plan
    for plan in (
        # min_passed: every case of these lists but the known_issues.py one passes on ccl with
        # torch 2.13.0 (ci-ws3: 9 of 9 measured), less a margin of about a tenth for what another release
        # may skip; the full plans: 91 cases spawn ranks, of which 4 are known_issues.py's.
        Plan("smoke", 2, SMOKE, timeout=20 * 60, case_timeout=120, min_passed=5, start="fork"),
        Plan("ci-ws2", 2, CI_WS2, quick=True, timeout=45 * 60, case_timeout=120, min_passed=39, start="fork"),
        Plan("ci-ws3", 3, CI_WS3, quick=True, timeout=30 * 60, case_timeout=120, min_passed=8, start="fork"),
        Plan("oneccl-ws2", 2, ONECCL_WS2, quick=True, timeout=30 * 60, case_timeout=120, min_passed=19, start="fork",
             transport="oneccl"),
        Plan("full-ws2", 2, None, min_passed=78),
        Plan("full-ws3", 3, None, min_passed=78),
    )
}
