"""Rank 1 is SIGKILLed after the first allreduce; the others report what they see."""

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

timeout = float(os.environ.get("PG_TIMEOUT", "5"))
dist.init_process_group("ccl", timeout=datetime.timedelta(seconds=timeout))
rank = dist.get_rank()
t = torch.ones(1 << 20)
dist.all_reduce(t)
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
start = time.monotonic()
try:
    dist.all_reduce(t)
except dist.DistBackendError as e:
    print(f"rank {rank} raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
    dist.destroy_process_group()
    sys.exit(3)
print(f"rank {rank}: the collective completed without its peer", flush=True)
