"""Bad input raises a Python error naming the op and the problem; the group
stays usable. A collective that cannot complete raises at the group timeout."""

import datetime
import os
import re
import select
import socket
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from harness import (TRANSPORTS, RankFailure, all_gather_single, announce, await_announcement, expect_transport,
                     reduce_scatter_single, run_ranks)
from matrix import expect_error


def _pg():
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


# torch 2.13 refuses monitored_barrier itself for every backend but gloo (a ValueError);
# from 2.14 it asks the backend, whose default (gloo alone overrides it) raises a RuntimeError.
_TORCH_MINOR = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
MONITORED_BARRIER_ERROR = RuntimeError if _TORCH_MINOR >= (2, 14) else ValueError
MONITORED_BARRIER_NEEDLE = "monitoredBarrier" if _TORCH_MINOR >= (2, 14) else "monitored_barrier"


def _cases(rank, world):
    """name -> (call, words its ccl error message must contain). Every rank errs."""
    pg = _pg()
    nc = torch.ones(4, 4)[:, ::2]  # neither contiguous nor dense
    meta = torch.empty(4, device="meta")
    return {
        "non-contiguous all_gather input": (
            lambda: dist.all_gather([torch.empty(4, 2) for _ in range(world)], nc), ["allgather", "not contiguous"]),
        "non-contiguous all_reduce": (lambda: dist.all_reduce(nc), ["allreduce", "not contiguous"]),
        # (dist.all_reduce on a meta tensor never reaches a backend: torch's meta kernel answers.)
        "meta tensor": (lambda: pg.allreduce([meta]).wait(), ["allreduce", "meta", "CPU"]),
        "meta tensor broadcast": (lambda: pg.broadcast([meta]).wait(), ["broadcast", "meta"]),
        "output too small": (
            lambda: all_gather_single(torch.empty(3), torch.ones(2)), ["all_gather_single", "elements"]),
        "reduce_scatter_tensor sizes": (
            lambda: reduce_scatter_single(torch.empty(2), torch.ones(2 * world + 1)),
            ["reduce_scatter_single", "elements"]),
        "gather list length": (
            # every rank errs (the root's list is short, the others pass one): an
            # error on one rank only would leave its peers inside the collective.
            lambda: pg.gather([[torch.empty(2)]], [torch.ones(2)], dist.GatherOptions()).wait(),
            ["gather"]),
        "mixed dtypes all_gather": (
            lambda: pg.allgather([[torch.empty(2, dtype=torch.int32) for _ in range(world)]], [torch.ones(2)]).wait(),
            ["allgather", "dtype", "torch.int32", "torch.float32"]),
        "all_gather slot size": (
            lambda: dist.all_gather([torch.empty(3) for _ in range(world)], torch.ones(2)), ["allgather", "elements"]),
        "root out of range": (
            lambda: _broadcast_root(pg, world),
            ["broadcast", "out of range"]),
        "reduce root out of range": (lambda: _reduce_root(pg, -1), ["reduce", "out of range"]),
        "send to self": (lambda: pg.send([torch.ones(2)], rank, 0).wait(), ["send", "itself"]),
        "recv peer out of range": (lambda: pg.recv([torch.ones(2)], world, 0).wait(), ["recv", "out of range"]),
        # The bytes go as they lie; the peer's tensor may lie otherwise (gloo and NCCL refuse too).
        "send not contiguous": (lambda: pg.send([torch.ones(2, 3).t()], (rank + 1) % world, 0).wait(),
                                ["send", "not contiguous", "contiguous()"]),
        "recv not contiguous": (lambda: pg.recv([torch.empty(2, 3).t()], (rank + 1) % world, 0).wait(),
                                ["recv", "not contiguous", "contiguous()"]),
        "send channels_last": (
            lambda: pg.send([torch.ones(1, 4, 2, 2).to(memory_format=torch.channels_last)], (rank + 1) % world, 0).wait(),
            ["send", "not contiguous"]),
        "bad split sizes": (
            lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world), [1] * world, [2] * world),
            ["all_to_all_single", "split sizes"]),
        "split count": (
            lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world), None, [world]),
            ["all_to_all_single", "split sizes"]),
        "indivisible dim 0": (
            lambda: dist.all_to_all_single(torch.empty(world + 1), torch.ones(world + 1)),
            ["all_to_all_single", "divisible"]),
        "bitwise on float": (lambda: dist.all_reduce(torch.ones(2), op=ReduceOp.BAND), ["allreduce", "BAND", "float32"]),
        "premul on int": (
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0)),
            ["allreduce", "PREMUL_SUM", "int32"]),
        "unreducible dtype": (
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.uint16)), ["allreduce", "uint16", "float32"]),
        "float8 reduce": (
            lambda: reduce_scatter_single(torch.empty(1, dtype=torch.float8_e4m3fn),
                                               torch.zeros(world, dtype=torch.float8_e4m3fn)),
            ["reduce_scatter_single", "float8"]),
        "monitored_barrier": (lambda: dist.monitored_barrier(), [MONITORED_BARRIER_NEEDLE]),
    }


