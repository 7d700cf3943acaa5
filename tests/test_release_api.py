"""What a torch release added to the c10d Backend API, through this backend (src/compat.hpp).

On a release without the feature the test is skipped; tests/test_other_releases.py runs
this file on every supported release.
"""

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from harness import announce, await_announcement, run_ranks


def _at_least(major, minor):
    return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


def test_readme_feature_table_is_what_this_torch_has():
    """README's feature table (meta/releases.yaml `features`) says from which release torch has
    each name; the torch this runs on must agree."""
    import importlib
    import pathlib

    import yaml

    meta = yaml.safe_load((pathlib.Path(__file__).resolve().parent.parent / "meta" / "releases.yaml").read_text())
    for feature in meta["features"]:
        if "attr" not in feature:
            continue
        module, _, name = feature["attr"].rpartition(".")
        try:
            owner = importlib.import_module(module)
        except ImportError:  # torch.distributed.ProcessGroup: a class, not a module
            module, _, cls = module.rpartition(".")
            owner = getattr(importlib.import_module(module), cls)
        since = tuple(int(x) for x in feature["since"].split("."))
        assert hasattr(owner, name) == _at_least(*since), (feature["attr"], torch.__version__, feature["since"])


needs_2_14 = pytest.mark.skipif(not _at_least(2, 14), reason=f"torch 2.14 added it; this is torch {torch.__version__}")
needs_2_15 = pytest.mark.skipif(not _at_least(2, 15), reason=f"torch 2.15 added it; this is torch {torch.__version__}")


def _gather_single(rank, world):
    t = torch.arange(3, dtype=torch.float32) + 10 * rank
    out = torch.empty(world * 3) if rank == 1 else None
    dist.gather_single(t, out, dst=1)
    if rank == 1:
        return out.tolist() == [10.0 * r + i for r in range(world) for i in range(3)]
    return True


@needs_2_14
def test_gather_single_fills_one_tensor_on_the_root():
    # Without an override, torch's default raises "Backend ccl does not support gather_single".
    assert all(run_ranks(_gather_single, 3))


def _work_timeout(rank, world):
    work = dist.all_reduce(torch.ones(4), async_op=True)
    work.wait()
    return work.timeout


@needs_2_14
def test_work_timeout_is_the_groups():
    # torch's default Work.timeout raises "This Backend doesn't support getTimeout."
    assert run_ranks(_work_timeout, 2, pg_timeout=42) == [datetime.timedelta(seconds=42)] * 2


def _recorded_states():
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return [e["state"] for e in json.loads(_dump_fr_trace_json(backend="ccl")).get("entries", [])]


def _flight_recorder(rank, world):
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        await_announcement("recorded")  # rank 0's next op cannot finish before this
    work = dist.all_reduce(torch.ones(4), async_op=True)
    in_flight = _recorded_states()[-1] if rank == 0 else None
    if rank == 0:
        announce("recorded")
    work.wait()
    return in_flight, _recorded_states()


@needs_2_15
def test_flight_recorder_records_completion_not_issue():
    """torch 2.15 attaches its FlightRecorder to every group; with the backend's completion
    hooks it marks an op completed when it is, not when it was issued."""
    (in_flight, states0), (_, states1) = run_ranks(_flight_recorder, 2)
    assert in_flight != "completed", states0
    assert states0[-2:] == ["completed", "completed"] and states1[-2:] == ["completed", "completed"]


def _abort_hooks(rank, world):
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    seen = []

    def failing_hook():
        seen.append("failing hook")
        raise RuntimeError("a hook's own bug")

    pg.register_abort_hook(1, lambda: seen.append("hook 1"))
    pg.register_abort_hook(2, lambda: seen.append("hook 2 (unregistered)"))
    pg.register_abort_hook(3, failing_hook)
    pg.unregister_abort_hook(2)
    supports = backend.supports_abort_hooks if _at_least(2, 15) else None  # a property
    dist.all_reduce(torch.ones(4))  # hooks are not run for an op that completes
    if rank == 1:
        await_announcement("rank 0 saw the timeout")  # never joins the next all_reduce
        return seen, supports
    work = dist.all_reduce(torch.ones(1 << 16), async_op=True)  # rank 1 is not there: times out
    try:
        work.wait()
    except dist.DistBackendError as e:
        seen.append("wait raised: " + ("timed out" if "Timed out" in str(e) else str(e)))
    finally:
        announce("rank 0 saw the timeout")
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(4))  # the group is broken: the hooks do not run again
    return seen, supports


@needs_2_14
@pytest.mark.parametrize("transport", ["1", "0"], ids=["shm", "oneccl"])
def test_abort_hooks_run_once_before_a_timeout_is_raised(transport):
    (seen, supports), (peer_seen, _) = run_ranks(_abort_hooks, 2, pg_timeout=2,
                                                   env={"ONECCL_BIND_PT_SHM": transport})
    # In id order; the failing hook is reported as a warning and the op's own error follows.
    assert seen == ["hook 1", "failing hook", "wait raised: timed out"], seen
    assert peer_seen == [], peer_seen  # its group never failed while it ran
    assert supports is (True if _at_least(2, 15) else None), supports


def _split(rank, world):
    before = dist.group.WORLD._get_backend(torch.device("cpu")).supports_splitting
    # A rank's place in its list is its rank in the new group (torch maps it so); a list out
    # of order tells that apart from sorting.
    group = dist.split_group(split_ranks=[[2, 0], [1]])
    t = torch.arange(4, dtype=torch.float32) + 10 * rank
    dist.all_reduce(t, group=group)
    gathered = [torch.empty(2) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
    first = torch.full((3,), float(rank))
    dist.broadcast(first, group_src=0, group=group)
    dist.barrier()  # the parent group still works beside its child
    return (before, dist.get_rank(group), dist.get_world_size(group), t.tolist(), [g.tolist() for g in gathered],
            first.tolist())


@needs_2_15  # split_group needs a device before 2.15, for every backend (gloo too)
@pytest.mark.parametrize("transport", ["1", "0"], ids=["shm", "oneccl"])
def test_split_group_gives_what_gloo_gives(transport):
    ccl = run_ranks(_split, 3, env={"ONECCL_BIND_PT_SHM": transport})
    gloo = run_ranks(_split, 3, backend="gloo")
    assert [r[0] for r in ccl] == [True] * 3, ccl
    assert [r[1:] for r in ccl] == [r[1:] for r in gloo], (ccl, gloo)
    assert [r[1] for r in ccl] == [1, 0, 0], ccl  # rank 2 leads [2, 0]
