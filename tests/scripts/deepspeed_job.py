"""One rank of a DeepSpeed job: ZeRO stages 1, 2 and 3, then mixed collectives.

    torchrun --nproc_per_node 2 tests/scripts/deepspeed_job.py ccl   # after sourcing setvars.sh
    torchrun --nproc_per_node 2 tests/scripts/deepspeed_job.py gloo  # the reference

DeepSpeed's CPU accelerator takes ccl whenever oneccl_bindings_for_pytorch
imports, whatever dist_backend says; the gloo run hides the module. Each stage
starts from the same seed; the parameters after training are printed as a
digest, to compare across ranks and with gloo. With ccl, DeepSpeed's own
collectives (through its op, which loads oneCCL's shared library) are then
mixed with torch.distributed ones on the ccl group, with known values.
"""

import hashlib
import sys

backend = sys.argv[1]
if backend == "gloo":
    for name in ("oneccl_bindings_for_pytorch", "oneccl_bind_pt", "torch_ccl"):
        sys.modules[name] = None

import deepspeed  # noqa: E402
import deepspeed.comm as dscomm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

deepspeed.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == backend, (dist.get_backend(), backend)


def train(stage, steps=4):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in params])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank} stage {stage} params {digest}", flush=True)


for stage in (1, 2, 3):
    train(stage)

if backend == "ccl":
    # Two oneCCL copies in one process: DeepSpeed's op (its own communicator, on
    # oneCCL's shared library) and this backend (linked in, symbols hidden).
    checked = 0
    for i, n in enumerate((1, 1000, 3_000_000)):
        for dtype in (torch.float32, torch.float64, torch.int32):
            # Each tensor is summed twice, once by either copy: world x the sum.
            want = world * sum(r + i for r in range(world))
            a = torch.full((n,), rank + i, dtype=dtype)
            dscomm.inference_all_reduce(a)
            b = torch.full((n,), rank + i, dtype=dtype)
            dist.all_reduce(b)
            c = torch.full((n,), rank + i, dtype=dtype)
            dscomm.all_reduce(c)
            work = dist.all_reduce(a, async_op=True)
            dscomm.all_reduce(b)
            work.wait()
            dist.all_reduce(c)
            for t, name in ((a, "inference then torch"), (b, "torch then deepspeed"), (c, "deepspeed then torch")):
                assert torch.equal(t, torch.full((n,), want, dtype=dtype)), (name, n, dtype, t[:4])
                checked += 1
    print(f"rank {rank} mixed collectives ok {checked}", flush=True)
dscomm.barrier()
# As every job should: gloo's worker threads still alive at interpreter exit can end the
# process in std::terminate (pytorch/pytorch#190489), which once failed the gloo reference run.
dist.destroy_process_group()
