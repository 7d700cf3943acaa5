"""Lists the suite's cases and how each will go, without spawning any rank.

Run in a process configured like the suite (runner.inventory does that):
prints JSON {"cases": {name: reason or null}, "rewrites": [...]}, where the
reason is why the case is skipped before any rank starts (a skip decorator
evaluated at import, or a decision of preskip.py), and null means its ranks
will be spawned.
"""

import dataclasses
import json
import os
import unittest

from pytorch_suite import distributed_spawn, preskip
from pytorch_suite.loader import REWRITES


def cases() -> dict:
    cls = getattr(distributed_spawn, f"TestDistBackendWithSpawn{os.environ['BACKEND'].upper()}")
    out = {}
    for name in unittest.TestLoader().getTestCaseNames(cls):
        fn = getattr(cls, name)
        if getattr(fn, "__unittest_skip__", False):
            out[name] = fn.__unittest_skip_why__
        else:
            out[name] = preskip.decided_skip(fn, cls(name)) if preskip.enabled() else None
    return out


if __name__ == "__main__":
    print(json.dumps({"cases": cases(), "rewrites": [dataclasses.asdict(r) for r in REWRITES]}))