def _bad_inputs(rank, world):
    failures = {}
    for name, (fn, needles) in _cases(rank, world).items():
        types = (MONITORED_BARRIER_ERROR,) if name == "monitored_barrier" else (RuntimeError,)
        try:
            expect_error(fn, *needles, types=types)
        except AssertionError as e:
            failures[name] = str(e)
    return failures


def _broadcast_root(pg, world):
    opts = dist.BroadcastOptions()
    opts.rootRank = world
    pg.broadcast([torch.ones(2)], opts).wait()


def _reduce_root(pg, root):
    opts = dist.ReduceOptions()
    opts.rootRank = root
    pg.reduce([torch.ones(2)], opts).wait()


# Not run on gloo: it aborts the process on the first two (a failed CHECK, not an
# exception); it does not refuse a recv from a rank outside the group but waits the
# group's timeout (60 s here), and the recv it left posted crashed a later run with
# SIGSEGV (1 run in 6 on torch 2.14.1); it supports monitored_barrier.
GLOO_SKIPS = {"reduce_scatter_tensor sizes", "float8 reduce", "recv peer out of range", "monitored_barrier"}


def _error_classes(rank, world):
    """For each bad input the current backend refuses: its exception's classes."""
    got = {}
    for name, (fn, _) in _cases(rank, world).items():
        if dist.get_backend() == "gloo" and name in GLOO_SKIPS:
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            got[name] = [c.__name__ for c in type(e).__mro__]
    return got


def test_errors_are_the_kind_gloo_raises():
    """Code written for gloo catches RuntimeError: every refusal of ours is one, and
    where torch itself refuses (ValueError before any backend), it stays so."""
    gloo = run_ranks(_error_classes, 2, backend="gloo")[0]
    ccl = run_ranks(_error_classes, 2)[0]
    assert len(gloo) >= 10, gloo  # the comparison below must have something to compare
    for name, classes in ccl.items():
        if name == "monitored_barrier":
            continue  # torch's own refusal (MONITORED_BARRIER_ERROR)
        assert "RuntimeError" in classes, f"{name}: ccl raised {classes[0]}, not a RuntimeError"
        if name in gloo:
            for kind in ("ValueError", "TypeError"):  # torch's Python checks, same for every backend
                assert kind not in gloo[name] or kind in classes, f"{name}: gloo raised {gloo[name]}, ccl {classes}"
    # Ours are RuntimeErrors that also keep the ValueError / TypeError we raised before.
    assert {"ArgumentError", "DistBackendError", "RuntimeError", "ValueError"} <= set(ccl["root out of range"])
    assert {"ArgumentTypeError", "RuntimeError", "TypeError"} <= set(ccl["unreducible dtype"])


