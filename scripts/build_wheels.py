#!/usr/bin/env python3
"""Build one oneccl_bind_pt wheel per release into dist/.

    python scripts/build_wheels.py                   # every release in meta/releases.yaml
    python scripts/build_wheels.py --torch 2.14.1    # one (repeatable)

For each release: scripts/setup.sh --torch <version> makes sure its venv exists (the same
venv setup.sh makes for development, reused between runs) and builds the extension there;
then `pip wheel --no-build-isolation --no-deps . -w dist/` packs it from that venv (the
objects under build/torch-<version>/ are reused, nothing compiles twice). The wheel is
dist/oneccl_bind_pt-<torch>+cpu-cp311-cp311-linux_x86_64.whl; its metadata asks for that
torch minor, impi-rt and tcmlib, so installing it needs no compiler and no oneccl-devel
(scripts/check_wheel.py proves it). Users install with
`pip install oneccl_bind_pt==<torch> -f <folder of wheels>`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import releases  # noqa: E402


def build(torch: str, dist: Path) -> dict:
    row = releases.ROWS[torch]
    setup_s = releases.setup(torch)
    start = time.monotonic()
    subprocess.run([str(releases.venv(torch) / "bin" / "python"), "-m", "pip", "wheel", "--quiet",
                    "--disable-pip-version-check", "--no-build-isolation", "--no-deps", ".", "-w", str(dist)],
                   cwd=releases.ROOT, check=True)
    wheel_s = time.monotonic() - start
    wheel = next(dist.glob(f"oneccl_bind_pt-{row['version']}-*.whl"))
    return {"torch": torch, "wheel": wheel.name, "wheel_mib": round(wheel.stat().st_size / 2**20, 2),
            "setup_s": round(setup_s, 1), "wheel_s": round(wheel_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    releases.add_torch_option(ap, every=True)
    ap.add_argument("--dist", type=Path, default=releases.ROOT / "dist", help="where the wheels go (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write what was built, sizes and times here")
    args = ap.parse_args()
    args.dist = args.dist.resolve()
    done = []
    for torch in args.torch or list(releases.ROWS):
        print(f"== torch {torch}", flush=True)
        done.append(build(torch, args.dist))
        r = done[-1]
        print(f"== {r['wheel']}: {r['wheel_mib']} MiB (setup.sh {r['setup_s']} s, pip wheel {r['wheel_s']} s)",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(done, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
