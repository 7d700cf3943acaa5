"""Asynchronous work, futures, timeouts of wait(), subgroups and interleaved groups, on both
transports of one host (the `transport` fixture: shared memory and oneCCL)."""

import datetime
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from harness import TRANSPORTS, all_gather_single, announce, await_announcement, expect_transport, run_ranks


def _thread_name(tid):
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def _async_forms(rank, world):
    expect_transport()
    expect = world * (world + 1) / 2
    t = torch.full((8,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    assert work.wait()
    assert work.is_completed() and work.is_success()
    assert t.tolist() == [expect] * 8

    t = torch.full((8,), float(rank + 1))
    fut = dist.all_reduce(t, async_op=True).get_future()
    (value,) = fut.wait()
    assert value.data_ptr() == t.data_ptr() and t.tolist() == [expect] * 8

    # A chained callback runs on completion, without anyone calling wait(). On rank 0 the op is
    # still under way when it is chained (the others join only then), so the backend's threads
    # finish it, and they say whose they are (top -H, gdb, py-spy). (Elsewhere it may be done
    # already, and then() runs the callback at once on the caller's thread, as torch does.)
    if rank != 0:
        await_announcement("chained")
    t = torch.full((4,), float(rank + 1))
    ran_on = []

    def double(f):
        ran_on.append(_thread_name(threading.get_native_id()))
        return f.value()[0] * 2

    chained = dist.all_reduce(t, async_op=True).get_future().then(double)
    if rank == 0:
        announce("chained")
    assert chained.wait().tolist() == [2 * expect] * 4
    if rank == 0:
        assert ran_on == ["ccl-callbacks"], ran_on
        names = {_thread_name(int(tid)) for tid in os.listdir("/proc/self/task")}
        assert "ccl-progress" in names, names

    # Polling is_completed() alone drives the op to the end.
    t = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + 120
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed() never turned true"
    assert t.tolist() == [expect] * 4

    # Many ops in flight, waited in reverse order.
    ts = [torch.full((16,), float(rank + i)) for i in range(10)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        assert x.tolist() == [sum(r + i for r in range(world))] * 16

    out = [torch.empty(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)), async_op=True).wait()
    assert [o[0].item() for o in out] == list(range(world))
    return True


def test_async_forms(transport):
    assert all(run_ranks(_async_forms, 2, env=TRANSPORTS[transport]))
    assert all(run_ranks(_async_forms, 3, env=TRANSPORTS[transport]))


def _wait_timeout(rank, world):
    expect_transport()
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        await_announcement("wait(timeout) raised")  # joins only after the peer's wait expired
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        try:
            start = time.monotonic()
            try:
                work.wait(timeout=datetime.timedelta(milliseconds=300))
            except dist.DistBackendError as e:
                waited = time.monotonic() - start
                assert "allreduce" in str(e) and "timed out" in str(e), str(e)
                # Room for a loaded machine: the group's timeout is 60 s, a wait that
                # ignored its own would take that long (the peer joins only after it).
                assert 0.25 < waited < 30, waited
            else:
                raise AssertionError("wait(timeout) did not raise")
        finally:
            announce("wait(timeout) raised")
    # The op was left in flight and still completes.
    work.wait()
    assert t.tolist() == [3.0] * 4
    return True


def test_wait_timeout_raises_then_op_completes(transport):
    assert all(run_ranks(_wait_timeout, 2, env=TRANSPORTS[transport]))


def _subgroups(rank, world):
    # world 3: {0, 1} and {1, 2} overlap on rank 1; rank 2 is outside {0, 1}.
    g01 = dist.new_group([0, 1])
    g12 = dist.new_group([1, 2])
    for g in (g01, g12):
        if rank in dist.get_process_group_ranks(g):
            expect_transport(g)
    if rank in (0, 1):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=g01)
        assert t.tolist() == [3.0, 3.0]
        dist.broadcast(t := torch.full((2,), float(rank)), group_src=1, group=g01)
        assert t.tolist() == [1.0, 1.0]
    if rank in (1, 2):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=g12)
        assert t.tolist() == [5.0, 5.0]
        out = torch.empty(4)
        all_gather_single(out, torch.full((2,), float(rank)), group=g12)
        assert out.tolist() == [1.0, 1.0, 2.0, 2.0]
    # The world group still works beside them.
    t = torch.full((2,), 1.0)
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]
    dist.destroy_process_group(g01) if rank in (0, 1) else None
    dist.destroy_process_group(g12) if rank in (1, 2) else None
    return True


