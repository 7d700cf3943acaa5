#!/usr/bin/env python3
"""examples/ddp.py's final parameter checksum, computed in one process without distribution.

    python scripts/ddp_reference.py --world 2

DDP averages the ranks' gradients, which is the gradient of their mean loss: one process
that sees every rank's batch and averages the losses ends with the same parameters (up to
float rounding). scripts/check_wheel.py compares the ranks' checksums with this value;
tests/test_launchers.py imports one_process_checksum for its scripts, tests/test_two_hosts.py
one_process_parameters.
"""

import argparse

import torch
import torch.nn as nn


def one_process_checksum(world, lr, steps, seed_of_rank):
    """The sum of one_process_parameters()."""
    return one_process_parameters(world, lr, steps, seed_of_rank).sum().item()


def one_process_parameters(world, lr, steps, seed_of_rank):
    """The training of a Linear(4, 5) model the examples do, on all `world` ranks' data at once;
    its weight and bias, flattened, in float64."""
    torch.manual_seed(0)
    model = nn.Linear(4, 5)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batches = []
    for r in range(world):
        torch.manual_seed(seed_of_rank(r))
        batches.append([(torch.randn(2, 4), torch.randn(2, 5)) for _ in range(steps)])
    for step in range(steps):
        optimizer.zero_grad()
        sum(nn.functional.mse_loss(model(b[step][0]), b[step][1]) for b in batches).div(world).backward()
        optimizer.step()
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def ddp_example_checksum(world):
    """examples/ddp.py: lr 0.01, 3 steps, rank r's data seeded with 100 + r."""
    return one_process_checksum(world, lr=0.01, steps=3, seed_of_rank=lambda r: 100 + r)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="the number of ranks examples/ddp.py ran on")
    print(f"one process checksum {ddp_example_checksum(ap.parse_args().world):.10f}")


if __name__ == "__main__":
    main()
