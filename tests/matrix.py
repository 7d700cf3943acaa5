"""The op x reduce-op x dtype matrix, run by every rank in the same order.

Every rank can rebuild every other rank's input (`data` is a pure function of
rank and case), so each one computes the expected result by hand and compares.
Cases that must be refused check the error names the op and the problem, and
that the group still works afterwards.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from harness import all_gather_single, reduce_scatter_single

FLOATS = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
INTS = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}
REDUCIBLE = {**FLOATS, **INTS, "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128}
# Data movement sends bytes: dtypes oneCCL cannot reduce still travel.
MOVABLE = {
    **REDUCIBLE,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex32": torch.complex32,
}
REDUCE_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BOR", "BXOR"]


def reduce_op(name):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(0.5)
    return getattr(ReduceOp, name)


def accepted(op: str, dtype: torch.dtype) -> bool:
    """The op table, restated independently of the C++ one."""
    if dtype.is_complex:
        return op in ("SUM", "AVG", "PREMUL_SUM")
    if dtype.is_floating_point:
        return op not in ("BAND", "BOR", "BXOR")
    if dtype == torch.bool:
        return op not in ("AVG", "PREMUL_SUM")
    return op != "PREMUL_SUM"  # integers


def data(rank: int, dtype: torch.dtype, shape, salt: int = 0, op: str = "SUM") -> torch.Tensor:
    """Small exact values: sums and products of a few ranks stay exact in every dtype."""
    g = torch.Generator().manual_seed(7919 * rank + 104729 * salt + len(shape))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    high = 16 if op in ("BAND", "BOR", "BXOR") else (3 if op == "PRODUCT" else 4)
    if dtype.is_complex:
        parts = torch.randint(1, high, (*shape, 2), generator=g).double()
        return torch.view_as_complex(parts).to(dtype)
    return torch.randint(1, high, shape, generator=g).to(dtype)


def raw_data(rank: int, dtype: torch.dtype, shape, salt: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns of any dtype, for collectives that only move data."""
    g = torch.Generator().manual_seed(31 * rank + 1009 * salt + 17)
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def expected_reduction(tensors, op: str, world: int) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        fold = {
            "SUM": operator.or_, "MAX": operator.or_, "BOR": operator.or_,
            "PRODUCT": operator.and_, "MIN": operator.and_, "BAND": operator.and_, "BXOR": operator.xor,
        }[op]
        return functools.reduce(fold, tensors)
    if op in ("BAND", "BOR", "BXOR"):
        fold = {"BAND": operator.and_, "BOR": operator.or_, "BXOR": operator.xor}[op]
        return functools.reduce(fold, tensors)
    wide = torch.complex128 if dtype.is_complex else (torch.float64 if dtype.is_floating_point else torch.int64)
    stack = torch.stack([t.to(wide) for t in tensors])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MIN":
        out = stack.amin(0)
    elif op == "MAX":
        out = stack.amax(0)
    elif op == "PREMUL_SUM":
        out = (stack * 0.5).sum(0)
    elif op == "AVG":
        out = stack.sum(0) / world if wide != torch.int64 else torch.div(stack.sum(0), world, rounding_mode="trunc")
    return out.to(dtype)


