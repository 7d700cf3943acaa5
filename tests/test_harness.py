"""The helpers the other tests lean on do what they promise: a capability that cannot be set
up fails under CI=true, a wait names what it waited for, no two runs share a port, and a rank
whose teardown fails fails its case."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import RankFailure, communicate, free_port, popen, run_ranks, wait_for

HERE = Path(__file__).resolve().parent

MISSING = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from harness import require

def test_needs_what_is_not_here():
    require(False, "needs something this machine lacks")
"""


@pytest.mark.parametrize("ci, outcome", [("", "1 skipped"), ("true", "1 failed")])
def test_require_skips_locally_and_fails_under_ci(tmp_path, ci, outcome):
    (tmp_path / "test_missing.py").write_text(MISSING)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    p = popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rs", tmp_path],
              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = communicate([p], 120)
    assert outcome in out and "needs something this machine lacks" in out, out


def test_wait_for_names_what_it_waited_for():
    assert wait_for(lambda: 42, 1, "an answer") == 42
    with pytest.raises(AssertionError, match="waited 0.2 s for the moon"):
        wait_for(lambda: False, 0.2, "the moon", interval=0.05)


HOLD = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
from harness import free_port
print(*[free_port() for _ in range(20)], flush=True)
sys.stdin.read()  # holds its ports until the test lets go
"""


def test_free_ports_are_never_shared_between_runs():
    mine = {free_port() for _ in range(20)}
    assert len(mine) == 20
    procs = [popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        theirs = [set(map(int, p.stdout.readline().split())) for p in procs]
    finally:
        communicate(procs, 60)  # closes their stdin: they exit
    assert all(len(t) == 20 for t in theirs), theirs
    assert not (theirs[0] & theirs[1]) and not (mine & (theirs[0] | theirs[1])), (mine, theirs)


def _teardown_breaks(rank, world):
    import torch.distributed as dist

    real = dist.destroy_process_group

    def destroy(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError(f"rank {rank}: teardown broke on purpose")

    # The harness destroys the group after the function returns: that call must count.
    dist.destroy_process_group = destroy
    return "returned"


def test_a_teardown_that_raises_fails_the_case():
    with pytest.raises(RankFailure, match="teardown broke on purpose") as caught:
        run_ranks(_teardown_breaks, 2, timeout=60)
    assert "rank 0 raised" in str(caught.value) and "rank 1 raised" in str(caught.value), caught.value
