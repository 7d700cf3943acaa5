"""DDP training in a script that never imports oneccl_bind_pt (run it under torchrun).

torch >= 2.14 resolves an unknown backend name through the `torch.distributed.backends`
entry points, so init_process_group("ccl") loads the package by itself. The script checks
that nothing imported it before, that the group is really ccl, then trains the same model on
the same data twice, once on the ccl group and once on a gloo group, and prints both
parameter checksums: they must match (scripts/check_wheel.py, tests/test_wheels.py).
"""

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(group):
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 5), process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(100 + dist.get_rank())
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(torch.randn(2, 4)), torch.randn(2, 5)).backward()
        optimizer.step()
    return sum(p.detach().double().sum().item() for p in model.parameters())


def main():
    before = sorted(m for m in sys.modules if m.split(".")[0] in ("oneccl_bind_pt", "oneccl_bindings_for_pytorch", "torch_ccl"))
    assert not before, f"imported before init_process_group: {before}"
    dist.init_process_group("ccl")
    assert dist.get_backend() == "ccl", dist.get_backend()
    assert "oneccl_bind_pt" in sys.modules, "the entry point did not load oneccl_bind_pt"
    rank = dist.get_rank()
    ccl = train(None)
    gloo = train(dist.new_group(backend="gloo"))
    print(f"rank {rank} no-import ccl checksum {ccl:.10f} gloo checksum {gloo:.10f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
