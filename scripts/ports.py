"""TCP ports for a job's rendezvous that no other job on this machine is handed meanwhile.

Binding port 0 and closing it races: the kernel may give the same port to anyone before the
job binds it. Instead a port comes from FIRST up to the kernel's ephemeral range (which it
never picks on its own) and is held by an advisory lock on a file named after it, in one
folder every caller on the machine shares: the tests (tests/harness.py), scripts/check_wheel.py,
scripts/fault_matrix.py and scripts/conda_offline.py, each run of each. A port some program
has bound already is skipped too.

FIRST lies above the ports the package derives from a launcher's job id (10000-29999,
oneccl_bind_pt/_launchers.py): an mpirun or srun job running beside a test run would
otherwise be able to take the port a test was given.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

FIRST = 30_000
LOCKS = Path(tempfile.gettempdir()) / "oneccl_bind_pt-test-ports"
_held: dict[int, int] = {}  # port -> the open lock file's descriptor


def free_port() -> int:
    """A port held for this process until release_port() or its exit."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    first = FIRST
    if low - FIRST < 1_000:
        # An ephemeral range that starts low (some hosts tune it): the ports above it are
        # never picked by the kernel either.
        first, low = high + 1, 65_536
    if not LOCKS.exists():
        LOCKS.mkdir(exist_ok=True)
        os.chmod(LOCKS, 0o1777)  # shared by every user's runs, like /tmp
    span = max(1, low - first)
    start = first + os.getpid() % span  # concurrent runs start apart, so they rarely contend
    for port in (*range(start, low), *range(first, start)):
        if port in _held:
            continue
        try:
            fd = os.open(LOCKS / f"{port}.lock", os.O_RDONLY | os.O_CREAT, 0o644)  # read-only: any user's run can lock it
        except OSError:  # e.g. another user's file under fs.protected_regular, or one a umask left unreadable
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the kernel when this process ends
        except OSError:
            os.close(fd)
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                os.close(fd)
                continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free port in {first}-{low - 1}")


def release_port(port: int) -> None:
    """Gives a port back once the job that used it has ended."""
    fd = _held.pop(port, None)
    if fd is not None:
        os.close(fd)
