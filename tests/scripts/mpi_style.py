"""A script written the way torch-ccl's users wrote them for mpirun: it maps
PMI_RANK/PMI_SIZE and sets the master address itself, then trains with DDP."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch_ccl  # noqa: F401

os.environ["MASTER_ADDR"] = "127.0.0.1"
os.environ.setdefault("MASTER_PORT", "29500")
os.environ["RANK"] = str(os.environ.get("PMI_RANK", 0))
os.environ["WORLD_SIZE"] = str(os.environ.get("PMI_SIZE", 1))

dist.init_process_group("ccl")
rank, size = dist.get_rank(), dist.get_world_size()
print(f"my rank = {rank}  my size = {size}", flush=True)
torch.manual_seed(0)  # the test trains the same model in one process to compare
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 5))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(rank)
for _ in range(3):
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(2, 4)), torch.randn(2, 5)).backward()
    opt.step()
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"rank {rank} parameter checksum {checksum:.10f}", flush=True)
dist.destroy_process_group()
