"""Rank 0 of a group of 2 whose rank 1 never starts."""

import datetime
import sys

import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

try:
    dist.init_process_group("ccl", init_method=f"file://{sys.argv[1]}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=3))
except dist.DistBackendError as e:
    print(f"raised: {e}", flush=True)
    sys.exit(3)
