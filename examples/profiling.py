"""Time spent in each collective, from the PyTorch profiler.

    mpirun -n 2 python examples/profiling.py
    torchrun --nproc_per_node 2 examples/profiling.py

Each collective shows as its own row with its input shape (pg::allreduce),
and the wait for it as a row carrying the element count
(pg::wait::allreduce::sz:16). It also shows as ccl:all_reduce, the
"<backend>:<collective>" row every c10d backend emits (gloo:all_reduce on
gloo), which PyTorch's own tools and tests look for.
"""

import torch
import torch.distributed as dist

import torch_ccl  # noqa: F401  registers the "ccl" backend


def main():
    dist.init_process_group("ccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"rank = {rank}, size = {world}", flush=True)

    x = torch.ones([2, 2])
    y = torch.ones([4, 4])
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        for _ in range(10):
            dist.all_reduce(x)
            dist.all_reduce(y)
    dist.barrier()
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total")
    print(f"rank {rank} profile:\n{table}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