@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_and_group_survives(world):
    for rank, failures in enumerate(run_ranks(_bad_inputs, world)):
        assert not failures, f"rank {rank}: {failures}"


# Upper bounds on a timeout's wait leave room for a loaded machine: they tell
# "raised at the timeout" from "hung until the peer left", who stays until then.
def _collective_times_out(rank, world):
    expect_transport()
    t = torch.ones(4)
    if rank == 1:
        await_announcement("rank 0 done")  # never joins the first all_reduce
        return "absent"
    try:
        start = time.monotonic()
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as e:
            waited = time.monotonic() - start
            msg = str(e)
            assert "allreduce" in msg and "did not complete within 3000 ms" in msg, msg
            # The roll call at the timeout: rank 1 is alive but elsewhere, so it never signs in.
            assert "Of the other ranks, rank 1 has not timed out within 500 ms of this one" in msg, msg
            assert 2.5 < waited < 30, waited
        else:
            raise AssertionError("all_reduce did not time out")
        # The group refuses further work instead of mixing up collectives, with the failure's
        # type (what code that shrinks or restarts on failure catches).
        try:
            dist.all_reduce(t)
        except dist.DistBackendError as e:
            assert "unusable" in str(e) and "rank 1 has not timed out" in str(e), str(e)
        else:
            raise AssertionError("a timed-out group accepted new work")
        return "timed out"
    finally:
        announce("rank 0 done")


def test_group_timeout_raises_instead_of_hanging(transport):
    assert run_ranks(_collective_times_out, 2, pg_timeout=3, env=TRANSPORTS[transport]) == ["timed out", "absent"]


def _both_wait_to_receive(rank, world):
    # Every rank waits for a message nobody sends: all time out together, none is missing.
    try:
        dist.recv(torch.zeros(4), 1 - rank)
    except dist.DistBackendError as e:
        return str(e).split("\n")[0]
    return "received"


def test_timeout_of_every_rank_says_none_is_missing(transport):
    for rank, msg in enumerate(run_ranks(_both_wait_to_receive, 2, pg_timeout=3, env=TRANSPORTS[transport])):
        assert "did not complete within 3000 ms" in msg and "Every other rank timed out too: none is missing" in msg, (
            rank, msg)


def _mismatched(rank, world, case):
    """Ranks call collectives that do not match: each must come back (raise, or return where
    oneCCL cannot tell) within the group timeout, never stay inside the transport."""
    start = time.monotonic()
    try:
        if case == "sizes":  # rank 1's receive is smaller than what rank 0 sends
            dist.all_reduce(torch.ones(1 << 20 if rank == 0 else 1 << 10))
        else:  # "skipped": rank 1 misses an op, as torch's abort does to an op issued meanwhile
            if rank == 0:
                dist.all_reduce(torch.ones(1 << 16))
            x = torch.ones(1 << 18)
            dist.all_to_all_single(torch.empty_like(x), x)
        outcome = "returned"
    except dist.DistBackendError as e:
        msg = str(e)
        assert "Timed out" in msg or "called different collectives" in msg, msg
        outcome = "timed out" if "Timed out" in msg else "mismatch"
    waited = time.monotonic() - start
    assert waited < 30, f"rank {rank} came back after {waited:.0f} s; the group timeout is 3 s"
    return outcome


# Over oneCCL (across hosts, or ONECCL_BIND_PT_SHM=0) a message larger than the receive it
# met made libfabric's cross-memory-attach copy loop for good: one rank never came back.
# On shared memory every rank raises the mismatch at once.
@pytest.mark.parametrize("case", ["sizes", "skipped"])
def test_mismatched_collectives_come_back_within_the_timeout(case, transport):
    outcomes = run_ranks(_mismatched, 2, case, pg_timeout=3, timeout=60, env=TRANSPORTS[transport])
    if transport == "shm":
        assert outcomes == ["mismatch", "mismatch"]
    else:  # oneCCL cannot compare the ranks' calls; rank 0's op cannot complete
        assert outcomes[0] == "timed out", outcomes


