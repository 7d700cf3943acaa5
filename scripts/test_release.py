#!/usr/bin/env python3
"""Run tests/ (or a part of it) against one (torch, Python) pair.

    python scripts/test_release.py --torch 2.14.1                       # the whole suite
    python scripts/test_release.py --torch 2.15.0 --python 3.13 -- -k "ddp or package" -x

Creates or reuses the pair's venv and builds the package there (scripts/setup.sh
--torch <version> --python <X.Y>; .venv for the default pair), then runs `<venv>/bin/pytest tests`
with the arguments after `--`, from the checkout, as the README's test command does.
Prints how long the setup and the tests took; exits with pytest's code.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import releases  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    releases.add_pair_options(ap, every=False)
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (put them after --)")
    args = ap.parse_args()
    if why := releases.unsupported(args.torch, args.python):
        sys.exit(why)
    setup_s = releases.setup(args.torch, args.python)
    print(f"test_release: torch {args.torch}: venv + build ready in {setup_s:.0f} s", flush=True)
    start = time.monotonic()
    code = subprocess.run([str(releases.venv(args.torch, args.python) / "bin" / "pytest"), "tests", *args.pytest_args],
                          cwd=releases.ROOT).returncode
    print(f"test_release: torch {args.torch}: pytest exited {code} after {time.monotonic() - start:.0f} s "
          f"(setup {setup_s:.0f} s)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
