"""Two hosts of two ranks: each host's subgroup takes shared memory, the world takes oneCCL.

Prints one line per rank with the paths taken and whether every value was right.
With the argument `gloo` the default group is gloo's, and the ccl groups are made after it,
each host's first: the first ccl group of the process is then one host's, and the world's,
made next, must still reach across hosts. With a second argument `world-fails` (a host given a
network interface the other cannot reach) the world's ccl group must fail to be created: each
rank prints what it raised and exits 0, freeing its host's group as the interpreter ends.
"""

import socket
import sys

import torch
import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

default = sys.argv[1] if len(sys.argv) > 1 else "ccl"
dist.init_process_group(default)
rank, world = dist.get_rank(), dist.get_world_size()
hosts = [None] * world
dist.all_gather_object(hosts, socket.gethostname())
mine = [r for r in range(world) if hosts[r] == hosts[rank]]
# new_subgroups_by_enumeration: every rank creates every group, in one order.
local, _ = dist.new_subgroups_by_enumeration([[r for r in range(world) if hosts[r] == h]
                                              for h in dict.fromkeys(hosts)], backend="ccl")
if sys.argv[2:] == ["world-fails"]:
    try:
        dist.new_group(backend="ccl")
    except dist.DistBackendError as e:
        print(f"rank {rank} world group raised: {str(e).splitlines()[0]}", flush=True)
        sys.exit(0)
    sys.exit(f"rank {rank}: the world's ccl group was created")
everyone = dist.group.WORLD if default == "ccl" else dist.new_group(backend="ccl")


def backend(group):
    return group._get_backend(torch.device("cpu"))


paths = {"world": backend(everyone)._path("allreduce", 4096), "local": backend(local)._path("allreduce", 4096)}
ok = True
for _ in range(3):  # interleave the two transports
    x = torch.full((1024,), float(rank + 1))
    dist.all_reduce(x, group=local)
    ok &= torch.equal(x, torch.full((1024,), float(sum(r + 1 for r in mine))))
    y = torch.arange(1 << 16, dtype=torch.float32) + rank
    work = dist.all_reduce(y, group=everyone, async_op=True)
    z = torch.full((7,), float(rank))
    dist.broadcast(z, src=mine[0], group=local)
    work.wait()
    ok &= torch.equal(y, torch.arange(1 << 16, dtype=torch.float32) * world + sum(range(world)))
    ok &= torch.equal(z, torch.full((7,), float(mine[0])))
# Any-source receive works inside a host (shared memory) ...
if rank == mine[1]:
    dist.send(torch.full((3,), 42.0), dst=mine[0], group=local, tag=5)
elif rank == mine[0]:
    t = torch.zeros(3)
    work = dist.irecv(t, group=local, tag=5)
    work.wait()
    # The source is a rank of the group, as with gloo.
    ok &= torch.equal(t, torch.full((3,), 42.0)) and dist.get_global_rank(local, work._source_rank()) == mine[1]
# ... and is refused with a clear error across hosts (oneCCL has no wildcard receive).
refused = "n/a"
if rank == 0:
    try:
        dist.recv(torch.zeros(1), group=everyone)
        refused = "no"
    except RuntimeError as e:
        refused = "yes" if "any source" in str(e) else f"other: {e}"
dist.barrier(group=everyone)
print(f"rank {rank} world_path={paths['world']} local_path={paths['local']} ok={bool(ok)} any_source_refused={refused}",
      flush=True)
dist.destroy_process_group()