def _barrier_times_out(rank, world):
    if rank == 1:
        await_announcement("rank 0 done")  # never joins the barrier
        return "absent"
    try:
        start = time.monotonic()
        try:
            dist.barrier()
        except RuntimeError as e:
            waited = time.monotonic() - start
            # The words PyTorch's own barrier-timeout test accepts from gloo.
            assert re.search(" (Timed out|closed|timeout) ", str(e)), str(e)
            assert 1.5 < waited < 30, waited
            return "timed out"
        raise AssertionError("barrier returned without its peer")
    finally:
        announce("rank 0 done")


# oneCCL's own barrier blocks until every rank arrives; ours must give up at
# the group's timeout on both transports, as gloo's does.
@pytest.mark.parametrize("setup", [("gloo", {}), ("ccl", {"ONECCL_BIND_PT_SHM": "1"}), ("ccl", {"ONECCL_BIND_PT_SHM": "0"})],
                         ids=["gloo", "ccl-shm", "ccl-oneccl"])
def test_barrier_times_out_like_gloo(setup):
    backend, env = setup
    assert run_ranks(_barrier_times_out, 2, pg_timeout=2, env=env, backend=backend) == ["timed out", "absent"]


def _outlives_rank_0(rank, world):
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank 0 pid", str(os.getpid()))
        with pytest.raises(RuntimeError, match="Timed out"):
            dist.barrier()
        announce("rank 0 timed out")
        return "timed out"  # then the harness destroys the group and the process exits
    rank_0 = os.pidfd_open(int(store.get("rank 0 pid")))
    await_announcement("rank 0 timed out")
    assert select.select([rank_0], [], [], 60)[0], "rank 0's process did not exit within 60 s"
    return "outlived"  # the harness destroys the group: the process must exit 0


# Rank 0 hosts oneCCL's key-value store; the survivor's teardown must not need it
# (oneCCL throws from a destructor there and aborts the process). The harness fails
# a rank that returns its result and then dies.
def test_survivor_destroys_its_group_after_rank_0_exited(transport):
    assert run_ranks(_outlives_rank_0, 2, pg_timeout=2, env=TRANSPORTS[transport]) == ["timed out", "outlived"]


def _one_rank_misconfigured(rank, world):
    """Rank 1, then rank 0 (who hosts oneCCL's key-value store), alone sets a bad staging
    chunk and every rank creates a group. Returns what each creation raised, and how long
    it took, on each rank."""
    outcomes = []
    for bad in (1, 0):
        if rank == bad:
            os.environ["ONECCL_BIND_PT_SHM_CHUNK_BYTES"] = "abc"
        start = time.monotonic()
        try:
            dist.new_group(backend="ccl", timeout=datetime.timedelta(seconds=60))
            outcomes.append(("created", 0.0))
        except (ValueError, dist.DistBackendError) as e:
            outcomes.append((f"{type(e).__name__}: {str(e).splitlines()[0]}", time.monotonic() - start))
        finally:
            os.environ.pop("ONECCL_BIND_PT_SHM_CHUNK_BYTES", None)
    # Both groups failed on every rank alike, so the next one is the same group everywhere.
    group = dist.new_group(backend="ccl")
    for g in (group, None):
        x = torch.full((5,), float(rank + 1))
        dist.all_reduce(x, group=g)
        assert x.tolist() == [float(sum(range(1, world + 1)))] * 5, x
    return outcomes


