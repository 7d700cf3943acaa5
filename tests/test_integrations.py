"""Reaching the backend through Hugging Face Transformers and Accelerate.

The look-ups those libraries (and DeepSpeed's CPU accelerator) make to find
oneCCL's bindings, then examples/hf_trainer.py: a Trainer run on 2 ranks under
torchrun and mpirun, checked against the same run on gloo. Last, the same
example with the last releases that still ask for "ccl" by name (Transformers
4.57, Accelerate 1.12), installed into a cached directory that shadows the
newer ones through PYTHONPATH.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness import import_or_require, run_job  # noqa: E402

import_or_require("transformers")
import_or_require("accelerate")
# The legacy overlay's pip install (up to 600 s) is paid by the first test that uses it.
pytestmark = pytest.mark.timeout(1800)

from test_launchers import BIN, ROOT, checksums, free_port  # noqa: E402

EXAMPLE = ROOT / "examples" / "hf_trainer.py"

# Run in a fresh interpreter so nothing this test process imported can help.
PROBE = r"""
import importlib.metadata, importlib.util, json, os
out = {}
# Transformers <= 4.57 (utils/import_utils.py) and Accelerate <= 1.12 (utils/imports.py)
# decide "ccl is available" from these specs, then read the distribution's version.
out["specs"] = {n: importlib.util.find_spec(n) is not None for n in ("oneccl_bindings_for_pytorch", "torch_ccl")}
out["dist_version"] = importlib.metadata.version("oneccl_bind_pt")
out["dist_of"] = {n: importlib.metadata.packages_distributions().get(n) for n in ("oneccl_bindings_for_pytorch", "torch_ccl")}
from packaging.version import Version
out["version_parses"] = Version(out["dist_version"]) >= Version("1.12")

# DeepSpeed's CPU accelerator imports this name and then uses "ccl".
import torch.distributed as dist
import oneccl_bindings_for_pytorch, torch_ccl
out["module_versions"] = [oneccl_bindings_for_pytorch.__version__, torch_ccl.__version__]
out["registered"] = "ccl" in dist.Backend.backend_list

# Accelerate's answer to the backend asked for by name (it raises before any rendezvous).
os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
from accelerate import PartialState
try:
    PartialState(cpu=True, backend="ccl")
    out["accelerate_by_name"] = "accepted"
except ValueError as e:
    out["accelerate_by_name"] = str(e)
print("PROBE " + json.dumps(out))
"""


def launch(cmd, cwd, env=None, timeout=240):
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # No launcher context from the test process; no hub access and no caches in $HOME.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "PMI_SIZE"):
        full_env.pop(var, None)
    full_env.update(HF_HUB_OFFLINE="1", HF_HOME=str(Path(cwd) / "hf"), **(env or {}))
    return run_job(cmd, cwd, full_env, timeout)


def torchrun(cwd, *args):
    return launch([BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), EXAMPLE, *args], cwd)


def results(out, backend):
    """The example's per-rank report, checked for a real 2-rank DDP run on `backend`."""
    # Ranks share one pipe and a line's newline may be written apart from it: match each
    # value exactly, or "True" can run into the other rank's next "rank".
    runs = re.findall(r"rank (\d+) backend (\S+) world (\d+) ddp (True|False)", out)
    assert sorted(runs) == [("0", backend, "2", "True"), ("1", backend, "2", "True")], out
    digests = dict(re.findall(r"rank (\d+) parameter digest ([0-9a-f]{16})", out))
    assert len(digests) == 2 and len(set(digests.values())) == 1, f"ranks' parameters differ: {digests}\n{out}"
    final = float(checksums(out, 2, None)["0"])  # the callers compare it with gloo's
    start = set(re.findall(r"rank \d+ initial checksum (-?\d+\.\d{10})", out))
    assert len(start) == 1 and abs(float(start.pop()) - final) > 1e-3, f"training did not move the parameters:\n{out}"
    # Each rank trained on its own shard: DDP had something to average.
    samples = [set(map(int, re.findall(r"\d+", s))) for _, s in sorted(re.findall(r"rank (\d+) samples \[([\d, ]*)\]", out))]
    assert len(samples) == 2 and samples[0] and samples[1] and not samples[0] & samples[1], out
    return final


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = launch([sys.executable, "-c", PROBE], tmp_path_factory.mktemp("probe"), timeout=120)
    return json.loads(re.search(r"^PROBE (.*)$", out, re.M).group(1))


@pytest.fixture(scope="module")
def gloo_checksum(tmp_path_factory):
    return results(torchrun(tmp_path_factory.mktemp("gloo"), "--backend", "gloo"), "gloo")


def test_lookups_find_us(probe):
    import oneccl_bind_pt

    assert probe["specs"] == {"oneccl_bindings_for_pytorch": True, "torch_ccl": True}
    assert probe["dist_version"] == oneccl_bind_pt.__version__
    assert probe["module_versions"] == [oneccl_bind_pt.__version__] * 2
    assert probe["dist_of"] == {"oneccl_bindings_for_pytorch": ["oneccl_bind_pt"], "torch_ccl": ["oneccl_bind_pt"]}
    assert probe["version_parses"] and probe["registered"]


