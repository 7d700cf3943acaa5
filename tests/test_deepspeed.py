"""DeepSpeed on CPU with nothing but setvars.sh: ZeRO 1, 2 and 3 and its own collectives.

DeepSpeed's CPU accelerator switches to ccl when oneccl_bindings_for_pytorch
imports, then JIT-builds two ops (one against oneCCL's shared library). Every
run here sources `<m.cwd>/env/setvars.sh` exactly as users are told to, and
sets nothing else. The op build (~2.5 min on 2 cores) is cached between runs
on one machine, keyed on everything that changes the compiled code.
"""

import fcntl
import hashlib
import importlib.metadata
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from harness import import_or_require, run_job  # noqa: E402

deepspeed_version = import_or_require("deepspeed").__version__
# The op build (in the fixture, up to 900 s) and three runs of up to 600 s.
pytestmark = pytest.mark.timeout(3600)
from test_launchers import BIN, ROOT, free_port  # noqa: E402

JOB = ROOT / "tests" / "scripts" / "deepspeed_job.py"
BUILD_OPS = ("from deepspeed.accelerator import get_accelerator\n"
             "for name in ('CCLCommBuilder', 'ShareMemCommBuilder'):\n"
             "    get_accelerator().create_op_builder(name).load(verbose=False)\n")


def ops_cache() -> Path:
    """Where DeepSpeed's ops are built, per (Python, torch, DeepSpeed, oneCCL, prefix).

    torch's JIT build does not track torch's or oneCCL's headers, so a cache
    shared across their versions would silently load a stale op."""
    key = "\n".join((sys.implementation.cache_tag, os.uname().machine, sys.prefix,
                     importlib.metadata.version("torch"), deepspeed_version,
                     importlib.metadata.version("oneccl-devel")))
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oneccl_bind_pt" / "deepspeed-ops"
    return base / hashlib.sha256(key.encode()).hexdigest()[:12]


def in_setvars_shell(cmd, cwd, extensions_dir, timeout):
    """Runs cmd in bash after the documented `source .../setvars.sh`, and nothing else set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "CPATH", "CPLUS_INCLUDE_PATH", "CCL_ROOT", "I_MPI_ROOT",
                        "FI_PROVIDER_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", TORCH_EXTENSIONS_DIR=str(extensions_dir),
               OMP_NUM_THREADS="1")
    script = ('source "$(python -c "import oneccl_bindings_for_pytorch as m; print(m.cwd)")/env/setvars.sh"\n'
              f"cd {shlex.quote(str(cwd))}\n{cmd}\n")
    # Start outside the source tree so the installed package is the one imported.
    return run_job(["bash", "-c", script], cwd="/", env=env, timeout=timeout)


@pytest.fixture(scope="module")
def built_ops():
    """DeepSpeed's ops, built once per key; a lock keeps concurrent runs from building twice."""
    cache = ops_cache()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{cache.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # We hold the lock, so a torch build lock left here is from a killed build:
        # torch would wait on it forever.
        for stale in cache.glob("*/lock"):
            stale.unlink()
        in_setvars_shell(f"python -c {shlex.quote(BUILD_OPS)}", ROOT, cache, timeout=900)
    return cache


def run(backend, cwd, ops):
    out = in_setvars_shell(f"torchrun --nproc_per_node 2 --master_port {free_port()} {shlex.quote(str(JOB))} {backend}",
                           cwd, ops, timeout=600)
    digests = {}
    for rank, stage, digest in re.findall(r"rank (\d) stage (\d) params ([0-9a-f]{16})", out):
        digests.setdefault(int(stage), {})[int(rank)] = digest
    assert sorted(digests) == [1, 2, 3] and all(sorted(d) == [0, 1] for d in digests.values()), out
    return digests, out


def test_zero_stages_match_gloo_and_collectives_mix(built_ops, tmp_path):
    ccl, out = run("ccl", tmp_path, built_ops)
    # Both oneCCL copies (ours, DeepSpeed's op) in one process, mixed with known values.
    assert len(re.findall(r"rank \d mixed collectives ok 27", out)) == 2, out
    gloo, _ = run("gloo", tmp_path, built_ops)
    for stage in (1, 2, 3):
        assert ccl[stage][0] == ccl[stage][1], f"ZeRO-{stage}: ranks differ on ccl: {ccl[stage]}"
        assert ccl[stage] == gloo[stage], f"ZeRO-{stage}: ccl {ccl[stage]} != gloo {gloo[stage]}"