# A setting one rank alone gets wrong fails every rank's group creation at once, each
# saying which rank and why; without the announcement its peers waited out the timeout.
def test_a_bad_setting_on_one_rank_fails_every_rank_at_once(transport):
    by_rank = run_ranks(_one_rank_misconfigured, 3, env=TRANSPORTS[transport], timeout=300)
    bad_value = "ONECCL_BIND_PT_SHM_CHUNK_BYTES=abc is not a size from 64K to 2M"
    for case, bad in enumerate((1, 0)):
        for rank in range(3):
            outcome, waited = by_rank[rank][case]
            if rank == bad:
                assert outcome.startswith("ValueError: " + bad_value), (rank, outcome)
            else:
                assert outcome.startswith(f"DistBackendError: ccl rendezvous: rank {bad} could not create its "
                                          f"side of this process group: {bad_value}"), (rank, outcome)
                assert outcome.endswith(f"(rank {rank} gives up on this process group with it)"), (rank, outcome)
            # The group timeout is 60 s.
            assert waited < 30, f"rank {rank} took {waited:.0f} s to fail when rank {bad} was misconfigured"


def _never_runs(rank, world):
    raise AssertionError("the group was created although one rank could not create its side")


def _raised(text, rank):
    """The last line of rank's traceback in a RankFailure: its exception."""
    if f"rank {rank} raised:\n" not in text:
        pytest.fail(f"rank {rank} did not raise:\n{text}")
    part = text.split(f"rank {rank} raised:\n", 1)[1].split("\nrank ", 1)[0]
    return part.strip().splitlines()[-1]


# The same at init_process_group, a setting given to one rank by its launcher: read in Python
# (ONECCL_BIND_PT_WORKERS), in C++ before the rendezvous (ONECCL_BIND_PT_HELPERS), or by oneCCL
# after it (CCL_KVS_IFACE), where the others are already inside oneCCL's communicator creation,
# which has no time limit of its own.
@pytest.mark.parametrize("bad, variable, value, error, says, relayed", [
    (1, "ONECCL_BIND_PT_WORKERS", "x", "ValueError",
     "ONECCL_BIND_PT_WORKERS=x is not auto or a whole number from 0 to 64", None),
    (0, "ONECCL_BIND_PT_HELPERS", "x", "ValueError", "ONECCL_BIND_PT_HELPERS=x is not a whole number from 0 to 64",
     None),
    (1, "CCL_KVS_IFACE", "nosuch0", "torch.distributed.DistBackendError",
     "ccl: creating the oneCCL communicator (rank 1 of 2) failed: ", "creating its oneCCL communicator failed: "),
], ids=["workers-python", "helpers-c++", "kvs-iface-oneccl"])
def test_a_setting_one_rank_refuses_fails_init_on_every_rank_at_once(bad, variable, value, error, says, relayed):
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_runs, 2, rank_env={bad: {variable: value}}, pg_timeout=60, timeout=150)
    took = time.monotonic() - start
    text = str(caught.value)
    mine, theirs = _raised(text, bad), _raised(text, 1 - bad)
    assert mine.startswith(error + ": ") and says in mine, text
    assert theirs.startswith("torch.distributed.DistBackendError: ") and (
        f"rank {bad} could not create its side of this process group: {relayed or says}") in theirs, text
    assert took < 40, f"the ranks took {took:.0f} s to fail; the group timeout is 60 s"


