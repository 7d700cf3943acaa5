"""Empty and one-element tensors through every collective, and counts past 2**31."""

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, all_gather_single, reduce_scatter_single, run_ranks


def _tiny(rank, world):
    done = []
    for k in (0, 1):
        v = float(rank + 1)
        total = world * (world + 1) / 2
        t = torch.full((k,), v)
        dist.all_reduce(t)
        assert t.tolist() == [total] * k
        t = torch.full((k,), v)
        dist.reduce(t, dst=0)
        assert t.tolist() == ([total] * k if rank == 0 else [v] * k)
        t = torch.full((k,), v)
        dist.broadcast(t, src=world - 1)
        assert t.tolist() == [float(world)] * k
        out = [torch.empty(k) for _ in range(world)]
        dist.all_gather(out, torch.full((k,), v))
        assert [o.tolist() for o in out] == [[float(r + 1)] * k for r in range(world)]
        big = torch.empty(world * k)
        all_gather_single(big, torch.full((k,), v))
        assert big.tolist() == [float(r + 1) for r in range(world) for _ in range(k)]
        share = torch.empty(k)
        reduce_scatter_single(share, torch.full((world * k,), v))
        assert share.tolist() == [total] * k
        gl = [torch.empty(k) for _ in range(world)] if rank == 0 else None
        dist.gather(torch.full((k,), v), gather_list=gl, dst=0)
        if rank == 0:
            assert [g.tolist() for g in gl] == [[float(r + 1)] * k for r in range(world)]
        out1 = torch.empty(k)
        dist.scatter(out1, [torch.full((k,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
        assert out1.tolist() == [float(rank)] * k
        a2a = torch.empty(world * k)
        dist.all_to_all_single(a2a, torch.full((world * k,), v))
        assert a2a.tolist() == [float(r + 1) for r in range(world) for _ in range(k)]
        got = torch.empty(k)
        ops = [dist.P2POp(dist.isend, torch.full((k,), v), (rank + 1) % world),
               dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert got.tolist() == [float((rank - 1) % world + 1)] * k
        dist.barrier()
        done.append(k)
    return done


@pytest.mark.parametrize("world", [2, 3])
def test_empty_and_one_element_tensors(world):
    assert run_ranks(_tiny, world) == [[0, 1]] * world


def _past_int32(rank, world):
    # 2**31 + 64 int8 elements: element and byte counts past the int32 range.
    n = (1 << 31) + 64
    t = torch.ones(n, dtype=torch.int8)
    dist.all_reduce(t)
    ok = t[0].item() == world and t[n // 2].item() == world and t[-1].item() == world
    del t
    b = torch.full((n,), rank, dtype=torch.int8)
    dist.broadcast(b, src=world - 1)
    return ok and b[-1].item() == world - 1 and b[0].item() == world - 1


def test_counts_past_int32_limits():
    assert all(run_ranks(_past_int32, 2, timeout=600))


# In place: reduce_scatter_tensor's output a view of this rank's share of its input,
# all_gather_into_tensor's input a view of this rank's share of its output (as ZeRO-style code
# keeps one flat buffer), and all_to_all_single's output its input, through the staging chunks
# with an odd tail, on every path; compared byte for byte with gloo doing the same in place
# on the same values, or with the worked-out result.
def _in_place_shares(rank, world, staged, path):
    gloo = dist.new_group(backend="gloo")
    n = (3 << 20) // 4 + 7 if staged else 1000  # float32 per rank: 3 MiB + 28 B, several chunks and a tail
    taken = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert taken._path("reduce_scatter", world * n * 4) == path, taken._path("reduce_scatter", world * n * 4)
    got = {}
    for name, group in (("ccl", None), ("gloo", gloo)):
        flat = (torch.arange(world * n, dtype=torch.float32) % 1013) * (rank + 1)
        mine = flat[rank * n:(rank + 1) * n]
        dist.reduce_scatter_tensor(mine, flat, group=group)
        got[name + " reduce_scatter"] = flat.clone()
        flat = torch.full((world * n,), -1.0)
        flat[rank * n:(rank + 1) * n] = torch.arange(n, dtype=torch.float32) + 1000 * rank
        dist.all_gather_into_tensor(flat, flat[rank * n:(rank + 1) * n], group=group)
        got[name + " all_gather"] = flat
    wrong = [op for op in ("reduce_scatter", "all_gather")
             if not torch.equal(got["ccl " + op].view(torch.int32), got["gloo " + op].view(torch.int32))]
    # all_to_all_single with its output its input (this rank's part for itself stays where it
    # is), against the worked-out result: gloo's own in-place all-to-all is no reference (on
    # torch 2.13, 2 ranks of 5 floats each, its rank 1 ended with its own first part).
    flat = torch.arange(world * n, dtype=torch.float32) + 10000 * rank
    dist.all_to_all_single(flat, flat)
    want = torch.cat([torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) + 10000 * q for q in range(world)])
    if not torch.equal(flat, want):
        wrong.append("all_to_all in place")
    # Outside the output share, reduce_scatter leaves the input as it was.
    untouched = (torch.arange(world * n, dtype=torch.float32) % 1013) * (rank + 1)
    outside = torch.ones(world * n, dtype=torch.bool)
    outside[rank * n:(rank + 1) * n] = False
    if not torch.equal(got["ccl reduce_scatter"][outside], untouched[outside]):
        wrong.append("reduce_scatter wrote outside its output")
    # And the share itself, worked out: the ranks' values summed (exact in float32).
    if not torch.equal(got["ccl reduce_scatter"][~outside], untouched[~outside] / (rank + 1) * (world * (world + 1) // 2)):
        wrong.append("reduce_scatter's share is not the sum")
    return wrong


@pytest.mark.parametrize("path", ["shm", "cma", "oneccl"])
@pytest.mark.parametrize("staged", [False, True], ids=["1000", "3MiB+7"])
def test_in_place_shares_of_one_flat_buffer(path, staged):
    env = {"shm": {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"}, "cma": {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "0"},
           "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}[path]
    for world in (2, 3):
        assert run_ranks(_in_place_shares, world, staged, path, env=env, timeout=300) == [[]] * world, (path, world)


# One rank reads its peers directly (single copy at every size), the other would stage: the
# step goes single copy for both, after the second had staged its input for a staged step
# (for allreduce and reduce_scatter, only what its peers reduce).
def _mixed_routes(rank, world):
    taken = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    n = (3 << 20) // 4 + 7
    paths = (taken._path("allreduce", n * 4), taken._path("reduce_scatter", world * n * 4))
    base = torch.arange(world * n, dtype=torch.float32) % 1013
    t = base[:n] * (rank + 1)
    dist.all_reduce(t)
    wrong = [] if torch.equal(t, base[:n] * (world * (world + 1) // 2)) else ["all_reduce"]
    share = torch.empty(n)
    dist.reduce_scatter_tensor(share, base * (rank + 1))
    if not torch.equal(share, base[rank * n:(rank + 1) * n] * (world * (world + 1) // 2)):
        wrong.append("reduce_scatter_tensor")
    return paths, wrong


def test_a_step_one_rank_reads_directly_goes_single_copy_for_all():
    ranks = run_ranks(_mixed_routes, 2, rank_env={0: {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "0"},
                                                   1: {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "1",
                                                       "ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "1G"}}, timeout=300)
    assert [paths for paths, _ in ranks] == [("cma", "cma"), ("shm", "shm")], ranks
    assert [wrong for _, wrong in ranks] == [[], []], ranks


# ReduceOp.AVG of float16 values whose sum passes float16's largest (65504): the average is
# finite, as NCCL's (which scales each input by 1/n before summing) is; gloo has no AVG to
# compare with, so it is checked against the mean worked out in float64. Inputs an op only
# reads stay as they were.
def _fp16_avg(rank, world, n):
    from harness import expect_transport

    expect_transport()
    g = torch.Generator().manual_seed(7)
    base = torch.rand(world * n, generator=g, dtype=torch.float64)
    mine = (30000 + 30000 * base.roll(rank)).half()  # 30000-60000: two ranks' sum overflows float16
    every = [(30000 + 30000 * base.roll(r)).half().double() for r in range(world)]
    mean = (sum(every) / world).half()

    def close(got, want):
        return bool(torch.isfinite(got).all()) and torch.allclose(got.double(), want.double(), rtol=3e-3)

    wrong = []
    t = mine.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    wrong += [] if close(t, mean) else ["all_reduce"]
    parts = [mine[:n].clone(), mine[n:].clone()]
    dist.all_reduce_coalesced(parts, op=dist.ReduceOp.AVG)
    wrong += [] if close(torch.cat(parts), mean) else ["all_reduce_coalesced"]
    t = mine.clone()
    dist.reduce(t, dst=world - 1, op=dist.ReduceOp.AVG)
    wrong += [] if (close(t, mean) if rank == world - 1 else torch.equal(t, mine)) else ["reduce"]
    share = torch.empty(n, dtype=torch.float16)
    src = mine.clone()
    reduce_scatter_single(share, src, op=dist.ReduceOp.AVG)
    wrong += [] if close(share, mean[rank * n:(rank + 1) * n]) and torch.equal(src, mine) else ["reduce_scatter_single"]
    listed = list(mine.clone().chunk(world))
    dist.reduce_scatter(share, listed, op=dist.ReduceOp.AVG)
    wrong += [] if close(share, mean[rank * n:(rank + 1) * n]) and torch.equal(torch.cat(listed), mine) \
        else ["reduce_scatter"]
    return wrong


@pytest.mark.parametrize("transport", ["shm", "oneccl"])
@pytest.mark.parametrize("n", [1000, (3 << 20) // 2 + 7], ids=["1000", "3MiB+14"])
def test_float16_average_does_not_overflow(transport, n):
    for world in (2, 3):
        assert run_ranks(_fp16_avg, world, n, env=TRANSPORTS[transport], timeout=300) == [[]] * world, world


# Groups of one rank (new_group([r]), new_subgroups(group_size=1): what tensor or expert
# parallelism of size 1 makes): every collective, on ccl's and on gloo's, same inputs. (A group of
# one has no peer to share memory with: its collectives go through oneCCL, whatever the setting.)
def _groups_of_one(rank, world):
    results = {}
    for backend in ("ccl", "gloo"):
        mine = [dist.new_group([r], backend=backend) for r in range(world)][rank]
        got = []
        t = torch.arange(6, dtype=torch.float32) + rank
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mine)
        got.append(t)
        t = torch.arange(6, dtype=torch.float32) * (rank + 2)
        dist.reduce(t, dst=rank, group=mine)
        got.append(t)
        t = torch.arange(3, dtype=torch.float32) - rank
        dist.broadcast(t, src=rank, group=mine)
        got.append(t)
        out = [torch.empty(4)]
        dist.all_gather(out, torch.full((4,), float(rank)), group=mine)
        got += out
        big = torch.empty(4)
        all_gather_single(big, torch.arange(4, dtype=torch.float32) + 10 * rank, group=mine)
        got.append(big)
        share = torch.empty(5)
        reduce_scatter_single(share, torch.arange(5, dtype=torch.float32) + rank, group=mine)
        got.append(share)
        listed = torch.empty(2)
        dist.reduce_scatter(listed, [torch.full((2,), 3.0 + rank)], group=mine)
        got.append(listed)
        gl = [torch.empty(3)]
        dist.gather(torch.full((3,), float(rank) + 0.5), gather_list=gl, dst=rank, group=mine)
        got += gl
        sc = torch.empty(3)
        dist.scatter(sc, [torch.full((3,), 7.0 + rank)], src=rank, group=mine)
        got.append(sc)
        a2a = torch.empty(4)
        dist.all_to_all_single(a2a, torch.arange(4, dtype=torch.float32) * (rank + 1), group=mine)
        got.append(a2a)
        lists = [torch.empty(2)]
        dist.all_to_all(lists, [torch.full((2,), 5.0 - rank)], group=mine)
        got += lists
        dist.barrier(group=mine)
        results[backend] = [g.tolist() for g in got]
    return results


def test_groups_of_one_rank_do_what_gloos_do():
    for res in run_ranks(_groups_of_one, 2):
        assert res["ccl"] == res["gloo"], res
