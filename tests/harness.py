"""Runs a function on N real processes joined by a real ccl process group, and the
helpers every test shares: waiting on an event, requiring a capability, ports.

Each rank is a fresh process forked from a server that has imported torch and
nothing else (multiprocessing "forkserver"), given the test's environment; rendezvous
goes through a FileStore in a temporary folder (no ports to collide), and every
rank's return value or traceback comes back to the test.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import filelock
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# torch 2.13 named these two; 2.9-2.12 have them only as all_gather_into_tensor and
# reduce_scatter_tensor (the same backend calls).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankFailure(AssertionError):
    pass


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(ok, why: str) -> None:
    """Skips the test when a capability it needs is missing (`ok` false), with `why`.

    Under CI=true that is a failure instead: CI must not pass without having run
    what it claims to check."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"{why} (a skip here, but CI=true: what cannot be set up fails the run)", pytrace=False)
    pytest.skip(why, allow_module_level=True)


@functools.lru_cache(maxsize=None)
def apt_install(packages: tuple[str, ...], programs: tuple[str, ...]) -> str | None:
    """Installs Debian's `packages` unless all `programs` are found already; returns
    why they are still missing, or None. Needs root and apt-get."""
    def present():
        return all(shutil.which(p) or os.path.exists(f"/usr/sbin/{p}") for p in programs)

    if present():
        return None
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"needs {' '.join(packages)}: {' '.join(cmd)} (as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # Test files run side by side (pytest -n 2) and apt holds dpkg's lock: one install at a
    # time here, and apt itself waits for a lock another program holds instead of failing.
    wait = ["-o", "DPkg::Lock::Timeout=600"]
    with filelock.FileLock(Path(tempfile.gettempdir()) / "oneccl_bind_pt-test-apt.lock", timeout=1200):
        if present():
            return None
        if subprocess.run([cmd[0], *wait, *cmd[1:]], capture_output=True, env=env, timeout=900).returncode != 0:
            subprocess.run(["apt-get", *wait, "update"], capture_output=True, env=env, timeout=900)
            r = subprocess.run([cmd[0], *wait, *cmd[1:]], capture_output=True, text=True, env=env, timeout=900)
            if r.returncode != 0:
                return f"{' '.join(cmd)} failed: {r.stderr.strip()[-300:]}"
    return None if present() else f"{' '.join(packages)} installed but {list(programs)} not found"


def import_or_require(name: str):
    """The module `name`; without it, require() (a skip, a failure under CI=true)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        require(False, f"needs the {name} package ({e})")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Polls `predicate` until it returns something true, and returns that; after
    `timeout` seconds fails, naming `what` it waited for."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout} s for {what}")
        time.sleep(interval)


def helper_threads() -> int:
    """Inside a rank: how many of the backend's helper threads (src/helpers.cpp) it runs."""
    import glob

    names = []
    for comm in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(open(comm).read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("ccl-helper")


def announce(name: str, store=None) -> None:
    """Inside a rank: tells the other ranks that `name` happened (through the group's store, or
    `store`: the default group's, taken before that group went away)."""
    import torch.distributed as dist

    (store or dist.distributed_c10d._get_default_store()).set(f"harness/{name}", "1")


def await_announcement(name: str, timeout: float = 120) -> None:
    """Inside a rank: blocks until another rank announced `name`; raises after `timeout` s."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait([f"harness/{name}"], datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001 - the store's own timeout error names no event
        raise AssertionError(f"waited {timeout} s for another rank to announce {name!r}: {e}") from None


# ---- transports -----------------------------------------------------------------------

# The two ways a group of ranks on one host moves data: the package's shared memory (its
# default there) and oneCCL (what every group across hosts uses). Transport-independent
# tests take the `transport` fixture (conftest.py), which runs them once on each with the
# same expected values; its ids, "shm" and "oneccl", are what the run's closing line counts.
TRANSPORTS = {"shm": {"ONECCL_BIND_PT_SHM": "1"}, "oneccl": {"ONECCL_BIND_PT_SHM": "0"}}


def expect_transport(group=None) -> None:
    """Inside a rank: fails unless `group` (a process group or a ccl backend; the default
    group) carries its collectives on the transport the test's environment asked for, so that
    an "oneccl" case cannot pass on shared memory (or the reverse) unnoticed."""
    import torch
    import torch.distributed as dist

    want = "oneccl" if os.environ.get("ONECCL_BIND_PT_SHM") == "0" else "shm"
    pg = group or dist.distributed_c10d._get_default_group()
    if not hasattr(pg, "_path"):
        pg = pg._get_backend(torch.device("cpu"))
    got = pg._path("allreduce", 4)
    assert got == want, f"ONECCL_BIND_PT_SHM={os.environ.get('ONECCL_BIND_PT_SHM')!r}: a 4-byte allreduce takes {got}"


# ---- processes ------------------------------------------------------------------------


def popen(cmd, **kw) -> subprocess.Popen:
    """Popen in a session of its own, so that kill_session() reaches everything it started."""
    return subprocess.Popen([str(c) for c in cmd], start_new_session=True, **kw)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children before their own children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILLs the process group `proc` leads and every process below it: ranks included, not
    only the launcher, even those a launcher started in sessions of their own (torchrun does),
    which would otherwise keep the output pipe open and a reader of it waiting for good."""
    if proc.returncode is not None:
        return  # reaped: its pid may be another process's by now
    below = _descendants(proc.pid)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def communicate(procs, timeout: float) -> list[str]:
    """Each process's output (stdout, with stderr merged into it or not), within one shared
    `timeout`; on a timeout, or on anything raised meanwhile (pytest-timeout's too), every
    process's session is killed."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    kill_session(q)
                got = [q.communicate()[0] or "" for q in procs]
                raise AssertionError(f"{p.args} did not finish within {timeout} s:\n" + "\n".join(got)) from None
            outs.append((out or "") + (err or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_session(p)
                p.wait()
    return outs


class Lines:
    """A process's merged stdout/stderr read by a thread as it comes, so a test can wait
    for a line (a rank's "ready") while the process runs."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def count(self, marker: str) -> int:
        return sum(marker in line for line in self.lines)

    def wait_for(self, marker: str, count: int = 1, timeout: float = 120) -> None:
        def seen():
            if self.count(marker) >= count:
                return True
            if self.proc.poll() is not None:
                self._thread.join(5)
                if self.count(marker) < count:
                    raise AssertionError(f"exited {self.proc.returncode} before printing {marker!r} {count} "
                                         f"time(s):\n{self.text}")
            return False

        wait_for(seen, timeout, f"{marker!r} printed {count} time(s) by {self.proc.args}")

    def finish(self, timeout: float) -> str:
        """Waits for the process to exit (killing its session after `timeout`); all its output."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_session(self.proc)
            self.proc.wait()
            self._thread.join(5)
            raise AssertionError(f"{self.proc.args} did not finish within {timeout} s:\n{self.text}") from None
        self._thread.join(5)
        return self.text

    def close(self) -> None:
        """Kills the process's session if it still runs (for a finally: block)."""
        if self.proc.poll() is None:
            kill_session(self.proc)
            self.proc.wait()

    @property
    def text(self) -> str:
        return "".join(self.lines)


def run_job(cmd, cwd, env, timeout=180):
    """Runs a launcher (torchrun, mpirun, ...) and returns its output; fails on a non-zero exit.
    It gets its own session so a timeout kills the ranks too, not only the launcher."""
    proc = popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (out,) = communicate([proc], timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out}"
    return out


# ---- ports --------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import ports  # noqa: E402


def free_port() -> int:
    """A TCP port for a job's rendezvous (MASTER_PORT, a torchrun endpoint) that no other
    caller gets while this test run lasts: from scripts/ports.py, which the scripts that start
    jobs use too, so a test and a script running beside it never share one (it says how)."""
    return ports.free_port()


def _entry(fn, rank, world, store_path, results, args, env, pg_timeout, backend):
    # A forkserver child starts with the server's environment: take the test's, as a spawned
    # process would have, before anything (this package first) reads it.
    os.environ.clear()
    os.environ.update(env)
    try:
        import torch.distributed as dist

        # torch read TORCH_DISTRIBUTED_DEBUG when the server imported it; read it again here.
        dist.set_debug_level_from_env()

        import oneccl_bind_pt  # noqa: F401

        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world, *args)
        # Teardown is part of the case: a destroy that raises must fail it, so the result is
        # reported only after it (a test that already destroyed the group skips this).
        if dist.is_initialized():
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, False, traceback.format_exc()))