def test_subgroups(transport):
    assert all(run_ranks(_subgroups, 3, env=TRANSPORTS[transport]))


def _interleaved_groups(rank, world):
    a = dist.new_group(list(range(world)))
    b = dist.new_group(list(range(world)))
    expect_transport(b)
    for i in range(20):
        x = torch.full((32,), float(rank + i))
        y = torch.full((1024,), float(2 * rank + i))
        wx = dist.all_reduce(x, group=a, async_op=True)
        wy = dist.all_reduce(y, group=b, async_op=True)
        # Waited in the opposite order on odd ranks: groups progress independently.
        for w in ([wx, wy] if rank % 2 == 0 else [wy, wx]):
            w.wait()
        assert x[0].item() == sum(r + i for r in range(world))
        assert y[0].item() == sum(2 * r + i for r in range(world))
    return True


def test_two_groups_interleaved(transport):
    assert all(run_ranks(_interleaved_groups, 2, env=TRANSPORTS[transport]))
    assert all(run_ranks(_interleaved_groups, 4, env=TRANSPORTS[transport]))


def _tcp_sockets():
    """This process's TCP sockets: {inode: (TCP_NODELAY, local address, peer address or "listening")}."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            inode = os.readlink(f"/proc/self/fd/{fd}")
            if not inode.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    found[inode] = (sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), sock.getsockname(),
                                    "listening" if listening else sock.getpeername())
        except OSError:  # closed or reset meanwhile (the listing's own fd), or a family Python does not know
            continue
    return found


def _groups_opened_sockets(rank, world):
    before = _tcp_sockets()
    for _ in range(2):
        group = dist.new_group(list(range(world)))
        x = torch.ones(4)
        dist.all_reduce(x, group=group)
        assert x.tolist() == [float(world)] * 4
    expect_transport(group)
    return [v for k, v in _tcp_sockets().items() if k not in before]


# oneCCL's key-value store (every group's bootstrap, on both transports) sends two small requests
# and then reads: without TCP_NODELAY each such exchange waited out the peer's delayed ACK (40 ms),
# and a group took 320-520 ms to create at 2-4 ranks on one host (gloo: 2-11 ms). Every TCP socket
# a group's creation opens must send at once, listeners included (their connections inherit it).
def test_group_creation_sockets_send_at_once(transport):
    for rank, opened in enumerate(run_ranks(_groups_opened_sockets, 3, env=TRANSPORTS[transport])):
        assert opened, f"rank {rank}: creating two groups opened no TCP socket"
        slow = [s for s in opened if not s[0]]
        assert not slow, f"rank {rank}: sockets without TCP_NODELAY: {slow}"


def _direct_backend(rank, world):
    # torch.distributed.ProcessGroupCCL(store, rank, size, timeout), as torch-ccl offered.
    store = dist.PrefixStore("direct/", dist.distributed_c10d._get_default_store())
    pg = dist.ProcessGroupCCL(store, rank, world, datetime.timedelta(seconds=30))
    assert pg.name() == "ccl", pg.name()
    expect_transport(pg)
    t = torch.full((3,), float(rank + 1))
    pg.allreduce([t]).wait()
    assert t.tolist() == [world * (world + 1) / 2] * 3
    return True


def test_construct_backend_directly(transport):
    assert all(run_ranks(_direct_backend, 2, env=TRANSPORTS[transport]))


def _deprecated_names(rank, world):
    expect_transport()
    # torch 2.13 renamed these; code written for older torch keeps calling them.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = torch.empty(2 * world)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        assert out.tolist() == [float(r) for r in range(world) for _ in range(2)]
        share = torch.empty(2)
        dist.reduce_scatter_tensor(share, torch.arange(2.0 * world) + rank)
        base = torch.arange(2.0 * world)[2 * rank : 2 * rank + 2]
        assert share.tolist() == (base * world + sum(range(world))).tolist()
    return True


def test_deprecated_collective_names(transport):
    assert all(run_ranks(_deprecated_names, 2, env=TRANSPORTS[transport]))


# The list-coalesced forms (all_gather_coalesced, all_reduce_coalesced) are
# compared with gloo's results in test_vs_gloo.py.


def _late_peer(rank, world):
    expect_transport()
    late = 1.0
    spent = {}
    for form in ("wait", "future", "recv"):
        t = torch.ones(4)
        if rank == 1:
            await_announcement(f"waiting/{form}")
            time.sleep(late)  # the late peer: the duration under test, not a synchronisation
            if form == "recv":
                dist.send(t, 0)
            else:
                dist.all_reduce(t)
            continue
        announce(f"waiting/{form}")
        wall, cpu = time.perf_counter(), time.process_time()
        if form == "wait":
            dist.all_reduce(t)
        elif form == "future":
            dist.all_reduce(t, async_op=True).get_future().wait()
        else:
            dist.recv(t, 1)
        spent[form] = (time.process_time() - cpu, time.perf_counter() - wall)
        assert t.tolist() == [2.0 if form != "recv" else 1.0] * 4
    dist.barrier()
    return spent


def test_a_rank_waiting_for_a_late_peer_leaves_the_cpu():
    """A rank whose peer comes a second late polls ever more gently, whoever waits (wait(), the
    background thread behind a Future, a recv), instead of spinning a core through it (it did:
    a 1 s wait cost 1 s of CPU; gloo blocks). All its threads count, helpers included."""
    spent = run_ranks(_late_peer, 2, env=TRANSPORTS["shm"])[0]
    for form, (cpu, wall) in spent.items():
        assert wall >= 0.9, (form, wall)
        assert cpu < 0.25 * wall, f"{form}: {cpu:.3f} s of CPU in a {wall:.3f} s wait"


# ---- ops on the same memory take effect in issue order -----------------------------------------
# As on one CUDA stream (NCCL): an op issued while an earlier one on the same tensor is in flight
# sees its result, and the earlier one never sees the later one's writes. oneCCL runs the ops in
# flight together, and pre- and post-processing (packing, PREMUL_SUM's scaling, AVG's division)
# ran beside the transports: two async all_reduces of one 100k-element tensor through oneCCL came
# out wrong every time. gloo runs async ops concurrently on its threads (its results here differ
# from run to run), so the reference is gloo with each op waited for before the next is issued.
# Integer values: every sum, and AVG's halving, is exact in float32.

def _same_memory_chains():
    def values(rank, shape, salt):
        g = torch.Generator().manual_seed(1000 * salt + rank)
        return torch.randint(-50, 50, shape, generator=g).float()

    def issue(ops, sync):
        works = []
        for op in ops:
            w = op()
            if not isinstance(w, dist.Work):
                continue  # the reference's own step (t.div_)
            if sync:
                w.wait()
            works.append(w)
        return works

    def sum_then_sum(rank, group, sync):
        t = values(rank, (256 << 10,), 1)  # 1 MiB
        return [t], issue([lambda: dist.all_reduce(t, group=group, async_op=True)] * 2, sync)

    def avg_then_sum(rank, group, sync):
        t = values(rank, (1000,), 2)
        if group is None:  # AVG through ccl; the reference sums and halves
            ops = [lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)]
        else:
            ops = [lambda: dist.all_reduce(t, group=group, async_op=True), lambda: t.div_(2)]
        return [t], issue(ops + [lambda: dist.all_reduce(t, group=group, async_op=True)], sync)

    def sum_then_premul_sum(rank, group, sync):
        t = values(rank, (1000,), 3)
        ops = [lambda: dist.all_reduce(t, group=group, async_op=True)]
        if group is None:
            ops.append(lambda: dist.all_reduce(t, op=dist._make_nccl_premul_sum(3.0), async_op=True))
        else:
            ops += [lambda: t.mul_(3), lambda: dist.all_reduce(t, group=group, async_op=True)]
        return [t], issue(ops, sync)

    def avg_then_broadcast(rank, group, sync):
        t = values(rank, (64 << 10,), 4)
        first = (lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)) if group is None else None
        ops = [first] if first else [lambda: dist.all_reduce(t, group=group, async_op=True), lambda: t.div_(2)]
        return [t], issue(ops + [lambda: dist.broadcast(t, 1, group=group, async_op=True)], sync)

    def transposed_sum_then_sum(rank, group, sync):
        t = values(rank, (512, 300), 5).t()  # dense, not contiguous
        return [t], issue([lambda: dist.all_reduce(t, group=group, async_op=True)] * 2, sync)

    def sum_then_gather_it(rank, group, sync):
        t = values(rank, (64 << 10,), 6)
        out = torch.empty(2 * t.numel())
        return [t, out], issue([lambda: dist.all_reduce(t, group=group, async_op=True),
                                lambda: dist.all_gather_into_tensor(out, t, group=group, async_op=True)], sync)

    def gather_it_then_sum(rank, group, sync):
        t = values(rank, (64 << 10,), 7)
        out = torch.empty(2 * t.numel())
        return [t, out], issue([lambda: dist.all_gather_into_tensor(out, t, group=group, async_op=True),
                                lambda: dist.all_reduce(t, group=group, async_op=True)], sync)

    def sum_then_scatter_its_halves(rank, group, sync):
        t = values(rank, (2, 32 << 10), 8)
        out = torch.empty(32 << 10)
        halves = list(t.unbind(0)) if rank == 0 else None  # root 0 packs them: reads t
        return [t, out], issue([lambda: dist.all_reduce(t, group=group, async_op=True),
                                lambda: dist.scatter(out, halves, 0, group=group, async_op=True)], sync)

    def sum_then_send_it(rank, group, sync):
        t = values(rank, (64 << 10,), 9)
        got = torch.zeros_like(t)
        p2p = (lambda: dist.isend(t, 1, group=group)) if rank == 0 else (lambda: dist.irecv(got, 0, group=group))
        return [t, got], issue([lambda: dist.all_reduce(t, group=group, async_op=True), p2p], sync)

    return {f.__name__: f for f in (sum_then_sum, avg_then_sum, sum_then_premul_sum, avg_then_broadcast,
                                    transposed_sum_then_sum, sum_then_gather_it, gather_it_then_sum,
                                    sum_then_scatter_its_halves, sum_then_send_it)}


def _chains_on_the_same_memory(rank, world):
    expect_transport()
    gloo = dist.new_group(backend="gloo")
    wrong = {}
    for name, chain in _same_memory_chains().items():
        if rank == 1:
            # Rank 0's ops are all in flight by then: none of them can have completed.
            await_announcement(f"chain {name} issued")
        results, works = chain(rank, None, sync=False)
        if rank == 0:
            announce(f"chain {name} issued")
        for w in works:
            w.wait()
        reference, _ = chain(rank, gloo, sync=True)
        for i, (got, want) in enumerate(zip(results, reference)):
            if not torch.equal(got, want):
                bad = (got != want).nonzero()
                wrong[f"{name} result {i}"] = f"{len(bad)} of {got.numel()} elements differ, first at {bad[0].tolist()}"
    return wrong


def test_ops_on_the_same_memory_take_effect_in_issue_order(transport):
    for rank, wrong in enumerate(run_ranks(_chains_on_the_same_memory, 2, env=TRANSPORTS[transport], timeout=300)):
        assert not wrong, f"rank {rank}: {wrong}"


def _errors_of(*works):
    """Each Work's wait(): None, or the text of the DistBackendError it raised."""
    errors = []
    for w in works:
        try:
            w.wait()
            errors.append(None)
        except dist.DistBackendError as e:
            errors.append(str(e))
    return errors