def test_accelerate_rejects_ccl_by_name(probe):
    # Accelerate 1.13+ maps every CPU backend it is given to gloo or mpi, so the
    # example creates the ccl group itself. If this starts passing "accepted",
    # the example can use TrainingArguments(ddp_backend="ccl") directly.
    assert "backend ccl is not available" in probe["accelerate_by_name"], probe


def test_trainer_torchrun_matches_gloo(tmp_path, gloo_checksum):
    ccl = results(torchrun(tmp_path), "ccl")
    assert ccl == pytest.approx(gloo_checksum, rel=1e-7)


def test_trainer_mpirun_matches_gloo(tmp_path, gloo_checksum):
    out = launch([BIN / "mpirun", "-n", "2", sys.executable, EXAMPLE], tmp_path, env={"MASTER_PORT": str(free_port())})
    assert results(out, "ccl") == pytest.approx(gloo_checksum, rel=1e-7)


# The last releases whose Trainer passes ddp_backend="ccl" on to Accelerate, and the
# versions they check for at import (transformers/dependency_versions_table.py:
# huggingface-hub < 1.0, tokenizers <= 0.23.0; hub 0.x imports requests).
LEGACY_PINS = (
    "transformers==4.57.6", "accelerate==1.12.0", "huggingface-hub==0.36.2", "tokenizers==0.22.2",
    "requests==2.32.5", "urllib3==2.5.0", "charset-normalizer==3.4.4", "certifi==2025.10.5",
)
# Accelerate 1.12 keeps "ccl" on CPU only when CCL_WORKER_COUNT > 0; with it set, the
# package leaves oneCCL's busy-polling worker on unless CCL_WORKER_OFFLOAD=0.
LEGACY_ENV = {"CCL_WORKER_COUNT": "1", "CCL_WORKER_OFFLOAD": "0"}

LEGACY_PROBE = r"""
import json, os
import transformers, accelerate
os.environ.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
os.environ.pop("CCL_WORKER_COUNT", None)
from accelerate import PartialState
try:
    PartialState(cpu=True, backend="ccl")
    refusal = None
except ValueError as e:
    refusal = str(e)
print("PROBE " + json.dumps({"versions": [transformers.__version__, accelerate.__version__], "refusal": refusal}))
"""


@pytest.fixture(scope="module")
def legacy_overlay(tmp_path_factory):
    """A directory holding LEGACY_PINS, reused across runs (keyed on the pins and the interpreter)."""
    key = "\n".join((*LEGACY_PINS, sys.implementation.cache_tag, sys.platform, os.uname().machine))
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "oneccl_bind_pt"
    overlay = cache / f"hf-legacy-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if not overlay.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".hf-legacy-", dir=cache))
        try:
            start = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "-q",
                 "--target", partial, *LEGACY_PINS],
                cwd=tmp_path_factory.mktemp("pip"), capture_output=True, text=True, timeout=600)
            assert proc.returncode == 0, f"installing {LEGACY_PINS} failed:\n{proc.stdout}{proc.stderr}"
            print(f"legacy overlay installed in {time.monotonic() - start:.1f} s: {overlay}")
            try:
                partial.rename(overlay)  # only a complete install gets the final name
            except OSError:
                if not overlay.is_dir():  # else a concurrent run finished first: use its copy
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return overlay


def legacy_launch(overlay, cwd, cmd, env=None):
    path = os.pathsep.join(filter(None, (str(overlay), os.environ.get("PYTHONPATH"))))
    return launch(cmd, cwd, env={"PYTHONPATH": path, **(env or {})})


def test_legacy_accelerate_wants_worker_count(legacy_overlay, tmp_path):
    out = legacy_launch(legacy_overlay, tmp_path, [sys.executable, "-c", LEGACY_PROBE])
    probe = json.loads(re.search(r"^PROBE (.*)$", out, re.M).group(1))
    assert probe["versions"] == ["4.57.6", "1.12.0"], probe
    # Without CCL_WORKER_COUNT, Accelerate 1.12 swaps ccl for gloo and refuses the name.
    assert "backend ccl is not available, please use gloo" in (probe["refusal"] or ""), probe


def test_trainer_by_name_legacy_matches_gloo(legacy_overlay, tmp_path):
    """TrainingArguments(ddp_backend=...) with the library creating the process group."""
    def run(backend, cwd):
        cwd.mkdir()
        cmd = [BIN / "torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), EXAMPLE,
               "--by-name", "--backend", backend]
        out = legacy_launch(legacy_overlay, cwd, cmd, env=LEGACY_ENV)
        versions = set(re.findall(r"rank \d+ transformers (\S+) accelerate (\d+\.\d+\.\d+)", out))
        assert versions == {("4.57.6", "1.12.0")}, f"the overlay did not shadow the installed versions:\n{out}"
        return out

    gloo = results(run("gloo", tmp_path / "gloo"), "gloo")
    ccl = results(run("ccl", tmp_path / "ccl"), "ccl")
    assert ccl == pytest.approx(gloo, rel=1e-7)
