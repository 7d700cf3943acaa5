"""Backend abort(), shutdown() and shrink() through torch's own entry points, on both
transports.

abort: every op in flight on the group raises a DistBackendError that names abort, within
1 s, and the process can make a new group and use it. shutdown (what destroy_process_group
calls): ops in flight complete first. shrink (torch.distributed.shrink_group): the
survivors of a SIGKILL train on (examples/elastic_shrink.py)."""

import json
import re
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from harness import (TRANSPORTS, announce, await_announcement, communicate, free_port, popen, require, run_job,
                     run_ranks)
from test_launchers import ROOT
from test_two_hosts import two_hosts  # noqa: F401  the fixture

# torch 2.10 added shrink_group (and Backend::shrink); on 2.9 there is nothing to call.
needs_shrink = pytest.mark.skipif(not hasattr(dist, "shrink_group"),
                                  reason=f"torch 2.10 added shrink_group; this is torch {torch.__version__}")


def _new_world(rank, world, store):
    dist.init_process_group("ccl", init_method=f"file://{store}", rank=rank, world_size=world)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    return t[0].item()


def _abort_in_flight(rank, world, second_store):
    store = dist.distributed_c10d._get_default_store()  # outlives the aborted group
    if rank == 0:
        t = torch.ones(1 << 20)  # both transports' large-message paths
        work = dist.all_reduce(t, async_op=True)  # rank 1 never joins it
        assert not work.is_completed()
        aborted = {}

        def abort():
            aborted["at"] = time.monotonic()
            dist.distributed_c10d._abort_process_group()  # WORLD: torch aborts every group, then forgets them

        thread = threading.Thread(target=abort)
        thread.start()
        with pytest.raises(dist.DistBackendError, match="abort") as raised:
            work.wait()
        took = time.monotonic() - aborted["at"]
        thread.join()
        assert took < 1.0, took
        announce("rank 0 aborted", store)
        message = str(raised.value).splitlines()[0]
    else:
        await_announcement("rank 0 aborted")
        dist.destroy_process_group()
        message = None
    return message, _new_world(rank, world, second_store)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_fails_the_ops_in_flight_and_a_new_group_works(transport, tmp_path):
    # pg_timeout 60 s: the op would wait that long; abort must end it within 1 s.
    got = run_ranks(_abort_in_flight, 2, str(tmp_path / "second"), env=TRANSPORTS[transport], pg_timeout=60)
    message, total = got[0]
    assert "aborted" in message and "allreduce" in message, message
    assert [g[1] for g in got] == [3.0, 3.0]


class _SlowToRecordTheAbandonedOp(dist.Store):
    """Rank 0's store, over the group's file: writing the key by which abort() tells the peers
    that an op stays inside oneCCL takes 2 s (a loaded machine, a remote store)."""

    def __init__(self, path, world):
        super().__init__()
        self._store = dist.FileStore(path, world)

    def set(self, key, value):
        if key.endswith("abandoned_op"):
            time.sleep(2)
        self._store.set(key, value)

    def get(self, key):
        return self._store.get(key)

    def add(self, key, value):
        return self._store.add(key, value)

    def check(self, keys):
        return self._store.check(keys)

    def wait(self, keys, timeout=None):
        return self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)


def _abort_then_tell_the_peer(rank, world, path, second_store):
    dist.destroy_process_group()  # the harness's group; this one's store is ours
    store = _SlowToRecordTheAbandonedOp(path, world) if rank == 0 else dist.FileStore(path, world)
    dist.init_process_group("ccl", store=store, rank=rank, world_size=world)
    if rank == 0:
        work = dist.all_reduce(torch.ones(1 << 20), async_op=True)  # rank 1 never joins it
        dist.distributed_c10d._abort_process_group()
        with pytest.raises(dist.DistBackendError, match="abort"):
            work.wait()
        store.set("harness/aborted", "1")
    else:
        store.wait(["harness/aborted"])
        dist.destroy_process_group()  # must see the key: not free the communicator under rank 0's op
    return _new_world(rank, world, second_store)


def test_a_peer_told_of_an_abort_finds_the_abandoned_op_recorded(tmp_path):
    # Once abort() returned before its key landed: the peer freed its oneCCL communicator,
    # the next one reused its id, the abandoned op took its messages and both ranks hung.
    got = run_ranks(_abort_then_tell_the_peer, 2, str(tmp_path / "store"), str(tmp_path / "second"),
                    env=TRANSPORTS["oneccl"], timeout=90)
    assert got == [3.0, 3.0]


