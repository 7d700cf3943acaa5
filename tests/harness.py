"""Runs a function on N real processes joined by a real ccl process group.

Each rank is a fresh interpreter (multiprocessing "spawn"), rendezvous goes
through a FileStore in a temporary folder (no ports to collide), and every
rank's return value or traceback comes back to the test.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import subprocess
import tempfile
import time
import traceback

import torch.multiprocessing as mp


class RankFailure(AssertionError):
    pass


def run_job(cmd, cwd, env, timeout=180):
    """Runs a launcher (torchrun, mpirun, ...) and returns its output; fails on a non-zero exit.
    It gets its own session so a timeout kills the ranks too, not only the launcher."""
    cmd = [str(c) for c in cmd]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout} s:\n{stdout}{stderr}") from None
    out = stdout + stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out}"
    return out


def _entry(fn, rank, world, store_path, results, args, env, pg_timeout, backend):
    os.environ.update(env)
    try:
        import torch.distributed as dist

        import oneccl_bind_pt  # noqa: F401

        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args)
        results.put((rank, True, value))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world, *args, timeout=180, env=None, pg_timeout=60, backend="ccl"):
    """Runs fn(rank, world, *args) on `world` processes; returns the values by rank.

    The default group uses `backend` (ccl unless a test wants gloo's answer).

    Raises RankFailure with every failing rank's traceback, or when a rank
    hangs past `timeout` seconds.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world, store_path, results, args, dict(env or {}), pg_timeout, backend),
                daemon=True,
            )
            for rank in range(world)
        ]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + timeout
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
                got[rank] = (ok, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    problems = []
    for rank in range(world):
        if rank not in got:
            problems.append(f"rank {rank}: no result (hung past {timeout} s or died, exit code {procs[rank].exitcode})")
        elif not got[rank][0]:
            problems.append(f"rank {rank} raised:\n{got[rank][1]}")
    if problems:
        raise RankFailure("\n".join(problems))
    return [got[r][1] for r in range(world)]
