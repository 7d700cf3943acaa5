"""PyTorch's ``_DistTestBase`` for one backend, as torch's test_distributed_spawn.py runs it.

Run by ``runner.py`` in its own pytest process, configured through the same
variables as torch's: BACKEND (gloo or ccl), WORLD_SIZE, TEMP_DIR (a folder
holding a ``barrier`` folder) and INIT_METHOD. Each case spawns WORLD_SIZE
real rank processes; they re-import this module, so the ccl backend is
registered here, at the top, in every rank.
"""

import json
import os
import unittest

import torch

import oneccl_bindings_for_pytorch  # noqa: F401 - registers "ccl", in the parent and in every rank
from torch.testing._internal import common_distributed

from pytorch_suite import preskip
from pytorch_suite.loader import load

BACKENDS = ("gloo", "ccl")

_missing = [v for v in ("BACKEND", "WORLD_SIZE", "TEMP_DIR") if v not in os.environ]
if _missing or os.environ["BACKEND"] not in BACKENDS:
    raise RuntimeError(
        f"{__name__} runs PyTorch's distributed suite for one backend and needs BACKEND (one of "
        f"{', '.join(BACKENDS)}), WORLD_SIZE and TEMP_DIR; missing: {', '.join(_missing) or 'none'}. "
        "Start it through pytorch_suite.runner."
    )

torch.backends.cuda.matmul.allow_tf32 = False
_suite = load()
# Per-case limits from the runner, through PyTorch's own per-test timeout table.
common_distributed.TIMEOUT_OVERRIDE.update(json.loads(os.environ.get("PYTORCH_SUITE_CASE_TIMEOUTS") or "{}"))
BACKEND = os.environ["BACKEND"]


class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
    def setUp(self):
        if preskip.enabled():
            reason = preskip.decided_skip(getattr(type(self), self._testMethodName), self)
            if reason:
                raise unittest.SkipTest(reason)
        super().setUp()
        if os.environ.get("PYTORCH_SUITE_START") == "fork":
            # Each rank a fork of this process, which holds torch and the suite already
            # imported but no process group and no thread: ~1 s a case instead of ~6 s
            # of imports per rank. torch's start path, with another multiprocessing context.
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


# Named as torch names it (TestDistBackendWithSpawnGLOO, ...), so case ids read the same.
TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = f"TestDistBackendWithSpawn{BACKEND.upper()}"
globals()[TestDistBackendWithSpawn.__name__] = TestDistBackendWithSpawn
del TestDistBackendWithSpawn
