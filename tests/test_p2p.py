"""send/recv: tags, recv from any source, and a usable group after a refusal.

On one host p2p runs through shared memory, which matches messages by
(source, tag) as gloo does and can receive from any source; each case runs
there twice: streamed through the rings (`staged`) and with the receiver
reading the sender's tensor (`single`, single copy at every size). Across hosts
oneCCL carries it, with neither; there a recv from any source is refused before
anything is posted, and the group stays usable: a message already sent waits for
the next recv that names its sender (ONECCL_BIND_PT_SHM=0 gives that path on one
host).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import TRANSPORTS, expect_transport, run_ranks

NO_SHM = {"ONECCL_BIND_PT_SHM": "0"}
SHM_PATHS = {"staged": {"ONECCL_BIND_PT_SHM_SINGLE_COPY": "0"},
             "single": {"ONECCL_BIND_PT_SHM_SINGLE_COPY_BYTES": "0"}}
# ccl on both shared-memory paths, and gloo for the reference answer.
BACKENDS = [("ccl", "staged"), ("ccl", "single"), ("gloo", None)]
BACKEND_IDS = ["ccl-staged", "ccl-single", "gloo"]
shm_paths = pytest.mark.parametrize("path", SHM_PATHS)


def _tags_out_of_order(rank, world):
    if rank == 0:
        # isend: gloo's blocking send would wait for its own recv first.
        works = [dist.isend(torch.full((4,), float(tag)), dst=1, tag=tag) for tag in (1, 2, 3)]
        for w in works:
            w.wait()
        return None
    got = {}
    for tag in (3, 1, 2):  # received in another order than sent
        t = torch.empty(4)
        dist.recv(t, src=0, tag=tag)
        got[tag] = t[0].item()
    return got


@pytest.mark.parametrize(("backend", "path"), BACKENDS, ids=BACKEND_IDS)
def test_recv_matches_by_tag(backend, path):
    got = run_ranks(_tags_out_of_order, 2, backend=backend, env=SHM_PATHS.get(path))
    assert got[1] == {1: 1.0, 2: 2.0, 3: 3.0}


def _any_source(rank, world):
    # Every other rank sends its rank to rank 0, in whatever order they come.
    if rank != 0:
        dist.send(torch.full((3,), float(rank)), dst=0, tag=7)
        return None
    seen = []
    for _ in range(world - 1):
        t = torch.empty(3)
        work = dist.irecv(t, tag=7)  # src=None
        work.wait()
        assert t.tolist() == [float(work._source_rank())] * 3
        seen.append(work._source_rank())
    return sorted(seen)


@pytest.mark.parametrize(("backend", "path"), BACKENDS, ids=BACKEND_IDS)
def test_recv_from_any_source(backend, path):
    assert run_ranks(_any_source, 3, backend=backend, env=SHM_PATHS.get(path))[0] == [1, 2]


def _then_batch(rank, world):
    """recv(src=None) while rank 1's message waits, then a batch_isend_irecv."""
    first = torch.full((2,), 1.0)
    second = torch.full((2,), 2.0)
    got = torch.empty(2)
    if rank == 1:
        dist.send(first, dst=0)
    outcome = None
    if rank == 0:
        try:
            dist.recv(got)
            outcome = ("received", got.tolist())
        except RuntimeError as e:
            outcome = ("refused", str(e))
    ops = [dist.P2POp(dist.isend, second, 0)] if rank == 1 else [dist.P2POp(dist.irecv, got, 1)]
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        after = got.tolist() if rank == 0 else "sent"
    except RuntimeError as e:
        after = f"raised: {e}"
    return outcome, after


@shm_paths
def test_any_source_then_batch_gets_the_right_message(path):
    outcome, after = run_ranks(_then_batch, 2, env=SHM_PATHS[path])[0]
    assert outcome == ("received", [1.0, 1.0])
    assert after == [2.0, 2.0]


def _refused_then_retried(rank, world):
    """Every other rank sends to rank 0, whose recv from any source is refused; rank 0 then
    receives each message by naming its sender, and the group goes on (p2p and collectives)."""
    if rank != 0:
        dist.send(torch.full((2,), float(rank)), dst=0)
        dist.send(torch.full((2,), 10.0 * rank), dst=0)
    else:
        try:
            dist.recv(torch.empty(2))
        except RuntimeError as e:
            refused = str(e)
        else:
            raise AssertionError("recv(src=None) on the oneCCL path was neither refused nor failed")
        assert "any source" in refused and "Pass the sender's rank as src" in refused, refused
        got = {}
        for src in range(world - 1, 0, -1):  # in another order than the senders ran
            first, second = torch.empty(2), torch.empty(2)
            dist.recv(first, src=src)
            dist.recv(second, src=src)
            got[src] = (first.tolist(), second.tolist())
        assert got == {s: ([float(s)] * 2, [10.0 * s] * 2) for s in range(1, world)}, got
    dist.barrier()
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    peer = (rank + 1) % world
    back = torch.empty(1)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.tensor([float(rank)]), peer),
                                    dist.P2POp(dist.irecv, back, (rank - 1) % world)])
    for w in works:
        w.wait()
    return t.tolist(), back.item()


