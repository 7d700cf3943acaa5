"""Rank 1 destroys its group while rank 0's process dies under it (tests/test_reliability.py).

Rank 1 runs under gdb: it stops itself with SIGTRAP just before destroy_process_group(), and
gdb then holds its oneCCL teardown at the communicator's destructor while the test kills
rank 0. Rank 0 writes its pid to $RANK0_PID and waits to be killed. Not for use without gdb
(the SIGTRAP would end rank 1)."""

import os
import signal

import torch
import torch.distributed as dist

import oneccl_bind_pt  # noqa: F401

rank = int(os.environ["RANK"])
dist.init_process_group("ccl")
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4
if rank == 0:
    with open(os.environ["RANK0_PID"], "w") as f:
        f.write(str(os.getpid()))
    dist.barrier()
    signal.pause()
else:
    dist.barrier()  # rank 0's pid is written
    os.kill(os.getpid(), signal.SIGTRAP)
    dist.destroy_process_group()
    print("rank 1 destroyed its group", flush=True)