def _abort_twice(rank, world):
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    dist.barrier()
    backend.abort()
    backend.abort()  # an aborted group: nothing happens
    with pytest.raises(RuntimeError, match="abort"):
        dist.all_reduce(torch.ones(4))
    return True


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_twice_does_nothing_and_later_ops_name_it(transport):
    # The harness then destroys the aborted group: that must return, too.
    assert run_ranks(_abort_twice, 2, env=TRANSPORTS[transport]) == [True, True]


def _shutdown_drains(rank, world, second_store):
    t = torch.full((1 << 18,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        assert not work.is_completed()  # rank 1 joins only when told
        announce("rank 0 destroys its group")
    else:
        await_announcement("rank 0 destroys its group")
        work = dist.all_reduce(t, async_op=True)
    dist.destroy_process_group()  # shutdown(): waits for the op instead of failing it
    assert work.is_completed()
    work.wait()
    assert t[0].item() == 3.0 and t[-1].item() == 3.0
    return _new_world(rank, world, second_store)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_destroy_waits_for_ops_in_flight(transport, tmp_path):
    assert run_ranks(_shutdown_drains, 2, str(tmp_path / "second"), env=TRANSPORTS[transport]) == [3.0, 3.0]


@needs_shrink
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shrink_example_trains_on_after_a_rank_is_killed(transport):
    # On oneCCL the survivors learn of the death at the group timeout (--timeout 5).
    out = run_job([sys.executable, "examples/elastic_shrink.py", "--port", str(free_port()), "--timeout", "5"],
                  cwd=ROOT, env={**os.environ, **TRANSPORTS[transport]}, timeout=300)
    for rank in (0, 1):
        assert f"rank {rank}: step 5 failed" in out, out
        assert f"rank {rank}: now rank {rank} of 2; redoing step 5" in out, out
    assert "2 survivors trained 10 steps; parameters agree" in out, out
    assert "exit codes [0, 0, -9]" in out, out


@needs_shrink
def test_shrink_example_across_two_hosts(two_hosts):  # noqa: F811
    # Rank 0 on one network-namespace host, ranks 1 and 2 on the other; rank 2 dies, so the
    # survivors' new group spans the hosts: oneCCL over the veth link.
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CCL_", "FI_", "MASTER_", "ONECCL_"))}
    procs = [
        popen(two_hosts.on(k, [sys.executable, "examples/elastic_shrink.py", "--ranks", ranks,
                               "--master-addr", two_hosts.addr[0], "--port", port, "--timeout", "10"]),
              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for k, ranks in ((0, "0"), (1, "1,2"))
    ]
    host_a, host_b = communicate(procs, 300)
    out = host_a + host_b
    for rank in (0, 1):
        assert f"rank {rank}: now rank {rank} of 2; redoing step 5" in out, out
    assert "2 survivors trained 10 steps; parameters agree" in host_a, out
    assert "exit codes [0]" in host_a and "exit codes [0, -9]" in host_b, out


def _shrink_a_running_rank(rank, world):
    if rank < 2:
        with pytest.raises(dist.DistBackendError, match=r"rank 2 \(pid \d+\) is still running"):
            dist.shrink_group([2])
    dist.barrier()  # the group is untouched: every rank, the one named too, goes on with it
    t = torch.ones(3)
    dist.all_reduce(t)
    return t[0].item()


@needs_shrink
def test_shrink_of_a_rank_still_running_raises_on_every_caller():
    # Only on one host can a rank see that another's process still runs.
    assert run_ranks(_shrink_a_running_rank, 3, env=TRANSPORTS["shm"]) == [3.0, 3.0, 3.0]


@pytest.mark.timeout(1200)  # above the script's own 900 s bound
def test_fault_matrix_one_trial_per_cell(tmp_path):
    # The reduced matrix (scripts/fault_matrix.py; docs/reliability.md has the full table):
    # every fault on both transports, once, on this release; the partition rows when this
    # machine can make network-namespace hosts (root, as in CI).
    report = tmp_path / "faults.json"
    proc = popen([sys.executable, "scripts/fault_matrix.py", "--trials", "1", "--json", report], cwd=ROOT,
                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = communicate([proc], 900)
    cells = json.loads(report.read_text())["cells"]
    expected = {f"{fault} {transport}" for fault in ("kill", "stop", "store", "abort") for transport in ("shm", "oneccl")}
    left_out = re.search(r"the partition rows are left out: (.*)", out)
    require(not left_out, left_out and left_out.group(1))
    expected |= {"link-down oneccl", "drop oneccl"}
    assert set(cells) == expected, (sorted(cells), out)
    red = {cell: {k: runs[0][k] for k in ("why", "errors", "logs", "hung_stacks")}
           for cell, runs in cells.items() if not runs[0]["ok"]}
    assert not red, f"{json.dumps(red, indent=1)}\n{out}"
