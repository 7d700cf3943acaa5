"""One rank of a group of 2 that never meets the other: `lonely_rank.py STORE [RANK [TIMEOUT_S]]`.

Rank 0 (the default) waits for a rank 1 that never starts. Rank 1, started on the same store
after rank 0 gave up, comes too late. Prints what init_process_group raised and after how long."""

import datetime
import sys
import time

import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 3
start = time.monotonic()
try:
    dist.init_process_group("ccl", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
except dist.DistBackendError as e:
    print(f"raised after {time.monotonic() - start:.1f} s: {e}", flush=True)
    sys.exit(3)
