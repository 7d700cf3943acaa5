"""The (torch, Python) pairs and their venvs, for the scripts that work on several of them
(setup.sh, build_wheels.py, check_wheel.py, test_release.py).

    python3 scripts/releases.py resolve --torch 2.14.1 --python 3.12   # what setup.sh runs

Standard library only: it runs before any venv exists. The table is the generated
oneccl_bind_pt/_version.py (from meta/releases.yaml). Each pair's development venv is the
one scripts/setup.sh makes: .venv for the default pair, .venv-torch<t> for another release on
the default Python, .venv-torch<t>-py<p> otherwise.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import runpy
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = runpy.run_path(str(ROOT / "oneccl_bind_pt" / "_version.py"))
ROWS = {row["torch"]: row for row in TABLE["RELEASES"].values()}
DEFAULT = TABLE["RELEASES"][TABLE["DEFAULT"]]["torch"]
DEFAULT_PYTHON = TABLE["DEFAULT_PYTHON"]
PAIRS = [(torch, python) for torch, row in ROWS.items() for python in row["python"]]


def version_tuple(version: str) -> tuple:
    """'2.14.1' -> (2, 14, 1)."""
    return tuple(int(x) for x in version.split("+")[0].split(".")[:3])


def venv(torch: str = DEFAULT, python: str = DEFAULT_PYTHON) -> Path:
    if python == DEFAULT_PYTHON:
        return ROOT / (".venv" if torch == DEFAULT else f".venv-torch{torch}")
    return ROOT / f".venv-torch{torch}-py{python}"


def requirements(torch: str) -> Path:
    return ROOT / "requirements" / f"torch-{torch}.txt"


def unsupported(torch: str, python: str) -> str | None:
    """Why the pair cannot be set up (with every supported pair), or None."""
    if (torch, python) in PAIRS:
        return None
    listed = "\n".join(f"  torch {t}: Python {', '.join(r['python'])}" for t, r in ROWS.items())
    what = f"torch {torch}" if torch not in ROWS else f"torch {torch} on Python {python}"
    return f"{what} is not supported. Supported pairs (meta/releases.yaml):\n{listed}"


def _version_of(exe: str) -> str | None:
    try:
        out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def find_python(python: str) -> str:
    """An interpreter of this X.Y that runs: $PYTHON, pythonX.Y on PATH (a pyenv shim of a
    version pyenv has not selected fails, so each is run), then pyenv's versions. Stops with
    how to get one."""
    candidates = [os.environ.get("PYTHON"), shutil.which(f"python{python}")]
    if python == f"{sys.version_info[0]}.{sys.version_info[1]}":
        candidates.append(sys.executable)
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates += sorted(glob.glob(f"{pyenv}/versions/{python}.*/bin/python{python}"), reverse=True)
    for exe in filter(None, candidates):
        if _version_of(exe) == python:
            return exe
    sys.exit(f"setup: no Python {python} interpreter found (tried $PYTHON, python{python} on PATH, "
             f"{pyenv}/versions/{python}.*). Install one (e.g. `pyenv install {python}`, or "
             f"`apt-get install python{python}-venv` where the distribution has it) or set PYTHON "
             "to its path.")


def pip_env(torch: str, env: dict | None = None) -> dict:
    """The environment for a pip command that installs this release's torch: with pip's global
    constraint lifted when the release's requirement set says so (see scripts/setup.sh)."""
    env = dict(os.environ if env is None else env)
    if any(line.startswith("# lift-pip-constraint:") for line in requirements(torch).read_text().splitlines()):
        env["PIP_CONSTRAINT"] = "/dev/null"
    return env


def setup(torch: str, python: str = DEFAULT_PYTHON) -> float:
    """scripts/setup.sh --torch <torch> --python <python>: creates or reuses the pair's venv,
    builds and installs the package there. Returns the seconds it took."""
    start = time.monotonic()
    subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--torch", torch, "--python", python],
                   cwd=ROOT, check=True)
    return time.monotonic() - start


def add_pair_options(ap: argparse.ArgumentParser, every: bool) -> None:
    """--torch / --python. every: repeatable, selecting pairs (default: all of them); else one
    pair (default: the default pair)."""
    if every:
        ap.add_argument("--torch", action="append", metavar="VERSION",
                        help=f"only pairs of this release (repeatable; releases: {', '.join(ROWS)})")
        ap.add_argument("--python", action="append", metavar="X.Y",
                        help="only pairs of this Python (repeatable)")
    else:
        ap.add_argument("--torch", default=DEFAULT, metavar="VERSION",
                        help=f"the release (one of {', '.join(ROWS)}; default: {DEFAULT})")
        ap.add_argument("--python", default=DEFAULT_PYTHON, metavar="X.Y",
                        help=f"the Python (default: {DEFAULT_PYTHON})")


