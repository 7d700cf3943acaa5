"""Rank 1 comes to init_process_group("ccl") 1.5 s after rank 0 has entered it (rank 0 leaves a
file just before): the first group's meeting waits that long on rank 0."""

import os
import sys
import time

import torch
import torch.distributed as dist

import oneccl_bindings_for_pytorch  # noqa: F401

marker = sys.argv[1]
rank = int(os.environ["RANK"])
if rank == 0:
    open(marker, "w").close()
else:
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(1.5)  # the lateness under test, not a wait for something to happen
start = time.monotonic()
dist.init_process_group("ccl")
took = time.monotonic() - start
t = torch.ones(2)
dist.all_reduce(t)
print(f"rank {rank} init took {took:.2f} s sum {t[0].item():.0f}", flush=True)
dist.destroy_process_group()