# ONECCL_BIND_PT_SHM=0 on one rank only, at the first group: the group runs, through oneCCL on
# every rank (the ranks vote on oneCCL's own shared memory, which must be alike on all of them:
# before the vote, one rank's oneCCL transport failed to start and the other could hang).
def _runs_through_oneccl(rank, world):
    import torch

    assert os.environ["CCL_ATL_SHM"] == "1", os.environ["CCL_ATL_SHM"]
    pg = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    assert pg._path("allreduce", 4) == "oneccl" and pg._path("allreduce", 1 << 20) == "oneccl"
    t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * 3)
    out = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(out, torch.full((3,), float(rank)))
    assert [o.tolist() for o in out] == [[0.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("off", [0, 1])
def test_shared_memory_off_on_one_rank_at_init_runs_the_group_through_oneccl(off):
    run_ranks(_runs_through_oneccl, 2, rank_env={off: {"ONECCL_BIND_PT_SHM": "0"}}, timeout=120)


# A oneCCL setting every rank must share, set differently by the user on one rank: every rank
# refuses the group at the rendezvous, before any creates its oneCCL communicator, and names what
# differs.
@pytest.mark.parametrize("env, says", [
    ({1: {"CCL_ATL_SHM": "1"}}, "CCL_ATL_SHM is 0 on rank 0 and 1 on rank 1"),
    ({0: {"CCL_ATL_TRANSPORT": "mpi"}}, "CCL_ATL_TRANSPORT is mpi on rank 0 and ofi on rank 1"),
    # oneCCL splits each collective into one part per worker: counts must match.
    ({1: {"CCL_WORKER_COUNT": "2", "CCL_WORKER_OFFLOAD": "1"}}, "CCL_WORKER_COUNT is 1 on rank 0 and 2 on rank 1"),
], ids=["atl-shm", "atl-transport", "worker-count"])
def test_a_oneccl_setting_that_differs_between_ranks_fails_every_rank_at_the_rendezvous(env, says):
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_ranks(_never_runs, 2, rank_env=env, pg_timeout=60, timeout=150)
    took = time.monotonic() - start
    text = str(caught.value)
    for rank in range(2):
        said = _raised(text, rank)
        assert said.startswith("torch.distributed.DistBackendError: ccl rendezvous: the ranks of this process group "
                               "have different oneCCL settings"), text
        assert says in said and said.endswith(f"(rank {rank} gives up on this process group with it)"), text
    assert "oneCCL:" not in text, text  # refused before oneCCL was asked to connect them
    assert took < 30, f"the ranks took {took:.0f} s to fail; the group timeout is 60 s"


def _peer_never_reaches_oneccl(rank, world):
    """A group of 2 made by this one process, whose peer "arrives" at the rendezvous (its marks,
    written here as that rank would) and then never takes part in oneCCL's communicator
    creation, which waits for every rank with no time limit of its own: a peer that died or
    hung right after the rendezvous, deterministically."""
    store = dist.PrefixStore("lonely", dist.distributed_c10d._get_default_store())
    store.set("oneccl/arrived/1", "elsewhere/1")
    store.add("oneccl/arrived", 1)
    start = time.monotonic()
    try:
        dist.ProcessGroupCCL(store, 0, 2, datetime.timedelta(seconds=4))
    except dist.DistBackendError as e:
        # What ranks still waiting read (a peer that comes late fails at once with it).
        return str(e).splitlines()[0], time.monotonic() - start, store.get("oneccl/failed").decode()
    raise AssertionError("a group was made with a rank that never took part")


# The group's timeout bounds oneCCL's communicator creation: the rank leaves it behind (the thread
# stays inside oneCCL), says why, tells the group, and its process still ends cleanly.
def test_communicator_creation_gives_up_at_the_timeout():
    said, took, told = run_ranks(_peer_never_reaches_oneccl, 1, timeout=120)[0]
    assert said.startswith("ccl: creating the oneCCL communicator (rank 0 of 2) did not complete within 4000 ms"), said
    assert 4 <= took < 15, took
    assert told == "rank 0 could not create its side of this process group: it gave up waiting for oneCCL's " \
                   "communicator after 4000 ms", told


def _rank_0_not_listening(rank, world):
    """Rank 1 of a group of 2 made by this one process, whose rank 0 "arrived" (its marks and
    its key-value store's address, written here as it would) and then does not take the
    connection: a rank 0 that died after the rendezvous, or listens where this host cannot
    reach it. oneCCL retries a refused connection for 120 s, whatever the group's timeout."""
    store = dist.PrefixStore("deaf", dist.distributed_c10d._get_default_store())
    with socket.socket() as bound:  # bound, never listening: connections to it are refused
        bound.bind(("127.0.0.1", 0))
        where = f"127.0.0.1:{bound.getsockname()[1]}"
        store.set("oneccl/arrived/0", "elsewhere/1")
        store.add("oneccl/arrived", 1)
        store.set("oneccl/kvs_address", where.replace(":", "_").encode().ljust(256, b"\0"))
        start = time.monotonic()
        try:
            dist.ProcessGroupCCL(store, 1, 2, datetime.timedelta(seconds=4))
        except dist.DistBackendError as e:
            return where, str(e).splitlines()[0], time.monotonic() - start, store.get("oneccl/failed").decode()
    raise AssertionError("a group was made with a rank 0 that never listened")


# Attaching to rank 0's key-value store is bounded by the group's timeout too, and the error says
# where rank 0 was to be found and what a connection there met.
def test_a_rank_0_that_does_not_listen_is_named_at_the_timeout():
    where, said, took, told = run_ranks(_rank_0_not_listening, 1, timeout=120)[0]
    reach = f"could not reach rank 0's oneCCL key-value store at {where}"
    assert said.startswith("ccl: creating the oneCCL communicator (rank 1 of 2) did not complete within 4000 ms: "
                           f"it {reach} (Connection refused): rank 0 may have died"), said
    assert 4 <= took < 15, took
    assert told == f"rank 1 could not create its side of this process group: it {reach} within 4000 ms " \
                   "(Connection refused)", told


def _one_rank_without_shm(rank, world):
    if rank == 1:
        os.environ["ONECCL_BIND_PT_SHM"] = "0"  # read at each group's creation
    group = dist.new_group(backend="ccl")
    x = torch.full((1000,), float(rank + 1))
    dist.all_reduce(x, group=group)
    assert x.eq(3).all(), x
    return group._get_backend(torch.device("cpu"))._path("allreduce", 4000)


# ONECCL_BIND_PT_SHM=0 on one rank only, for a group made after the first: the whole group takes
# oneCCL (the others waited out the timeout in the shared-memory exchange that rank skipped).
# (At the first group, see test_shared_memory_off_on_one_rank_at_init_runs_the_group_through_oneccl.)
def test_shared_memory_off_on_one_rank_sends_the_group_to_oneccl():
    start = time.monotonic()
    assert run_ranks(_one_rank_without_shm, 2, pg_timeout=60, timeout=150) == ["oneccl", "oneccl"]
    assert time.monotonic() - start < 40


def _same_name_again(rank, world):
    """Groups of one name, one after another: new_group(use_local_synchronization=True) names a
    group after its ranks, so each gets the same store keys. Twice made and destroyed, once failed
    (a bad setting on rank 1), then made again. Returns each try's outcome."""
    outcomes = []
    for attempt in range(4):
        bad = attempt == 2 and rank == 1
        if bad:
            os.environ["ONECCL_BIND_PT_SHM_CHUNK_BYTES"] = "abc"
        start = time.monotonic()
        try:
            group = dist.new_group([0, 1], use_local_synchronization=True, timeout=datetime.timedelta(seconds=60))
        except (ValueError, dist.DistBackendError) as e:
            outcomes.append(f"failed: {type(e).__name__}")
            continue
        finally:
            os.environ.pop("ONECCL_BIND_PT_SHM_CHUNK_BYTES", None)
            # The group timeout is 60 s: a try that reads the last group's keys waits it out, or hangs.
            assert time.monotonic() - start < 30, f"try {attempt} took {time.monotonic() - start:.0f} s"
        expect_transport(group)
        x = torch.full((1000,), float(rank + 1 + attempt))
        dist.all_reduce(x, group=group)
        assert x.eq(3 + 2 * attempt).all(), (attempt, x)
        dist.destroy_process_group(group)
        outcomes.append("made")
    return outcomes


def _first_ccl_groups_differ(rank, world, direct):
    """The default group is gloo's; rank 0 makes a ccl group of its own first, then every rank makes
    one of all: rank 0's second ccl group, the others' first."""
    import oneccl_bind_pt

    dist.new_group([0], backend="ccl")  # every rank calls new_group; only rank 0 is a member
    start = time.monotonic()
    if direct:  # as torch-ccl's users built them
        store = dist.PrefixStore("all", dist.distributed_c10d._get_default_store())
        pg = oneccl_bind_pt.ProcessGroupCCL(store, rank, world, datetime.timedelta(seconds=60))
        x = torch.full((3,), float(rank + 1))
        pg.allreduce([x]).wait()
    else:
        group = dist.new_group(list(range(world)), backend="ccl", timeout=datetime.timedelta(seconds=60))
        x = torch.full((3,), float(rank + 1))
        dist.all_reduce(x, group=group)
    return x.tolist(), time.monotonic() - start


# The package's defaults are exchanged at a process's first ccl group. A group that is some ranks'
# first and others' later one is met at once: the others post their answers again (before, the
# first-timers waited for them until the group's timeout, 30 minutes by default, then failed).
@pytest.mark.parametrize("direct", [False, True], ids=["new_group", "ProcessGroupCCL"])
def test_a_group_some_ranks_make_first_and_others_later(direct):
    for x, took in run_ranks(_first_ccl_groups_differ, 3, direct, backend="gloo", timeout=150):
        assert x == [6.0] * 3, x
        assert took < 30, f"the group took {took:.0f} s to make; its timeout is 60 s"


# A group made again under the name of one destroyed (or of one that failed) must not read the
# last one's keys: before, the second lost shared memory (its peers' old segments) and the third
# hung in oneCCL on the old key-value store's address.
def test_a_group_made_again_under_the_same_name(transport):
    outcomes = ["made", "made", "failed: {}", "made"]
    by_rank = run_ranks(_same_name_again, 2, env=TRANSPORTS[transport], timeout=200)
    assert by_rank[0] == [o.format("DistBackendError") for o in outcomes], by_rank
    assert by_rank[1] == [o.format("ValueError") for o in outcomes], by_rank


def _dense_layouts(rank, world):
    # Element-wise ops accept any dense layout (every rank holds the same one).
    t = (torch.arange(8.0).reshape(2, 4) + rank).t()  # column-major view
    assert not t.is_contiguous()
    dist.all_reduce(t)
    expected = sum(torch.arange(8.0).reshape(2, 4) + r for r in range(world)).t()
    assert torch.equal(t, expected)
    return True


def test_dense_non_contiguous_all_reduce():
    assert all(run_ranks(_dense_layouts, 2))


def _groups_until_oneccl_refuses(rank, world):
    """Groups kept alive until oneCCL has no communicator id left for another."""
    groups, said = [], None
    for _ in range(200):
        try:
            g = dist.new_group(list(range(world)))
        except dist.DistBackendError as e:
            said = str(e).splitlines()[0]
            break
        x = torch.ones(2)
        dist.all_reduce(x, group=g)
        groups.append(g)
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)  # the groups made before still work
    return len(groups), said, x.tolist()


# oneCCL holds a limited number of communicators in a process and says only "unexpected comm_id"
# when it has none left: the error names the limit and what to do, on every rank, and the groups
# made before stay usable.
@pytest.mark.parametrize("transport", ["shm", "oneccl"])
def test_running_out_of_oneccl_communicators_says_why(transport):
    ranks = run_ranks(_groups_until_oneccl_refuses, 2, env=TRANSPORTS[transport], timeout=300)
    for made, said, x in ranks:
        assert made == 127, made  # with the default group: 128
        assert said is not None and said.count("oneCCL ran out of communicator ids: a process holds at most 128 "
                                               "oneCCL communicators") == 1 and "destroy_process_group(group)" in said, said
        assert x == [3.0] * 3, x