def assert_reduced(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.is_floating_point or actual.dtype.is_complex:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: got {actual.tolist()} expected {expected.tolist()}"


def assert_usable() -> None:
    """After a refused call, the group must still run a collective correctly."""
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    w = dist.get_world_size()
    assert t.tolist() == [w * (w + 1) / 2] * 3, f"group unusable after error: {t.tolist()}"


def expect_error(fn, *needles, types=(RuntimeError,)) -> None:
    """fn must raise a RuntimeError (what gloo and NCCL raise) whose message has every needle."""
    try:
        fn()
    except types as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"error message lacks {missing}: {msg!r}"
    else:
        raise AssertionError(f"expected an error mentioning {needles}")
    assert_usable()


# ---- reductions ------------------------------------------------------------------

SHAPE = (3, 5)


def _allreduce(rank, world, op, dtype):
    t = data(rank, dtype, SHAPE, op=op)
    dist.all_reduce(t, op=reduce_op(op))
    expected = expected_reduction([data(r, dtype, SHAPE, op=op) for r in range(world)], op, world)
    assert_reduced(t, expected, "all_reduce")


def _reduce(rank, world, op, dtype):
    root = world - 1
    t = data(rank, dtype, SHAPE, op=op)
    dist.reduce(t, dst=root, op=reduce_op(op))
    if rank == root:
        expected = expected_reduction([data(r, dtype, SHAPE, op=op) for r in range(world)], op, world)
        assert_reduced(t, expected, "reduce (root)")
    else:
        assert same_bytes(t, data(rank, dtype, SHAPE, op=op)), "reduce changed a non-root input"


def _reduce_scatter_single(rank, world, op, dtype):
    shape = (world * 2, 3)
    inp = data(rank, dtype, shape, op=op)
    keep = inp.clone()
    out = torch.empty((2, 3), dtype=dtype)
    reduce_scatter_single(out, inp, op=reduce_op(op))
    full = expected_reduction([data(r, dtype, shape, op=op) for r in range(world)], op, world)
    assert_reduced(out, full[rank * 2 : rank * 2 + 2], "reduce_scatter_single")
    assert same_bytes(inp, keep), "reduce_scatter_single changed its input"


def _reduce_scatter_list(rank, world, op, dtype):
    inputs = [data(rank, dtype, (4,), salt=r, op=op) for r in range(world)]
    out = torch.empty(4, dtype=dtype)
    dist.reduce_scatter(out, inputs, op=reduce_op(op))
    expected = expected_reduction([data(r, dtype, (4,), salt=rank, op=op) for r in range(world)], op, world)
    assert_reduced(out, expected, "reduce_scatter")


def _allreduce_coalesced(rank, world, op, dtype):
    a, b = data(rank, dtype, (4,), op=op), data(rank, dtype, (2, 3), salt=1, op=op)
    try:
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_reduce(a, op=reduce_op(op))
            dist.all_reduce(b, op=reduce_op(op))
    finally:
        # torch leaves the group in coalescing mode when the body raises
        # (e.g. its own complex-op check): clear it so the group stays usable.
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)
    cm.wait()
    assert_reduced(a, expected_reduction([data(r, dtype, (4,), op=op) for r in range(world)], op, world), "coalesced a")
    assert_reduced(
        b, expected_reduction([data(r, dtype, (2, 3), salt=1, op=op) for r in range(world)], op, world), "coalesced b"
    )


def _reduce_scatter_coalesced(rank, world, op, dtype):
    shapes = [(world * 2,), (world, 3)]
    inputs = [data(rank, dtype, sh, salt=i, op=op) for i, sh in enumerate(shapes)]
    outs = [torch.empty((2,), dtype=dtype), torch.empty((1, 3), dtype=dtype)]
    try:
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, inputs):
                reduce_scatter_single(o, i, op=reduce_op(op))
    finally:
        dist.distributed_c10d._world.pg_coalesce_state.pop(dist.group.WORLD, None)
    cm.wait()
    for i, (o, sh) in enumerate(zip(outs, shapes)):
        full = expected_reduction([data(r, dtype, sh, salt=i, op=op) for r in range(world)], op, world)
        share = full.shape[0] // world
        assert_reduced(o, full[rank * share : (rank + 1) * share], f"coalesced reduce_scatter {i}")


REDUCTIONS = {
    "all_reduce": _allreduce,
    "reduce": _reduce,
    "reduce_scatter_single": _reduce_scatter_single,
    "reduce_scatter": _reduce_scatter_list,
    "all_reduce_coalesced": _allreduce_coalesced,
    "reduce_scatter_single_coalesced": _reduce_scatter_coalesced,
}


def reduction_case(name, op, dtype_name):
    fn = REDUCTIONS[name]
    dtype = REDUCIBLE[dtype_name]

    def case(rank, world):
        if accepted(op, dtype):
            fn(rank, world, op, dtype)
        else:
            # torch's Python refuses some complex ops itself, with a ValueError, for
            # every backend; ours are RuntimeErrors naming the op and dtype.
            types = (RuntimeError, ValueError) if dtype.is_complex else (RuntimeError,)
            expect_error(lambda: fn(rank, world, op, dtype), op, types=types)

    return case


# ---- data movement -----------------------------------------------------------------


