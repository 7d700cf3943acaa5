"""Makes sure a virtual environment exists at a path and runs this Python's version.

    python3 scripts/ensure_venv.py .venv

Run with the interpreter the venv should use (scripts/setup.sh passes $PYTHON).
What it finds at the path, and what it does:

  nothing                                  creates the venv
  a working venv of this Python version    keeps it (later installs are incremental)
  a symlink whose target does not exist    removes the link, creates the venv
  a venv whose python does not run         rebuilds it
  a venv of another Python version         rebuilds it
  anything else (a file, a folder that is  stops with exit code 2 and says what to do:
  not a venv)                              it may hold someone's data
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

WANT = f"{sys.version_info[0]}.{sys.version_info[1]}"


def say(msg: str) -> None:
    print(f"setup: {msg}", file=sys.stderr)


def venv_python_version(venv: Path) -> str | None:
    """The X.Y of the venv's interpreter, or None when it does not run."""
    try:
        out = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def create(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)


def ensure(venv: Path) -> int:
    if venv.is_symlink() and not venv.exists():
        say(f"{venv} is a symlink to {os.readlink(venv)}, which does not exist "
            "(a link made on another machine, or its target was cleaned up); replacing it with a new venv")
        venv.unlink()
    if not os.path.lexists(venv):
        say(f"creating {venv} with Python {WANT} ({sys.executable})")
        create(venv)
        return 0
    if not venv.is_dir() or not (venv / "pyvenv.cfg").is_file():
        kind = "a folder" if venv.is_dir() else "a file"
        say(f"{venv} exists but is {kind} without pyvenv.cfg, not a virtual environment; "
            f"move it away or remove it (rm -r {venv}), then run setup again")
        return 2
    have = venv_python_version(venv)
    if have == WANT:
        return 0
    if have is None:
        say(f"{venv} is a virtual environment whose python does not run "
            "(its base interpreter moved or was removed); rebuilding it")
    else:
        say(f"{venv} holds Python {have} but setup uses Python {WANT} ({sys.executable}); rebuilding it "
            f"(set PYTHON=python{have} to keep the old one)")
    # Only remove what is, by its pyvenv.cfg, a venv: never a link's target folder.
    if venv.is_symlink():
        venv.unlink()
    else:
        shutil.rmtree(venv)
    create(venv)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("venv", type=Path, help="where the virtual environment lives (e.g. .venv)")
    args = parser.parse_args()
    return ensure(args.venv)


if __name__ == "__main__":
    sys.exit(main())
