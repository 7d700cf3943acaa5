"""The releases and their venvs, for the scripts that work on several releases
(build_wheels.py, check_wheel.py, test_release.py).

Standard library only: it runs before any venv exists. The table is the generated
oneccl_bind_pt/_version.py (from meta/releases.yaml); each release's venv is the one
scripts/setup.sh makes: .venv for the default release, .venv-torch<version> for the others.
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = runpy.run_path(str(ROOT / "oneccl_bind_pt" / "_version.py"))
ROWS = {row["torch"]: row for row in TABLE["RELEASES"].values()}
DEFAULT = TABLE["RELEASES"][TABLE["DEFAULT"]]["torch"]


def venv(torch: str) -> Path:
    return ROOT / (".venv" if torch == DEFAULT else f".venv-torch{torch}")


def requirements(torch: str) -> Path:
    return ROOT / "requirements" / f"torch-{torch}.txt"


def pip_env(torch: str, env: dict | None = None) -> dict:
    """The environment for a pip command that installs this release's torch: with pip's global
    constraint lifted when the release's requirement set says so (see scripts/setup.sh)."""
    env = dict(os.environ if env is None else env)
    if any(line.startswith("# lift-pip-constraint:") for line in requirements(torch).read_text().splitlines()):
        env["PIP_CONSTRAINT"] = "/dev/null"
    return env


def setup(torch: str) -> float:
    """scripts/setup.sh --torch <torch>: creates or reuses the release's venv, builds and installs
    the package there. Returns the seconds it took."""
    start = time.monotonic()
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--torch", torch], cwd=ROOT, check=True)
    return time.monotonic() - start


def add_torch_option(ap: argparse.ArgumentParser, every: bool) -> None:
    """--torch <version>, once (`every`: repeatable, default all releases; else default: the default release)."""
    if every:
        ap.add_argument("--torch", action="append", choices=list(ROWS), metavar="VERSION",
                        help=f"a release to work on (repeatable; default: all of {', '.join(ROWS)})")
    else:
        ap.add_argument("--torch", default=DEFAULT, choices=list(ROWS), metavar="VERSION",
                        help=f"the release (one of {', '.join(ROWS)}; default: {DEFAULT})")


def dir_mib(path: Path) -> float:
    """Bytes on disk below a folder, in MiB (hard links counted once, symlinks not followed)."""
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) / 1024
