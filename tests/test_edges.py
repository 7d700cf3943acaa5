"""Empty and one-element tensors through every collective, and counts past 2**31."""

import pytest
import torch
import torch.distributed as dist

from harness import all_gather_single, reduce_scatter_single, run_ranks


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
