"""init_process_group, one all_reduce, destroy_process_group: three times in one process.

Under torchrun every init uses the elastic agent's store, and the default group's name is "0"
again after each destroy, so each group gets the same store keys. Prints one line per round and
rank: the sum and, for ccl, the path a small all_reduce takes."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

backend = sys.argv[1]
if backend == "ccl":
    import oneccl_bindings_for_pytorch  # noqa: F401

for round_ in range(3):
    start = time.monotonic()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1000,), float(rank + 1 + round_))
    dist.all_reduce(x)
    expected = sum(r + 1 + round_ for r in range(world))
    path = "-"
    if backend == "ccl":
        path = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._path("allreduce", 4)
    ok = "ok" if x.eq(expected).all() else f"WRONG {x[:3].tolist()}"
    print(f"rank {rank} round {round_} sum {ok} path {path} in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()