def _exit_name(code):
    if code is not None and code < 0:
        return f"with signal {signal.Signals(-code).name}"
    return f"with code {code}"


@functools.lru_cache(maxsize=None)
def _context():
    """Ranks fork from one server per test process that has imported torch: a spawned rank
    spent ~1.7 s of CPU importing it, a forked one none, and the suite starts hundreds of
    ranks on two cores. Only torch: this package reads the environment when imported, so each
    rank imports it itself, after taking the test's environment (_entry)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def run_ranks(fn, world, *args, timeout=180, env=None, pg_timeout=60, backend="ccl", rank_env=None):
    """Runs fn(rank, world, *args) on `world` processes; returns the values by rank.

    The default group uses `backend` (ccl unless a test wants gloo's answer). `env` is added
    to every rank's environment, and `rank_env` ({rank: {name: value}}) to some ranks' only.

    Raises RankFailure with every failing rank's traceback, or when a rank
    hangs past `timeout` seconds.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, rank, world, store_path, results, args,
                      {**os.environ, **(env or {}), **(rank_env or {}).get(rank, {})}, pg_timeout, backend),
                daemon=True,
            )
            for rank in range(world)
        ]
        try:
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
        finally:
            # Also when pytest-timeout interrupts the wait: no rank outlives its test.
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    problems = []
    for rank in range(world):
        if rank not in got:
            problems.append(f"rank {rank}: no result (hung past {timeout} s or died, exit code {procs[rank].exitcode})")
        elif not got[rank][0]:
            problems.append(f"rank {rank} raised:\n{got[rank][1]}")
        elif procs[rank].exitcode != 0:
            # Its result arrived, then it died: in destroy_process_group or at exit.
            problems.append(f"rank {rank}: returned its result, then exited {_exit_name(procs[rank].exitcode)} "
                            "while destroying its group or exiting")
    if problems:
        raise RankFailure("\n".join(problems))
    return [got[r][1] for r in range(world)]


def wait_for_disk(path, need_gib, what, timeout=900):
    """Waits until `path`'s file system has need_gib GiB free (the other xdist worker may hold a
    CUDA torch's venv that is about to go), polling; fails naming `what` if it never does.
    Returns the seconds waited."""
    start = time.monotonic()
    while (free := shutil.disk_usage(path).free / 2**30) < need_gib:
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} needs {need_gib} GiB free on {path}'s disk; {free:.1f} GiB were still free "
                        f"after waiting {timeout} s for other tests to release theirs")
        time.sleep(5)
    return time.monotonic() - start