def _broadcast(rank, world, dtype):
    root = world - 1
    t = raw_data(rank, dtype, (4, 3))
    dist.broadcast(t, src=root)
    assert same_bytes(t, raw_data(root, dtype, (4, 3)))


def _all_gather(rank, world, dtype):
    out = [torch.empty((2, 3), dtype=dtype) for _ in range(world)]
    dist.all_gather(out, raw_data(rank, dtype, (2, 3)))
    for r in range(world):
        assert same_bytes(out[r], raw_data(r, dtype, (2, 3))), f"slot {r}"


def _all_gather_uneven(rank, world, dtype):
    out = [torch.empty((r + 1, 2), dtype=dtype) for r in range(world)]
    dist.all_gather(out, raw_data(rank, dtype, (rank + 1, 2)))
    for r in range(world):
        assert same_bytes(out[r], raw_data(r, dtype, (r + 1, 2))), f"slot {r}"


def _all_gather_single(rank, world, dtype):
    out = torch.empty((world * 2, 3), dtype=dtype)
    all_gather_single(out, raw_data(rank, dtype, (2, 3)))
    assert same_bytes(out, torch.cat([raw_data(r, dtype, (2, 3)) for r in range(world)]))


def _all_gather_single_coalesced(rank, world, dtype):
    outs = [torch.empty((world * 2,), dtype=dtype), torch.empty((world * 3, 2), dtype=dtype)]
    with dist._coalescing_manager(async_ops=True) as cm:
        all_gather_single(outs[0], raw_data(rank, dtype, (2,)))
        all_gather_single(outs[1], raw_data(rank, dtype, (3, 2), salt=1))
    cm.wait()
    assert same_bytes(outs[0], torch.cat([raw_data(r, dtype, (2,)) for r in range(world)]))
    assert same_bytes(outs[1], torch.cat([raw_data(r, dtype, (3, 2), salt=1) for r in range(world)]))


def _gather(rank, world, dtype):
    for root in (0, world - 1):
        gl = [torch.empty((2, 2), dtype=dtype) for _ in range(world)] if rank == root else None
        dist.gather(raw_data(rank, dtype, (2, 2), salt=root), gather_list=gl, dst=root)
        if rank == root:
            for r in range(world):
                assert same_bytes(gl[r], raw_data(r, dtype, (2, 2), salt=root)), f"root {root} slot {r}"


def _scatter(rank, world, dtype):
    root = world - 1
    sl = [raw_data(root, dtype, (3,), salt=r) for r in range(world)] if rank == root else None
    out = torch.empty(3, dtype=dtype)
    dist.scatter(out, scatter_list=sl, src=root)
    assert same_bytes(out, raw_data(root, dtype, (3,), salt=rank))


def _all_to_all(rank, world, dtype):
    # rank r sends (r + d + 1) rows to rank d: uneven both ways
    inputs = [raw_data(rank, dtype, (rank + d + 1, 2), salt=d) for d in range(world)]
    outputs = [torch.empty((s + rank + 1, 2), dtype=dtype) for s in range(world)]
    dist.all_to_all(outputs, inputs)
    for s in range(world):
        assert same_bytes(outputs[s], raw_data(s, dtype, (s + rank + 1, 2), salt=rank)), f"from {s}"


def _all_to_all_single(rank, world, dtype):
    inp = raw_data(rank, dtype, (world * 2, 3))
    out = torch.empty((world * 2, 3), dtype=dtype)
    dist.all_to_all_single(out, inp)
    expected = torch.cat([raw_data(s, dtype, (world * 2, 3))[rank * 2 : rank * 2 + 2] for s in range(world)])
    assert same_bytes(out, expected)


def _all_to_all_single_uneven(rank, world, dtype):
    send = [rank + d + 1 for d in range(world)]  # rows rank -> d
    recv = [s + rank + 1 for s in range(world)]
    inp = raw_data(rank, dtype, (sum(send), 2))
    out = torch.empty((sum(recv), 2), dtype=dtype)
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    pieces = []
    for s in range(world):
        src_send = [s + d + 1 for d in range(world)]
        start = sum(src_send[:rank])
        pieces.append(raw_data(s, dtype, (sum(src_send), 2))[start : start + src_send[rank]])
    assert same_bytes(out, torch.cat(pieces))


