"""One rank of a job spread over two hosts (tests/test_two_hosts.py): runs the checks named in
CHECKS and prints one line per check, "rank R check NAME ok" or "... FAILED: why", so the test
tells which one broke even when several share a launch.

The rank comes from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://, as a launcher gives
them); nothing tells the package which ranks share a host: it finds out itself.

    ddp        DDP trains a Linear(4, 5) for STEPS steps at LR; prints the parameters, which the
               test compares with scripts/ddp_reference.py's single-process training
    p2p        isend/irecv between ranks 0 and 1 both ways at once, three tags one after the
               other (oneCCL has no tags, and several messages in flight between two ranks
               can be matched out of order: scripts/p2p_order.py); values checked
    async      collectives whose futures run callbacks (then()), all in flight at once; values
               checked
    timeout    rank 1 never joins an allreduce on a group with a 3 s timeout; rank 0 must raise
               (last: the group is unusable afterwards)
    world      an allreduce and an allgather of host names on every rank: the hosts really are
               two, and the world's collectives go through oneCCL
    matrix     tests/matrix.py's cases for this world size (collectives x reduce ops x dtypes,
               refusals included); prints "rank R matrix {case: null or the error}" as JSON
    gloo       tests/vs_gloo.py's scenarios on a gloo group and on the ccl group; prints
               "rank R gloo {scenario: [differences]}" as JSON (gloo needs GLOO_SOCKET_IFNAME)
    dead-peer  the last rank prints its pid and waits to be SIGKILLed by the test; the others
               wait for the file KILLED_FILE, then run an allreduce on a group with a 5 s
               timeout, which must raise
"""

import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import oneccl_bind_pt  # noqa: F401

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the matrix and the gloo scenarios
from matrix import run_all  # noqa: E402
from vs_gloo import compare_with_gloo  # noqa: E402

LR, STEPS = 0.5, 8  # large enough that a wrong gradient sum moves the parameters far


def check_ddp(rank, world):
    # The data and model of scripts/ddp_reference.py's one_process_parameters.
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 5))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(100 + rank)
    batches = [(torch.randn(2, 4), torch.randn(2, 5)) for _ in range(STEPS)]
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    print(f"rank {rank} parameters {' '.join(f'{v:.9e}' for v in flat.tolist())}", flush=True)


def check_p2p(rank, world):
    # Point to point across the hosts, both directions at once, three messages each way in
    # flight: oneCCL has no tags, so each must arrive in send order (docs/multi-node.md).
    if rank in (0, 1):
        peer = 1 - rank
        for n in range(20):
            outs = [torch.zeros(1 << 14) for _ in range(3)]
            works = [dist.irecv(got, src=peer, tag=t) for t, got in enumerate(outs)]
            works += [dist.isend(torch.full((1 << 14,), 100.0 * n + 10 * rank + t), dst=peer, tag=t) for t in range(3)]
            for w in works:
                w.wait()
            for t, got in enumerate(outs):
                want = 100.0 * n + 10 * peer + t
                assert torch.equal(got, torch.full((1 << 14,), want)), f"round {n} tag {t}: {got[:4].tolist()}"


def check_async(rank, world):
    # Collectives with chained callbacks, none waited for until all are issued.
    total = world * (world + 1) / 2
    a = torch.full((1 << 16,), float(rank + 1))
    doubled = dist.all_reduce(a, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    gathered = torch.empty(world * 5)
    firsts = dist.all_gather_into_tensor(gathered, torch.full((5,), float(rank)), async_op=True).get_future().then(
        lambda f: f.value()[0][::5].tolist())
    b = torch.arange(1 << 12, dtype=torch.float32) + rank
    work = dist.broadcast(b, src=world - 1, async_op=True)
    seen = []
    work.get_future().then(lambda f: seen.append(f.value()[0][1].item())).wait()
    assert torch.equal(doubled.wait(), torch.full((1 << 16,), 2 * total)), doubled.wait()[:4]
    assert torch.equal(a, torch.full((1 << 16,), total)), a[:4]
    assert firsts.wait() == [float(r) for r in range(world)], firsts.wait()
    assert torch.equal(b, torch.arange(1 << 12, dtype=torch.float32) + world - 1), b[:4]
    assert seen == [float(world)], seen


def _allreduce_must_raise(group, numel, done, otherwise):
    """An allreduce on `group` that must raise DistBackendError: prints `done`, the seconds it
    took and the error (what the test reads); raises AssertionError(otherwise) if it completes."""
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(numel), group=group)
    except dist.DistBackendError as e:
        print(f"{done} after {time.monotonic() - start:.1f} s: {e}", flush=True)
    else:
        raise AssertionError(otherwise)


