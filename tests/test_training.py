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