def _send_recv(rank, world, dtype):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty((5,), dtype=dtype)
    # Alternate order so no pair deadlocks even if sends were blocking.
    if rank % 2 == 0:
        dist.send(raw_data(rank, dtype, (5,)), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(raw_data(rank, dtype, (5,)), dst=nxt)
    assert same_bytes(got, raw_data(prv, dtype, (5,)))


def _batch_isend_irecv(rank, world, dtype):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    from_prv, from_nxt = torch.empty((4,), dtype=dtype), torch.empty((4,), dtype=dtype)
    ops = [
        dist.P2POp(dist.isend, raw_data(rank, dtype, (4,), salt=1), nxt),
        dist.P2POp(dist.isend, raw_data(rank, dtype, (4,), salt=2), prv),
        dist.P2POp(dist.irecv, from_prv, prv),
        dist.P2POp(dist.irecv, from_nxt, nxt),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert same_bytes(from_prv, raw_data(prv, dtype, (4,), salt=1))
    assert same_bytes(from_nxt, raw_data(nxt, dtype, (4,), salt=2))


MOVEMENTS = {
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_uneven": _all_gather_uneven,
    "all_gather_single": _all_gather_single,
    "all_gather_single_coalesced": _all_gather_single_coalesced,
    "gather": _gather,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "all_to_all_single_uneven": _all_to_all_single_uneven,
    "send_recv": _send_recv,
    "batch_isend_irecv": _batch_isend_irecv,
}


def movement_case(name, dtype_name):
    fn, dtype = MOVEMENTS[name], MOVABLE[dtype_name]
    return lambda rank, world: fn(rank, world, dtype)


@dataclass(frozen=True)
class Case:
    id: str
    fn: Callable[[int, int], None]


# What each case proves decides where it runs, so no two cases pay for the same proof:
# - every dtype meets every reduce op in all_reduce: the reduction kernels and the op x dtype
#   table are per (op, dtype), and the other reductions reuse them;
# - the other reductions differ in how data is split and routed, so they take every reduce op
#   (refusals included) on one dtype of each kind the kernels treat apart;
# - data movement copies bytes: every dtype through broadcast and all_to_all_single (one
#   collective, one exchange), every movement on a few dtypes of different element sizes;
# - at 3 and 4 ranks only what the world size changes: shares, roots, uneven splits, the
#   AVG division, and rings of p2p, on one float and one integer dtype.
KINDS = ["float32", "bfloat16", "int64", "uint8", "bool", "complex64"]
MOVE_SIZES = ["uint8", "bfloat16", "float64", "complex128", "float8_e4m3fn"]  # 1, 2, 8, 16 bytes
EVERY_DTYPE_MOVEMENTS = ["broadcast", "all_to_all_single"]
WIDER_OPS = ["SUM", "AVG", "MAX", "PRODUCT"]
WIDER_DTYPES = ["float32", "int64"]


def _reduction_cases(name, ops, dtypes):
    return [Case(f"{name}-{op}-{dt}", reduction_case(name, op, dt)) for op in ops for dt in dtypes]


def _movement_cases(name, dtypes):
    return [Case(f"{name}-{dt}", movement_case(name, dt)) for dt in dtypes]


def cases(world: int = 2) -> list[Case]:
    """The cases run at `world` ranks (see above); every rank gets the same list."""
    out = []
    if world == 2:
        out += _reduction_cases("all_reduce", REDUCE_OPS, REDUCIBLE)
        for name in REDUCTIONS:
            if name != "all_reduce":
                out += _reduction_cases(name, REDUCE_OPS, KINDS)
        for name in MOVEMENTS:
            out += _movement_cases(name, MOVABLE if name in EVERY_DTYPE_MOVEMENTS else MOVE_SIZES)
    else:
        for name in REDUCTIONS:
            out += _reduction_cases(name, WIDER_OPS, WIDER_DTYPES)
        for name in MOVEMENTS:
            out += _movement_cases(name, WIDER_DTYPES)
    return out


def run_all(rank: int, world: int) -> dict[str, str | None]:
    """Runs every case for this world size; returns {case id: None if passed, else the error}."""
    results = {}
    for case in cases(world):
        try:
            case.fn(rank, world)
            results[case.id] = None
        except Exception as e:  # noqa: BLE001 - recorded per case
            results[case.id] = f"{type(e).__name__}: {e}"
    dist.barrier()
    return results
