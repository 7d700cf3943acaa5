"""Training through ccl gives the same model as gloo (DDP) or as one process (FSDP)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_ranks


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train_ddp(group, rank, steps=5):
    # Small buckets: several asynchronous allreduces per backward pass.
    model = DDP(_mlp(), process_group=group, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp_matches_gloo(rank, world):
    gloo = dist.new_group(backend="gloo")
    with_ccl = _train_ddp(None, rank)
    with_gloo = _train_ddp(gloo, rank)
    for a, b in zip(with_ccl, with_gloo):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # And every rank ends with the same model.
    flat = torch.cat([p.reshape(-1) for p in with_ccl])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=gloo)
    assert all(torch.equal(g, flat) for g in gathered)
    return True


def test_ddp_matches_gloo():
    assert all(run_ranks(_ddp_matches_gloo, 2))
    assert all(run_ranks(_ddp_matches_gloo, 3))


def _fsdp_matches_one_process(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reference = _mlp()  # the same model trained on the whole batch in this process
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(99)
    for _ in range(4):
        x, y = torch.randn(4 * world, 16, generator=gen), torch.randn(4 * world, 4, generator=gen)
        mine = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6)
    return True


def test_fsdp_trains_like_one_process():
    assert all(run_ranks(_fsdp_matches_one_process, 2))
