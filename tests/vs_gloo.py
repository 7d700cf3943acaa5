"""The scenarios that tests/test_vs_gloo.py (one host) and tests/test_two_hosts.py (two)
run on a gloo group and on the ccl group, in the same processes, to compare what they give.

Each scenario takes (group, rank, world), with group None for the default (ccl) group, and
returns what PyTorch defines: tensors, the values Futures carry, objects, profiler rows.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def _full(shape, value, dtype=torch.float32):
    return torch.full(shape, value, dtype=dtype)


@scenario
def all_gather_coalesced(group, rank, world):
    # output_lists[r][i] is rank r's inputs[i] (PyTorch's documented layout).
    inputs = [_full((2,), rank), _full((3,), 10.0 + rank), _full((1,), -rank)]
    outs = [[torch.empty(2), torch.empty(3), torch.empty(1)] for _ in range(world)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        fut = dist.all_gather_coalesced(outs, inputs, group=group, async_op=True)  # torch hands back a Future
    return {"outputs": outs, "future": fut.wait()}


@scenario
def all_reduce_coalesced(group, rank, world):
    ts = [_full((4,), rank + 1.0), torch.arange(3.0) * (rank + 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced(ts, group=group)
    return ts


@scenario
def coalescing_manager(group, rank, world):
    gathered = [torch.empty(world * 2), torch.empty(world * 3, 2)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered[0], _full((2,), rank + 1.0), group=group)
        dist.all_gather_into_tensor(gathered[1], torch.arange(6.0).reshape(3, 2) - rank, group=group)
    cm.wait()
    reduced = [_full((3,), rank + 1.0), torch.arange(5.0) * rank]
    with dist._coalescing_manager(group=group):
        for t in reduced:
            dist.all_reduce(t, group=group)
    return {"gathered": gathered, "reduced": reduced}


@scenario
def all_gather(group, rank, world):
    outs = [torch.empty(3) for _ in range(world)]
    work = dist.all_gather(outs, torch.arange(3.0) + rank, group=group, async_op=True)
    work.wait()
    return {"outputs": outs, "future": work.get_future().value()}


@scenario
def all_gather_into_tensor(group, rank, world):
    out = torch.empty(world * 2, 3)
    dist.all_gather_into_tensor(out, torch.arange(6.0).reshape(2, 3) * (rank + 1), group=group)
    return out


@scenario
def reduce_scatter_tensor(group, rank, world):
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.arange(2.0 * world) * (rank + 1), group=group)
    return out


@scenario
def reduce_scatter_list(group, rank, world):
    out = torch.empty(3)
    dist.reduce_scatter(out, [_full((3,), 10.0 * r + rank) for r in range(world)], group=group)
    return out


@scenario
def all_reduce_ops(group, rank, world):
    out = {}
    for op in ("SUM", "PRODUCT", "MIN", "MAX"):
        for dtype in (torch.float32, torch.int64):
            t = (torch.arange(4) + rank + 1).to(dtype)
            dist.all_reduce(t, op=getattr(ReduceOp, op), group=group)
            out[f"{op}-{dtype}"] = t
    for op in ("BAND", "BOR", "BXOR"):
        t = torch.tensor([rank + 5, 12, 3 * rank], dtype=torch.int32)
        dist.all_reduce(t, op=getattr(ReduceOp, op), group=group)
        out[op] = t
    t = torch.tensor([rank % 2 == 0, True, False])
    dist.all_reduce(t, group=group)  # bool SUM is a logical or
    out["bool"] = t
    return out


@scenario
def reduce_to_last(group, rank, world):
    t = torch.arange(5.0) + rank
    dist.reduce(t, dst=world - 1, group=group)
    return t if rank == world - 1 else None  # non-roots' buffers are unspecified


@scenario
def broadcast_from_last(group, rank, world):
    t = _full((5,), float(rank), torch.float64)
    work = dist.broadcast(t, src=world - 1, group=group, async_op=True)
    work.wait()
    return {"tensor": t, "future": work.get_future().value()}


@scenario
def gather_scatter(group, rank, world):
    root = world - 1
    gathered = [torch.empty(2) for _ in range(world)] if rank == root else None
    dist.gather(_full((2,), rank * 3.0), gathered, dst=root, group=group)
    out = torch.empty(2)
    dist.scatter(out, [_full((2,), 100.0 + r) for r in range(world)] if rank == 0 else None, src=0, group=group)
    return {"gathered": gathered, "scattered": out}


@scenario
def all_to_all(group, rank, world):
    ins = [_full((2,), 10.0 * rank + r) for r in range(world)]  # gloo wants equal sizes
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_to_all(outs, ins, group=group)
    single_out = torch.empty(world * 2)
    dist.all_to_all_single(single_out, torch.arange(world * 2.0) + 100 * rank, group=group)
    return {"list": outs, "single": single_out}


@scenario
def all_to_all_single_uneven(group, rank, world):
    # rank r sends r + 1 rows to every peer, and receives p + 1 rows from peer p.
    send = torch.arange((rank + 1) * world * 2.0).reshape(-1, 2) + 1000 * rank
    recv = torch.empty(sum(p + 1 for p in range(world)), 2)
    dist.all_to_all_single(recv, send, [p + 1 for p in range(world)], [rank + 1] * world, group=group)
    return recv


@scenario
def object_collectives(group, rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "items": list(range(rank + 1))}, group=group)
    root = world - 1
    gathered = [None] * world if rank == root else None
    dist.gather_object(("g", rank), gathered, dst=root, group=group)
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0, group=group)
    bcast = [rank, "x" * rank] if rank == 1 else [None, None]
    dist.broadcast_object_list(bcast, src=1, group=group)
    return {"all_gather": objs, "gather": gathered, "scatter": scattered, "broadcast": bcast}


@scenario
def send_recv_ring(group, rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(3)
    if rank % 2 == 0:
        dist.send(_full((3,), rank + 0.5), dst=nxt, group=group)
        dist.recv(got, src=prv, group=group)
    else:
        dist.recv(got, src=prv, group=group)
        dist.send(_full((3,), rank + 0.5), dst=nxt, group=group)
    return got


@scenario
def batch_isend_irecv_both_ways(group, rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    from_prev, from_next = torch.empty(4), torch.empty(2)
    ops = [
        dist.P2POp(dist.isend, _full((4,), 10.0 + rank), nxt, group),
        dist.P2POp(dist.isend, _full((2,), 20.0 + rank), prv, group),
        dist.P2POp(dist.irecv, from_prev, prv, group),
        dist.P2POp(dist.irecv, from_next, nxt, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return {"from_prev": from_prev, "from_next": from_next}


@scenario
def futures_chain(group, rank, world):
    t = _full((3,), rank + 1.0)
    fut = dist.all_reduce(t, group=group, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2).then(lambda f: f.value() + 1)
    return {"chained": chained.wait(), "value": fut.value()}


@scenario
def barrier_and_work_result(group, rank, world):
    dist.barrier(group=group)
    t = _full((2,), float(rank))
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    return {"result": work.result(), "success": work.is_success(), "completed": work.is_completed()}


@scenario
def work_result_refusals(group, rank, world):
    """result() before the op completed, and of all_gather_coalesced's list of lists: gloo
    refuses both, and the Work stays usable."""
    from harness import announce, await_announcement

    event = f"result before completion on {dist.get_backend(group)}"
    t = _full((2,), float(rank))
    if rank != 0:
        await_announcement(event)  # rank 0's op cannot complete before this rank's is issued
    work = dist.all_reduce(t, group=group, async_op=True)
    early = None
    if rank == 0:
        try:
            work.result()
            early = "returned"
        except RuntimeError as e:
            early = (type(e).__name__, "wait()" in str(e))
        announce(event)
    work.wait()
    pg = group or dist.distributed_c10d._get_default_group()
    outs = [[torch.empty(2), torch.empty(1)] for _ in range(world)]
    gathered = pg.allgather_coalesced(outs, [_full((2,), rank + 1.0), _full((1,), -rank)])
    gathered.wait()
    try:
        lists = gathered.result()
    except RuntimeError as e:
        lists = (type(e).__name__, "get_future().value()" in str(e) or "getFuture() and value()" in str(e))
    return {"early": early, "after": work.result(), "lists": lists, "outputs": outs}


@scenario
def large_messages(group, rank, world):
    # Sizes where oneCCL and the shared-memory transport take their large-message algorithms
    # (chunks, rings, single copy), lengths that no world size divides, values small enough
    # that every sum is exact in every dtype here.
    g = torch.Generator().manual_seed(rank)
    n = (1 << 20) + 3

    def values(count, dtype=torch.float32):
        return torch.randint(-8, 8, (count,), generator=g).to(dtype)

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = values(n, dtype)
        dist.all_reduce(t, group=group)
        out[f"all_reduce-{dtype}"] = t
    share = (1 << 18) + 1
    gathered = torch.empty(world * share)
    dist.all_gather_into_tensor(gathered, values(share), group=group)
    scattered = torch.empty(share)
    dist.reduce_scatter_tensor(scattered, values(world * share), group=group)
    exchanged = torch.empty(world * share)
    dist.all_to_all_single(exchanged, values(world * share), group=group)
    t = values(n)
    dist.broadcast(t, src=world - 1, group=group)
    return {**out, "all_gather": gathered, "reduce_scatter": scattered, "all_to_all": exchanged, "broadcast": t}


@scenario
def sparse_all_reduce(group, rank, world):
    # Sums of sparse COO tensors with overlapping and disjoint entries; rank 0 has none.
    n = rank * 2
    indices = torch.tensor([[i % 5 for i in range(n)], [(i + rank) % 3 for i in range(n)]], dtype=torch.long)
    t = torch.sparse_coo_tensor(indices.reshape(2, n), torch.arange(float(n)) + rank, (5, 3))
    work = dist.all_reduce(t, group=group, async_op=True)
    work.wait()
    vector = torch.sparse_coo_tensor(torch.tensor([[rank, world]]), torch.tensor([[1.0, 2.0]] * 2) * (rank + 1), (world + 1, 2))
    dist.all_reduce(vector, group=group)
    return {"matrix": t.to_dense(), "is_sparse": t.is_sparse, "vector": vector.to_dense()}


@scenario
def profiler_rows(group, rank, world):
    # The rows named "<backend>:<collective>" that PyTorch's tests and tools look
    # for: the same names, counts, async flags and input shapes as gloo's.
    backend = dist.get_backend(group)
    t = _full((4,), rank + 1.0)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(t, group=group)
        dist.broadcast(t, 0, group=group, async_op=True).wait()
        dist.reduce(t, world - 1, group=group)
        dist.all_gather([torch.empty(4) for _ in range(world)], t, group=group)
        dist.gather(t, [torch.empty(4) for _ in range(world)] if rank == 0 else None, 0, group=group)
        dist.scatter(t, [torch.ones(4)] * world if rank == 0 else None, 0, group=group)
        if rank == 0:
            dist.send(t, 1, group=group)
        elif rank == 1:
            dist.recv(t, 0, group=group)
    rows = {}
    for e in prof.function_events:
        if e.name.startswith(backend + ":"):
            op = "<backend>" + e.name[len(backend):]
            rows.setdefault(op, []).append((e.is_async, e.count, str(e.input_shapes)))
    assert len(rows) >= 6, f"{backend}: too few profiler rows to compare: {sorted(rows)}"
    return {op: sorted(r) for op, r in rows.items()}


def differences(a, b, where=""):
    """Exact equality of nested results; returns a list of differences."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if same:
            return []
        if a.dtype != b.dtype or a.shape != b.shape or a.numel() <= 16:
            return [f"{where}: ccl {a!r} != gloo {b!r}"]
        wrong = (a != b).flatten().nonzero().flatten()
        first = wrong[0].item()
        return [f"{where}: {wrong.numel()} of {a.numel()} elements differ, the first at {first}: "
                f"ccl {a.flatten()[first].item()} != gloo {b.flatten()[first].item()}"]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: ccl {a!r} != gloo {b!r} (structure)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    return [] if a == b else [f"{where}: ccl {a!r} != gloo {b!r}"]


def compare_with_gloo(rank, world):
    """Every scenario on a gloo group of the world, then on the default (ccl) group; by
    scenario, the differences (empty where equal)."""
    gloo = dist.new_group(backend="gloo")
    report = {}
    for name, fn in SCENARIOS.items():
        try:
            want = fn(gloo, rank, world)
        except Exception as e:  # noqa: BLE001 - a scenario gloo cannot run is a broken scenario
            report[name] = [f"gloo raised {type(e).__name__}: {e}"]
            continue
        try:
            got = fn(None, rank, world)
        except Exception as e:  # noqa: BLE001
            report[name] = [f"ccl raised {type(e).__name__}: {e}"]
            continue
        report[name] = differences(got, want, name)
    return report