def selected_pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The pairs --torch / --python select (every: repeatable options); exits 2 on none."""
    torches = args.torch if isinstance(args.torch, list) else [args.torch] if args.torch else None
    pythons = args.python if isinstance(args.python, list) else [args.python] if args.python else None
    for t in torches or []:
        if t not in ROWS:
            print(unsupported(t, DEFAULT_PYTHON), file=sys.stderr)
            sys.exit(2)
    chosen = [(t, p) for t, p in PAIRS if (not torches or t in torches) and (not pythons or p in pythons)]
    if not chosen:
        print(unsupported(",".join(torches or ["any"]), ",".join(pythons or ["any"])), file=sys.stderr)
        sys.exit(2)
    return chosen


# pip's settings that decide where packages come from, as uv pip install's options
# (install_command), and whether the setting may name several values (separated by spaces or lines).
_PIP_TO_UV = {"index-url": ("--index-url", False), "extra-index-url": ("--extra-index-url", True),
              "find-links": ("--find-links", True), "constraint": ("--constraint", True),
              "trusted-host": ("--allow-insecure-host", True), "cert": ("--cert", False)}
_PIP_TRUE = ("1", "true", "yes", "on", "y", "t")
# pip's own precedence: its environment variables, then the [install] section, then [global].
_PIP_SECTION_RANK = {":env:": 3, "install": 2, "global": 1}


def _pip_settings(env: dict) -> dict[str, str]:
    """pip's effective configuration ({name: value}) as `pip config list` shows it under `env`.
    Stops if pip cannot say: installing from elsewhere than pip would is worse than not at all."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"pip config list exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    ranked: dict[str, tuple[int, str]] = {}
    for line in proc.stdout.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in _PIP_SECTION_RANK:
            continue
        rank = _PIP_SECTION_RANK[section]
        if rank >= ranked.get(name, (0, ""))[0]:
            ranked[name] = (rank, ast.literal_eval(value.strip()))  # printed as repr(): lines, backslashes
    return {name: value for name, (_, value) in ranked.items()}


def install_command(python: Path, env: dict | None = None, compile: bool = False) -> tuple[list[str], dict]:
    """A command that installs packages into the environment of `python` (a venv's interpreter),
    and the environment to run it in (from `env`, by default this process's). `compile`: byte-compile
    what it installs, for a venv whose processes import torch many times (see scripts/setup.sh:
    where bytecode is not written at import, each import compiles torch's modules again).

    uv's `uv pip install` where this interpreter has uv (the pinned stack's release group), with
    pip's configuration carried over (indexes, find-links, constraints, trusted hosts, certificate,
    timeout) and pip's rule for several indexes (the best version on any); else that environment's
    own pip. Run by hand, uv keeps what it unpacked in its cache (UV_CACHE_DIR, by default
    ~/.cache/uv: a CUDA torch is about 7 GB; `uv cache clean` empties it). Measured on the
    2-core VM: a CUDA torch with its nvidia-* packages (6.8 GB installed) took pip 82 s into a fresh
    venv and uv 26 s, and uv under 1 s once its cache held it (UV_CACHE_DIR; the release pairs'
    tests give each pair one, so its build venv and its proof venv share their torch)."""
    env = dict(os.environ if env is None else env)
    try:
        from uv import find_uv_bin

        uv = find_uv_bin()
    except (ImportError, FileNotFoundError):
        return [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                *([] if compile else ["--no-compile"])], env
    cmd = [uv, "pip", "install", "--quiet", "--python", str(python), "--index-strategy", "unsafe-best-match",
           *(["--compile-bytecode"] if compile else [])]
    settings = _pip_settings(env)
    for name, (option, several) in _PIP_TO_UV.items():
        given = settings.get(name, "").strip()
        for value in given.split() if several else [given] if given else []:
            if value != "/dev/null":  # pip_env's lift of a machine's cap: no constraint
                cmd += [option, value]
    if settings.get("no-index", "").lower() in _PIP_TRUE:
        cmd.append("--no-index")
    timeout = settings.get("timeout") or settings.get("default-timeout")
    if timeout and "UV_HTTP_TIMEOUT" not in env:
        env["UV_HTTP_TIMEOUT"] = timeout
    return cmd, env


def dir_mib(path: Path) -> float:
    """Bytes on disk below a folder, in MiB (hard links counted once, symlinks not followed).
    Another build may add or remove files below it meanwhile (the CI builds two pairs at once):
    du then exits 1 for the files that vanished but still prints the total of the rest."""
    proc = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True)
    first = proc.stdout.split()[:1]
    if not first or not first[0].isdigit():
        raise RuntimeError(f"du -sk {path} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return int(first[0]) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    resolve = sub.add_parser("resolve", help="print shell assignments for a pair (scripts/setup.sh)")
    resolve.add_argument("--torch", default=DEFAULT)
    resolve.add_argument("--python", default=DEFAULT_PYTHON)
    sub.add_parser("pairs", help="list the supported pairs")
    args = ap.parse_args()
    if args.command == "pairs":
        print("\n".join(f"{t} {p}" for t, p in PAIRS))
        return 0
    if why := unsupported(args.torch, args.python):
        print(f"setup: {why}", file=sys.stderr)
        return 2
    values = {"torch": args.torch, "python": args.python, "interpreter": find_python(args.python),
              "venv": str(venv(args.torch, args.python).relative_to(ROOT)),
              "reqs": str(requirements(args.torch).relative_to(ROOT))}
    print("\n".join(f"{k}={shlex.quote(v)}" for k, v in values.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
