"""Two hosts on one machine: network namespaces joined by a veth pair (needs root and iproute2).

    with netns.hosts() as h:
        subprocess.Popen(h.on(0, [python, "rank.py"]))   # runs "on" host 0 (address h.addr[0])
        h.partition("drop")                              # the hosts stop hearing each other

The tests (tests/test_two_hosts.py's two_hosts fixture), scripts/bench_hosts.py and
scripts/fault_matrix.py's partition rows use it.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

PARTITIONS = ("link-down", "drop")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=60)


@dataclass
class Hosts:
    ns: list[str]
    dev: list[str]
    addr: list[str]

    def on(self, k: int, cmd: list) -> list:
        """cmd run in host k's namespace, under a host name of its own (a UTS namespace):
        oneCCL takes peers with the same host name for local ones and would use shared
        memory between them."""
        return ["ip", "netns", "exec", self.ns[k], "unshare", "--uts", "sh", "-c",
                f'hostname {self.ns[k]} && exec "$@"', "sh", *map(str, cmd)]

    def partition(self, how: str) -> None:
        """link-down: both ends of the link go down (a send fails at once: no route).
        drop: every frame is sent to a MAC address nobody has, so the peer's veth discards it
        unseen, both ways; sockets see nothing but silence (this kernel has no netem or
        matchall to drop with)."""
        for k in (0, 1):
            if how == "link-down":
                _ip("-n", self.ns[k], "link", "set", self.dev[k], "down")
            elif how == "drop":
                _ip("-n", self.ns[k], "neigh", "replace", self.addr[1 - k], "lladdr", "02:00:00:00:00:01",
                    "nud", "permanent", "dev", self.dev[k])
            else:
                raise ValueError(f"partition: {how!r} is not one of {PARTITIONS}")


@contextlib.contextmanager
def hosts(names: bool = False):
    """Two fresh namespaces with addresses 10.213.77.1 and .2; removed afterwards.
    names: each host resolves the host names (ns[k]) as Debian's and Ubuntu's /etc/hosts have
    it: its own 127.0.1.1, the other's its address (`ip netns exec` mounts
    /etc/netns/NS/hosts over /etc/hosts). Without it the names resolve to nothing.
    Raises subprocess.CalledProcessError when this machine cannot create them (OSError when
    it cannot write those files)."""
    tag = uuid.uuid4().hex[:6]
    h = Hosts(ns=[f"obp{tag}a", f"obp{tag}b"], dev=[f"obp{tag}0", f"obp{tag}1"],
              addr=["10.213.77.1", "10.213.77.2"])
    top = Path("/etc/netns")
    made_top = names and not top.exists()
    etc = [top / n for n in h.ns]
    try:
        if names:
            for k in (0, 1):
                etc[k].mkdir(parents=True, exist_ok=True)
                (etc[k] / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {h.ns[k]}\n{h.addr[1 - k]} {h.ns[1 - k]}\n")
        _ip("netns", "add", h.ns[0])
        _ip("netns", "add", h.ns[1])
        _ip("link", "add", h.dev[0], "type", "veth", "peer", "name", h.dev[1])
        for k in (0, 1):
            _ip("link", "set", h.dev[k], "netns", h.ns[k])
            _ip("-n", h.ns[k], "addr", "add", f"{h.addr[k]}/24", "dev", h.dev[k])
            _ip("-n", h.ns[k], "link", "set", h.dev[k], "up")
            _ip("-n", h.ns[k], "link", "set", "lo", "up")
        yield h
    finally:
        for n in h.ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=60)
        for d in etc:
            shutil.rmtree(d, ignore_errors=True)
        if made_top:
            with contextlib.suppress(OSError):
                top.rmdir()