def _deferred_op_behind_one_that_times_out(rank, world):
    expect_transport()
    t = torch.ones(1000)
    if rank == 1:
        await_announcement("deferred op raised")  # never joins the ops
        return None
    first = dist.all_reduce(t, async_op=True)
    second = dist.all_reduce(t, async_op=True)  # on the same tensor: starts once the first completed
    start = time.monotonic()
    errors = _errors_of(second, first)
    waited = time.monotonic() - start
    announce("deferred op raised")
    return errors, waited


def test_an_op_waiting_for_an_earlier_one_on_its_memory_fails_with_it(transport):
    # The earlier op times out (the peer never joins): the group breaks, and the op behind it
    # raises instead of waiting for good; it was never handed to the transport. (It has no
    # timeout of its own while it waits: the ops it waits for have theirs.)
    (second, first), waited = run_ranks(_deferred_op_behind_one_that_times_out, 2, env=TRANSPORTS[transport],
                                        pg_timeout=3, timeout=120)[0]
    assert first is not None and "did not complete within 3000 ms" in first, first
    assert second is not None and "not started: the process group broke while it waited for earlier ops" in second, second
    assert "did not complete within 3000 ms" in second, second  # the first op's error, which broke the group
    assert waited < 30, waited


def _deferred_inside_a_coalescing_block(rank, world):
    expect_transport()
    a, b = torch.full((1 << 16,), float(rank + 1)), torch.full((1 << 16,), float(rank + 1))
    if rank == 1:
        await_announcement("block issued")
    first = dist.all_reduce(a, async_op=True)
    # The block's broadcast of `a` starts only after `first`; the block's Work waits for it
    # (once, it held it back: the block's wait() never returned). With a device, the block's
    # ops are issued one by one between startCoalescing and endCoalescing.
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.broadcast(a, 0, async_op=True)
        dist.broadcast(b, 1, async_op=True)
    if rank == 0:
        announce("block issued")
    cm.wait()
    first.wait()
    return a[0].item(), a[-1].item(), b[0].item()


def test_an_op_of_a_coalescing_block_behind_an_earlier_one_on_its_memory(transport):
    for rank, got in enumerate(run_ranks(_deferred_inside_a_coalescing_block, 2, env=TRANSPORTS[transport], timeout=120)):
        assert got == (3.0, 3.0, 2.0), (rank, got)


def _abort_with_an_op_waiting(rank, world):
    expect_transport()
    t = torch.ones(1000)
    if rank == 1:
        await_announcement("aborted")
        return None
    first = dist.all_reduce(t, async_op=True)
    second = dist.all_reduce(t, async_op=True)  # waits for the first (same tensor)
    start = time.monotonic()
    dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).abort()
    errors = _errors_of(first, second)
    waited = time.monotonic() - start
    announce("aborted")
    return errors, waited


def test_abort_fails_an_op_waiting_for_an_earlier_one_at_once(transport):
    (first, second), waited = run_ranks(_abort_with_an_op_waiting, 2, env=TRANSPORTS[transport], timeout=120)[0]
    assert first is not None and "abort() was called" in first, first
    assert second is not None and "not started" in second and "abort() was called on it" in second, second
    assert waited < 10, waited