@pytest.mark.parametrize("world", [2, 3])
def test_refused_any_source_leaves_the_group_usable(world):
    # On gloo the recv would take either message; oneCCL has no wildcard receive, so it is
    # refused before anything is posted, and the messages wait for receives that name their
    # senders, in the order they were sent. A short group timeout: a hang fails fast.
    results = run_ranks(_refused_then_retried, world, env=NO_SHM, pg_timeout=20, timeout=120)
    total = float(sum(range(world)))
    assert results == [([total] * 3, float((r - 1) % world)) for r in range(world)], results


def _size_mismatch(rank, world):
    if rank == 1:
        dist.send(torch.ones(8), dst=0)
        dist.send(torch.full((2,), 5.0), dst=0)
        return None
    try:
        dist.recv(torch.empty(4), src=1)
    except RuntimeError as e:
        assert "has 32 bytes but the receive tensor holds 16" in str(e), str(e)
    else:
        raise AssertionError("a recv into a smaller tensor succeeded")
    t = torch.empty(2)
    dist.recv(t, src=1)  # the bad message was consumed: the next one is intact
    return t.tolist()


@shm_paths
def test_recv_of_the_wrong_size_raises_and_p2p_goes_on(path):
    assert run_ranks(_size_mismatch, 2, env=SHM_PATHS[path])[0] == [5.0, 5.0]


def _large_both_ways(rank, world):
    # Larger than the rings between two ranks: both sides stream at once.
    peer = 1 - rank
    out = torch.arange(3_000_000, dtype=torch.float32) + rank
    got = torch.empty_like(out)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, got, peer)])
    for w in works:
        w.wait()
    return torch.equal(got, torch.arange(3_000_000, dtype=torch.float32) + peer)


@shm_paths
def test_large_messages_stream_both_ways(path):
    assert all(run_ranks(_large_both_ways, 2, env=SHM_PATHS[path]))


@pytest.mark.parametrize("workers", ["0", "1"])
def test_oneccl_path_keeps_send_order_with_several_in_flight(tmp_path, workers):
    """oneCCL has no tags: on its path a recv takes a message from its sender. Handed to it all
    at once, several in flight between two ranks were matched out of send order (with a oneCCL
    worker in every run, 6-88 of 900; without, 2 of 300 once under load), so the transport hands
    them over one at a time per peer and direction (P2pTurn). Three in flight each way, 300
    rounds, with and without a worker: every message must hold its own send's values."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "p2p_order.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "ONECCL_"))}
    out = subprocess.run([sys.executable, str(script), "--workers", workers, "--in-flight", "3", "--rounds", "300"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    setting = "CCL_WORKER_OFFLOAD=1, CCL_WORKER_COUNT=1" if workers == "1" else "CCL_WORKER_OFFLOAD=0, CCL_WORKER_COUNT=None"
    for rank in (0, 1):
        assert f"rank {rank}: 0 of 900 messages out of order ({setting})" in out.stdout, out


def _queued_recv_on_a_broken_group(rank, world):
    from harness import announce, await_announcement

    if rank == 1:
        await_announcement("rank 0 done")  # sends nothing: rank 0's first recv times out
        return "absent"
    try:
        first, second = torch.zeros(1 << 10), torch.zeros(1 << 10)
        waiting = dist.irecv(first, 1, tag=0)
        queued = dist.irecv(second, 1, tag=1)  # behind the first in its line (P2pTurn)
        outcomes = []
        for work in (waiting, queued):
            try:
                work.wait()
                outcomes.append("completed")
            except dist.DistBackendError as e:
                outcomes.append(str(e).split("\n")[0])
        return outcomes
    finally:
        announce("rank 0 done")


def test_oneccl_path_fails_a_queued_recv_once_the_group_broke():
    """On the oneCCL path a recv queued behind one that times out (its turn never comes) fails
    at once with the reason the group broke, instead of being handed to oneCCL on the broken
    group once its turn comes (or timing out on its own)."""
    first, second = run_ranks(_queued_recv_on_a_broken_group, 2, pg_timeout=3, env=NO_SHM)[0]
    assert "did not complete within 3000 ms" in first, first
    assert "not started: the process group broke while it waited" in second, second
    assert "did not complete within 3000 ms" in second, second  # the first one's reason


def _batches_after_a_refusal(rank, world):
    """A batch refused part-way (a transposed view: gloo refuses it too) leaves the group, and the
    next batch, usable; a batch whose send waits for the peer's later recv does not hold back a
    collective issued after it (batches of send/recv complete in any order, as p2p does)."""
    expect_transport()
    peer = 1 - rank
    try:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2, 3).t(), peer)])
    except RuntimeError as e:
        assert "not contiguous" in str(e), str(e)
    else:
        raise AssertionError("a non-contiguous send was accepted")
    big = torch.full((4 << 20,), float(rank))  # 16 MiB: more than the rings hold, so it waits for the recv
    sending = dist.batch_isend_irecv([dist.P2POp(dist.isend, big, peer)])
    x = torch.ones(4)
    dist.all_reduce(x)  # each rank's recv comes only after this returns
    got = torch.empty_like(big)
    dist.recv(got, peer)
    for w in sending:
        w.wait()
    return x.tolist(), got[0].item(), got[-1].item()


def test_batches_after_a_refusal_and_beside_collectives(transport):
    got = run_ranks(_batches_after_a_refusal, 2, pg_timeout=30, env=TRANSPORTS[transport])
    assert got == [([2.0] * 4, 1.0, 1.0), ([2.0] * 4, 0.0, 0.0)], got