def check_timeout(rank, world):
    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank != 0:
        # Never joins the allreduce; waits until rank 0 has raised.
        store.wait(["rank 0 timed out"], datetime.timedelta(seconds=120))
        return
    try:
        _allreduce_must_raise(group, 1 << 10, "rank 0 timed out", "an allreduce that rank 1 never joined completed")
    finally:
        store.set("rank 0 timed out", "1")


def check_world(rank, world):
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    t = torch.full((1 << 12,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((1 << 12,), world * (world + 1) / 2)), t[:4]
    path = dist.group.WORLD._get_backend(torch.device("cpu"))._path("allreduce", 1 << 14)
    print(f"rank {rank} of {world} on {hosts[rank]}: hosts {len(set(hosts))}, world path {path}", flush=True)


def check_dead_peer(rank, world):
    group = dist.new_group(timeout=datetime.timedelta(seconds=5))
    dist.all_reduce(torch.ones(4), group=group)  # the group works while every rank lives
    if rank == world - 1:
        print(f"rank {rank} pid {os.getpid()} waits to be killed", flush=True)
        dist.distributed_c10d._get_default_store().wait(["never set"], datetime.timedelta(seconds=120))
        raise AssertionError("was not killed within 120 s")
    killed = os.environ["KILLED_FILE"]
    deadline = time.monotonic() + 120
    while not os.path.exists(killed):  # the test writes it once the peer is dead
        assert time.monotonic() < deadline, "the test never killed the last rank"
        time.sleep(0.02)
    _allreduce_must_raise(group, 1 << 16, f"rank {rank} raised", "an allreduce completed without its dead peer")


def _run_and_report(rank, what, fn, world):
    """fn's {item: None or what went wrong} on the world group, which must be oneCCL's (what
    ran on a transport of one host would prove nothing about the one across hosts), printed
    as "rank R <what> <JSON>" for the test's items; raises if any item went wrong."""
    path = dist.group.WORLD._get_backend(torch.device("cpu"))._path("allreduce", 64)
    assert path == "oneccl", f"the world group's allreduce takes {path}, not oneccl"
    report = fn(rank, world)
    print(f"rank {rank} {what} {json.dumps(report)}", flush=True)
    wrong = sorted(item for item, problem in report.items() if problem)
    assert not wrong, f"{len(wrong)} of {len(report)} {what} items went wrong: {', '.join(wrong[:5])}"


def check_matrix(rank, world):
    _run_and_report(rank, "matrix", run_all, world)


def check_gloo(rank, world):
    _run_and_report(rank, "gloo", compare_with_gloo, world)


CHECKS = {"ddp": check_ddp, "p2p": check_p2p, "async": check_async, "timeout": check_timeout, "world": check_world,
          "dead-peer": check_dead_peer, "matrix": check_matrix, "gloo": check_gloo}


def main():
    dist.init_process_group("ccl", timeout=datetime.timedelta(seconds=120))
    # oneCCL's worker threads the package chose (CCL_WORKER_OFFLOAD=0: none)
    print(f"rank {dist.get_rank()} workers {os.environ.get('CCL_WORKER_OFFLOAD')} {os.environ.get('CCL_WORKER_COUNT')}",
          flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = False
    for name in os.environ["CHECKS"].split(","):
        try:
            CHECKS[name](rank, world)
            print(f"rank {rank} check {name} ok", flush=True)
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            failed = True
            why = traceback.format_exc().strip().replace("\n", " | ")
            print(f"rank {rank} check {name} FAILED: {why}", flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
