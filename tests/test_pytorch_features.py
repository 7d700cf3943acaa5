"""PyTorch features built on c10d work on ccl as they do on gloo.

DDP comm hooks whose Future callbacks issue and wait on collectives (PowerSGD),
TORCH_DISTRIBUTED_DEBUG=DETAIL, callbacks that wait on other Futures, and functional
collectives (eager and under torch.compile): each
is run on ccl and on gloo with the same inputs, in the same processes.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import TRANSPORTS, announce, await_announcement, expect_transport, run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 4))


def _train(rank, group, hook=None, state=None, steps=6):
    # One bucket: with several, a hook's callbacks (on a completion thread) and
    # the backward pass (issuing the next bucket) would race to issue
    # collectives on every backend, gloo included.
    model = DDP(_model(), process_group=group)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _powersgd_state(group):
    return powerSGD.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                  min_compression_rate=0.5, random_seed=0)


# Kept until the ranks exit: gloo's group joins its worker threads when
# destroyed, and a future chain may drop the last reference on one of them.
_KEEP = []


def _powersgd(rank, world):
    gloo = dist.new_group(backend="gloo")
    _KEEP.append(gloo)
    # (batched_powerSGD_hook fails inside torch 2.13 itself, on gloo too: its
    # _orthogonalize asserts on the 2-D matrix the hook passes.)
    states = [_powersgd_state(None), _powersgd_state(gloo)]
    _KEEP.extend(states)
    ccl = _train(rank, None, powerSGD.powerSGD_hook, states[0])
    ref = _train(rank, gloo, powerSGD.powerSGD_hook, states[1])
    torch.testing.assert_close(ccl, ref, rtol=1e-6, atol=1e-7)
    return ccl.sum().item()


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_powersgd_hooks_match_gloo(world):
    # Their callbacks issue an allreduce and wait on it: this hung on the
    # thread that completes collectives.
    results = run_ranks(_powersgd, world, timeout=240)
    assert all(r == results[0] for r in results), results


def _hook_waits_inside(state, bucket):
    """Averages with a world size found by a synchronous all_reduce inside the callback."""
    group = state
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()

    def divide(f):
        count = torch.ones(1)
        dist.all_reduce(count, group=group)  # issued and waited on inside a callback
        return f.value()[0].div_(count)

    return fut.then(divide)


def _hook_issues_and_waits(rank, world):
    gloo = dist.new_group(backend="gloo")
    ccl_group = dist.group.WORLD
    ccl = _train(rank, None, _hook_waits_inside, ccl_group)
    ref = _train(rank, gloo, _hook_waits_inside, gloo)
    plain = _train(rank, gloo)  # the hook computes DDP's own average
    torch.testing.assert_close(ccl, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ccl, plain, rtol=1e-5, atol=1e-6)
    return True


def test_ddp_hook_callback_issues_and_waits_on_a_collective():
    assert all(run_ranks(_hook_issues_and_waits, 2, timeout=240))


def _callback_waits_on_later_future(rank, world, backend_group):
    group = dist.new_group(backend="gloo") if backend_group == "gloo" else None
    a = torch.full((4,), rank + 1.0)
    b = torch.full((4,), 10.0 * (rank + 1))
    fa = dist.all_reduce(a, group=group, async_op=True).get_future()
    fb = dist.all_reduce(b, group=group, async_op=True).get_future()
    start = time.monotonic()
    # fa's callback waits on fb, whose completion comes after fa's.
    total = fa.then(lambda f: f.value()[0] + fb.wait()[0]).wait()
    return total.tolist(), time.monotonic() - start


def test_callback_waits_on_the_future_of_an_earlier_issued_op():
    ccl = run_ranks(_callback_waits_on_later_future, 2, "ccl", pg_timeout=120)
    gloo = run_ranks(_callback_waits_on_later_future, 2, "gloo")
    assert [v for v, _ in ccl] == [v for v, _ in gloo] == [[33.0] * 4] * 2
    # A deadlock would end at the group timeout (120 s); two small allreduces take far less,
    # even on a loaded machine.
    assert all(elapsed < 60 for _, elapsed in ccl), ccl


def _wait_after_get_future(rank, world, backend_group):
    """A Future taken before wait(): once wait() returns, the Future is done and its then()
    callbacks have run, as gloo completes the Future (running them) before the Work."""
    group = dist.new_group(backend="gloo") if backend_group == "gloo" else None
    seen = []
    for _ in range(3):
        t = torch.full((4,), rank + 1.0)
        work = dist.all_reduce(t, group=group, async_op=True)
        fut = work.get_future()
        ran = []

        def slow(f, ran=ran):
            time.sleep(0.05)  # the callback takes a while: wait() must not return before it ends
            ran.append(f.value()[0].tolist())
            return f.value()

        fut.then(slow)
        work.wait()
        seen.append((fut.done(), fut.value()[0].tolist(), ran))
    return seen


def test_wait_returns_after_the_futures_callbacks_as_gloos():
    ccl = run_ranks(_wait_after_get_future, 2, "ccl", pg_timeout=60)
    gloo = run_ranks(_wait_after_get_future, 2, "gloo")
    assert ccl == gloo == [[(True, [3.0] * 4, [[3.0] * 4])] * 3] * 2, (ccl, gloo)


def _computing_callback(rank, world, waits_on_own_op):
    """Two ops complete together; the first one's callback computes for a while (on rank 0 only)
    before it issues a collective, the second's issues one at once. Each rank must issue them in
    the same order (first callback's, then second's), or the two collectives pair up wrongly.

    With `waits_on_own_op`, the first callback first issues a small collective and waits on its
    Future (PowerSGD's pattern): on rank 1 that wait lasts as long as rank 0 computes, and the
    callback is not blocked on its lane during it, nor in the moment after it."""
    issued = []

    def first(f):
        if rank == 0:
            end = time.perf_counter() + 0.5  # longer than the 200 ms over which the backend judges it
            while time.perf_counter() < end:  # computing, on this thread: not blocked on its lane
                pass
        if waits_on_own_op:
            own = torch.ones(2)
            dist.all_reduce(own, async_op=True).get_future().wait()
            issued.append(("own", own, None))
        x = torch.full((1000,), rank + 1.0)
        issued.append(("first", x, dist.all_reduce(x, async_op=True)))
        return f.value()

    def second(f):
        y = torch.full((1000,), 100.0 * (rank + 1))
        issued.append(("second", y, dist.all_reduce(y, async_op=True)))
        return f.value()

    # The rank that chains first has its ops in flight then, so its callbacks run on the
    # backend's callback threads, the second one in line behind the first. Without
    # `waits_on_own_op` that is rank 0, which computes; with it, rank 1, which waits.
    # (On the other rank both ops are done when it chains, and then() runs each callback at
    # once on this thread, in this order.)
    chains_first = 1 if waits_on_own_op else 0
    if rank != chains_first:
        await_announcement("chained")
    a, b = torch.ones(8), torch.ones(8)
    works = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
    fa = works[0].get_future().then(first)
    fb = works[1].get_future().then(second)
    if rank == chains_first:
        announce("chained")
    fa.wait()
    fb.wait()
    got = {}
    for name, tensor, work in issued:
        if work is not None:
            work.wait()
        got[name] = sorted(set(tensor.tolist()))
    return [name for name, _, _ in issued], got


@pytest.mark.parametrize("waits_on_own_op", [False, True], ids=["computes", "computes-then-waits-on-its-op"])
def test_a_computing_callback_keeps_the_order_of_collectives(transport, waits_on_own_op):
    want_order = ["own", "first", "second"] if waits_on_own_op else ["first", "second"]
    want = {"own": [2.0], "first": [3.0], "second": [300.0]} if waits_on_own_op else {"first": [3.0], "second": [300.0]}
    for order, got in run_ranks(_computing_callback, 2, waits_on_own_op, pg_timeout=60, env=TRANSPORTS[transport]):
        assert order == want_order, order
        assert got == want, got


def _callback_wait_is_bounded(rank, world):
    t = torch.ones(4)
    fut = dist.all_reduce(t, async_op=True).get_future()
    if rank == 1:
        fut.wait()
        await_announcement("rank 0 done")  # never issues the collective rank 0's callback waits for
        return "absent"

    def wait_inside(f):
        return dist.all_reduce(torch.ones(2), async_op=True).get_future().wait()

    try:
        start = time.monotonic()
        try:
            fut.then(wait_inside).wait()
        except RuntimeError as e:
            assert "did not complete within 3000 ms" in str(e), str(e)
            return time.monotonic() - start
        raise AssertionError("the wait inside the callback returned although the peer never joined")
    finally:
        announce("rank 0 done")


def test_a_wait_inside_a_callback_ends_at_the_group_timeout():
    waited, absent = run_ranks(_callback_wait_is_bounded, 2, pg_timeout=3)
    assert absent == "absent"
    # Room for a loaded machine; the peer stays absent until rank 0 is done, so a
    # hang would show here or as run_ranks' timeout.
    assert 2.5 < waited < 30, waited


def _detail_mode(rank, world):
    from torch.distributed.distributed_c10d import _get_default_group

    backend = _get_default_group()._get_backend(torch.device("cpu"))
    assert type(backend).__name__ == "_ProcessGroupWrapper", type(backend)
    params = _train(rank, None)
    # The mismatch a user turns DETAIL on for: 4 elements on rank 0, 6 elsewhere.
    t = torch.ones(4 if rank == 0 else 6)
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        assert "Detected mismatch between collectives on ranks" in str(e), str(e)
    else:
        raise AssertionError(f"rank {rank}: a mismatched all_reduce returned {t.tolist()}")
    u = torch.full((3,), rank + 1.0)
    dist.all_reduce(u)  # checked before it reached the backend: the group still works
    assert u.tolist() == [world * (world + 1) / 2] * 3
    return params.tolist()  # plain lists: a tensor would be shared with the test through an fd


def _plain(rank, world):
    return _train(rank, None).tolist()


@pytest.mark.parametrize("transport", ["shm", "oneccl"])
def test_debug_detail_checks_collectives(monkeypatch, transport):
    # gloo's reference comes from a run without DETAIL: under DETAIL, DDP on a
    # gloo group crashes inside torch 2.13 (its logger casts the wrapped backend
    # to ProcessGroupGloo).
    reference = run_ranks(_plain, 2, backend="gloo")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the ranks inherit it
    # Across hosts (oneCCL) DETAIL is what catches a size mismatch: check it there too.
    env = {"ONECCL_BIND_PT_SHM": "0"} if transport == "oneccl" else None
    for got, want in zip(run_ranks(_detail_mode, 2, timeout=240, env=env), reference):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)


def _sizes(world, rank):
    """Uneven all-to-all: what rank sends to each peer, and what it receives from each."""
    send = [1 + (rank + 2 * q) % 3 for q in range(world)]
    recv = [1 + (q + 2 * rank) % 3 for q in range(world)]
    return send, recv


def _functional_collectives(rank, world):
    """torch's functional collectives (what tensor parallelism, DTensor and compiled code call),
    eager and under torch.compile, on the ccl group and on a gloo group of the same processes."""
    import torch.distributed._functional_collectives as funcol

    expect_transport()
    gloo = dist.new_group(backend="gloo")

    def scaled_sum(t, group):
        # Traced: the all_reduce becomes a graph node and its wait another.
        return funcol.all_reduce(t * 2, "sum", group) + 1

    results = {}
    for name, group in (("ccl", dist.group.WORLD), ("gloo", gloo)):
        x = torch.arange(12.0) + 10 * rank
        send, recv = _sizes(world, rank)
        uneven = torch.arange(float(sum(send))) + 100 * rank
        compiled = torch.compile(scaled_sum, backend="aot_eager", fullgraph=True)
        results[name] = {
            "all_reduce sum": funcol.all_reduce(x, "sum", group),
            "all_reduce max": funcol.all_reduce(x * (-1) ** rank, "max", group),
            "all_gather": funcol.all_gather_tensor(x, 0, group),
            "reduce_scatter": funcol.reduce_scatter_tensor(x * (rank + 1), "sum", 0, group),
            "all_to_all": funcol.all_to_all_single(x, None, None, group),
            "all_to_all uneven": funcol.all_to_all_single(uneven, recv, send, group),
            "broadcast": funcol.broadcast(x, world - 1, group),
            "compiled all_reduce": compiled(x, group),
        }
        results[name] = {op: t.wait() if hasattr(t, "wait") else t for op, t in results[name].items()}
        results[name] = {op: t.tolist() for op, t in results[name].items()}
    return results


# Functional collectives reach the backend through other entry points than torch.distributed's
# (allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced, alltoall_base with splits):
# the same values as gloo's, eager and traced.
@pytest.mark.parametrize("world", [2, 3])
def test_functional_collectives_match_gloo(world, transport):
    for rank, got in enumerate(run_ranks(_functional_collectives, world, env=TRANSPORTS[transport], timeout=300)):
        assert got["ccl"] == got["gloo"], (rank, {op: (got["ccl"][op], got["gloo"][op]) for op in got["ccl"]
                                                  if got["ccl"][op] != got["gloo"][op]})
        assert len(got["ccl"]["all_gather"]) == 12 * world, got["ccl"]["all_gather"]
