"""Each rank in turn forks while its ops wait for the other rank (the progress thread and a
callback lane busy); the child finds the parent's group refusing it, destroys it, and leaves
through the interpreter's normal exit (atexit, finalizers). Then both fork with nothing in
flight, and those two children make a ccl group of their own (a parent that used oneCCL or shared
memory forking workers that communicate). Prints how each child ended; then the parent's group
must still work.

gloo is no reference here: its forked children hang for good at that exit (~ProcessGroupGloo
waits for worker threads the child does not have)."""

import datetime
import gc
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


def reap(pid):
    """How the child ended, waiting at most CHILD_LIMIT."""
    start = time.monotonic()
    while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < start + CHILD_LIMIT:
        time.sleep(0.02)
    if ended[0]:
        return f"exited {os.waitstatus_to_exitcode(ended[1])} in {time.monotonic() - start:.1f} s"
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return f"still running after {CHILD_LIMIT} s"


def child_checks(inherited_work):
    """In the forked child: the parent's group refuses ops and waits (its peers and connections are
    the parent's), and destroying it there leaves the parent's alone."""
    for what, call in (("an allreduce", lambda: dist.all_reduce(torch.ones(4))),
                       ("a wait for the parent's op", lambda: inherited_work.wait()),
                       ("a wait on the parent's op's Future", lambda: inherited_work.get_future().wait())):
        try:
            call()
        except dist.DistBackendError as e:
            if "made in the parent of this forked process" not in str(e):
                print(f"child of rank {rank}: {what} raised the wrong error: {e}", flush=True)
                os._exit(3)
        else:
            print(f"child of rank {rank}: {what} on the parent's group did not raise", flush=True)
            os._exit(3)
    dist.destroy_process_group()
    torch.ones(4).sum()


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
            child_checks(works[0])
            sys.exit(0)
        store.set(f"forked/{forker}", "1")
        print(f"rank {rank}: ops in flight at the fork: {in_flight}; the child {reap(pid)}", flush=True)
    for w in works:
        w.wait()
    assert all(torch.equal(t, torch.full((1 << 16,), float(sum(range(1, world + 1))))) for t in tensors)
    if rank == forker:
        assert chained.wait() == sum(range(1, world + 1))

# Once more with nothing in flight: the child's exit then frees its copy of the group too.
del works, tensors
pid = os.fork()
if pid == 0:
    dist.destroy_process_group()
    gc.collect()
    # Small tensors only: libgomp, which the parent used for `big`, cannot run a parallel
    # region in a forked child (torch's own limitation, whatever the backend).
    own = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["CHILD_PORT"]), world, rank == 0,
                        timeout=datetime.timedelta(seconds=CHILD_LIMIT))
    dist.init_process_group("ccl", store=own, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    mine = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))._path("allreduce", 4)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    right = torch.equal(t, torch.full((1000,), float(sum(range(1, world + 1)))))
    print(f"child of rank {rank}: a group of its own on transport {mine}, allreduce right: {right}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if right else 4)
print(f"rank {rank}: idle fork: the child {reap(pid)}", flush=True)

dist.all_reduce(big)
assert torch.equal(big, torch.full((1 << 20,), float(world * world)))
dist.destroy_process_group()
print(f"rank {rank}: the group worked on after the forks", flush=True)
