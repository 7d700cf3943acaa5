"""Each rank in turn forks while its ops wait for the other rank (the progress thread and a
callback lane busy), and the child leaves through the interpreter's normal exit (atexit, the
group freed by finalization). Prints how the child ended; then the group must still work.

gloo is no reference here: its forked children hang for good at that exit (~ProcessGroupGloo
waits for worker threads the child does not have)."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

CHILD_LIMIT = 60  # s; the child's exit took under 1 s here

dist.init_process_group("ccl", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
store = dist.distributed_c10d._get_default_store()
big = torch.ones(1 << 20)
path = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._path("allreduce", 4)
print(f"rank {rank}: transport {path}", flush=True)
dist.all_reduce(big)  # a large op first: helper threads, where there are any, are made by now


def ops():
    tensors = [torch.full((1 << 16,), float(rank + 1)) for _ in range(4)]
    return tensors, [dist.all_reduce(t, async_op=True) for t in tensors]


for forker in range(world):
    if rank != forker:
        store.wait([f"forked/{forker}"])  # the forker's ops wait for this rank until then
        tensors, works = ops()
    else:
        tensors, works = ops()
        chained = works[-1].get_future().then(lambda f: f.value()[0][0].item())
        in_flight = not works[0].is_completed()
        pid = os.fork()
        if pid == 0:
            torch.ones(4).sum()
            sys.exit(0)
        store.set(f"forked/{forker}", "1")
        deadline = time.monotonic() + CHILD_LIMIT
        start = time.monotonic()
        while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.02)
        if ended[0]:
            how = f"exited {os.waitstatus_to_exitcode(ended[1])} in {time.monotonic() - start:.1f} s"
        else:
            how = f"still running after {CHILD_LIMIT} s"
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        print(f"rank {rank}: ops in flight at the fork: {in_flight}; the child {how}", flush=True)
    for w in works:
        w.wait()
    assert all(torch.equal(t, torch.full((1 << 16,), float(sum(range(1, world + 1))))) for t in tensors)
    if rank == forker:
        assert chained.wait() == sum(range(1, world + 1))

dist.all_reduce(big)
assert torch.equal(big, torch.full((1 << 20,), float(world * world)))
dist.destroy_process_group()
print(f"rank {rank}: the group worked on after the forks", flush=True)
