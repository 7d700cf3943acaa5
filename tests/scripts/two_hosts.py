"""One allreduce and one DDP step; prints what both must agree on, on one host or two."""

import torch
import torch.distributed as dist
import torch.nn as nn

import oneccl_bind_pt  # noqa: F401

dist.init_process_group("ccl")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.arange(1 << 16, dtype=torch.float32) + rank
dist.all_reduce(x)
expected = torch.arange(1 << 16, dtype=torch.float32) * world + sum(range(world))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
torch.manual_seed(10 + rank)
model(torch.randn(4, 8)).sum().backward()
checksum = sum(p.grad.double().sum().item() for p in model.parameters())
print(f"rank {rank} allreduce_ok={torch.equal(x, expected)} grad_checksum={checksum:.10f}", flush=True)
dist.destroy_process_group()
