#!/usr/bin/env python3
"""Prove each built wheel installs and trains where only its torch is: no compiler, no oneCCL.

    python scripts/check_wheel.py                                 # every pair's wheel in dist/
    python scripts/check_wheel.py --torch 2.14.1 --python 3.12    # a selection (both repeatable)

For each (torch, Python) pair: a fresh venv of that Python (in a temporary folder) gets
torch==<version> and nothing else (through uv where this interpreter has it, else pip:
releases.install_command); then the pair's manylinux wheel from dist/ is installed by the
venv's pip with CC=/bin/false CXX=/bin/false (a build step would fail) and must
bring its runtime (impi-rt: mpirun + libfabric; tcmlib: hwloc) as declared requirements,
without oneccl-devel. Then, from outside the checkout, examples/ddp.py trains on 2 ranks
under `torchrun --nproc_per_node 2` and `mpirun -n 2` (the venv's, from impi-rt): all four
ranks must print the same parameter checksum, the one scripts/ddp_reference.py computes in
a single process of that venv from every rank's data (equal within 1e-6, the rounding of a
different summation order). On torch >= 2.14, scripts/no_import_ddp.py, which never imports the package,
trains on "ccl" under torchrun (the entry point) and matches its own gloo run.
Reports the table (--json, --markdown); the venv is removed unless --keep.

Build the wheels first: python scripts/build_wheels.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ports  # noqa: E402
import releases  # noqa: E402

EXAMPLE = releases.ROOT / "examples" / "ddp.py"
NO_IMPORT = releases.ROOT / "scripts" / "no_import_ddp.py"
REFERENCE = releases.ROOT / "scripts" / "ddp_reference.py"
# No launcher context, oneCCL / MPI / libfabric setting or venv may leak in from here.
LEAKS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_", "CCL_",
         "I_MPI_", "FI_", "VIRTUAL_ENV", "PYTHONPATH", "LD_LIBRARY_PATH", "CONDA")


def say(msg: str) -> None:
    print(f"[check_wheel {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> str:
    # Held until this script exits (scripts/ports.py: binding port 0 and closing it races).
    return str(ports.free_port())


def run(cmd, env, cwd, timeout=600) -> str:
    """Runs a command in its own session (a timeout kills the ranks too); its output, or exits."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        sys.exit(f"{' '.join(map(str, cmd))} did not finish within {timeout} s:\n{out[-4000:]}")
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def checksums(out: str) -> dict:
    # Ranks share one pipe, so lines may run together: match the number exactly.
    return dict(re.findall(r"rank (\d+) parameter checksum (-?\d+\.\d{10})", out))


def wheel_for(dist: Path, torch: str, python: str) -> Path:
    tag = f"cp{python.replace('.', '')}"
    wheels = sorted(dist.glob(f"oneccl_bind_pt-{releases.ROWS[torch]['version']}-{tag}-{tag}-manylinux_*.whl"))
    if not wheels:
        sys.exit(f"no manylinux wheel for torch {torch} / Python {python} in {dist}: "
                 f"python scripts/build_wheels.py --torch {torch} --python {python}")
    return wheels[-1]


def check(torch: str, python: str, wheel: Path, venv: Path) -> dict:
    row = releases.ROWS[torch]
    rep = {"torch": torch, "python": python, "wheel": wheel.name, "tag": wheel.name.rsplit("-", 1)[-1][:-4],
           "wheel_mib": round(wheel.stat().st_size / 2**20, 2)}
    if venv.exists():
        shutil.rmtree(venv)
    base = {k: v for k, v in os.environ.items() if not k.startswith(LEAKS)}
    base["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin:/bin"
    py = venv / "bin" / "python"
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]

    t = time.monotonic()
    run([releases.find_python(python), "-m", "venv", venv], base, venv.parent)
    # torch (a CUDA build with its nvidia-* packages for most pairs) is the venv's setting, not
    # what is proven: laid down by uv where there is one (releases.install_command), the wheel below
    # by the venv's pip, as a user installs it.
    # Byte-compiled: every rank of the proofs and of the pair's subset imports torch.
    install, env = releases.install_command(py, releases.pip_env(torch, base), compile=True)
    run(install + [f"torch=={torch}"], env, venv.parent, timeout=3600)
    rep["torch_venv_s"] = round(time.monotonic() - t, 1)
    rep["torch_venv_mib"] = round(releases.dir_mib(venv))
    say(f"torch {torch} / Python {python}: fresh venv with torch in {rep['torch_venv_s']} s, "
        f"{rep['torch_venv_mib']} MiB")

    # A build step (an sdist, a compiled dependency) would need a compiler: make any fail.
    t = time.monotonic()
    run(pip + [wheel], {**releases.pip_env(torch, base), "CC": "/bin/false", "CXX": "/bin/false"}, venv.parent)
    rep["wheel_install_s"] = round(time.monotonic() - t, 1)
    rep["venv_mib"] = round(releases.dir_mib(venv))
    listed = json.loads(run([py, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                            base, venv.parent))
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    rep["added_by_wheel"] = sorted(f"{n}=={v}" for n, v in installed.items()
                                   if n in ("oneccl-bind-pt", "impi-rt", "tcmlib"))
    if "oneccl-devel" in installed or list(venv.glob("include/oneapi/ccl.hpp")):
        sys.exit(f"oneCCL's development files got into the venv: {sorted(installed)}")
    if installed.get("oneccl-bind-pt") != row["version"]:
        sys.exit(f"expected oneccl_bind_pt {row['version']}, pip lists {installed.get('oneccl-bind-pt')}")
    run([py, "-m", "pip", "check", "--disable-pip-version-check"], base, venv.parent)
    say(f"torch {torch} / Python {python}: {wheel.name} installed without a compiler in "
        f"{rep['wheel_install_s']} s: {', '.join(rep['added_by_wheel'])}; venv {rep['venv_mib']} MiB")

    # From outside the checkout: the installed package, not the source tree.
    sums = {}
    torchrun = [venv / "bin" / "torchrun", "--nproc_per_node", "2", "--master_port"]
    for name, cmd, extra in (
        ("torchrun", [*torchrun, free_port(), EXAMPLE], {}),
        ("mpirun", [venv / "bin" / "mpirun", "-n", "2", py, EXAMPLE], {"MASTER_PORT": free_port()}),
    ):
        t = time.monotonic()
        out = run(cmd, {**base, **extra}, venv.parent, timeout=300)
        rep[f"{name}_s"] = round(time.monotonic() - t, 1)
        sums[name] = checksums(out)
        if sorted(sums[name]) != ["0", "1"]:
            sys.exit(f"{name}: expected a checksum from ranks 0 and 1:\n{out[-4000:]}")
        say(f"torch {torch} / Python {python}: {name} DDP: {sums[name]} ({rep[f'{name}_s']} s)")
    # Same seed and data under both launchers: one checksum from all four ranks, and the one
    # process that trains on all their data gets it too (one interpreter, not a third launch).
    values = {v for s in sums.values() for v in s.values()}
    if len(values) != 1:
        sys.exit(f"ranks or launchers disagree: {sums}")
    rep["checksum"] = values.pop()
    out = run([py, REFERENCE, "--world", "2"], base, venv.parent, timeout=300)
    one = re.search(r"one process checksum (-?\d+\.\d{10})", out)
    if not one or abs(float(one.group(1)) - float(rep["checksum"])) > 1e-6 * max(1.0, abs(float(one.group(1)))):
        sys.exit(f"the ranks' checksum {rep['checksum']} is not what one process computes:\n{out[-2000:]}")
    rep["one_process_checksum"] = one.group(1)
    say(f"torch {torch} / Python {python}: one process on both ranks' data: {one.group(1)}")

    if releases.version_tuple(torch) >= (2, 14):
        out = run([*torchrun, free_port(), NO_IMPORT], base, venv.parent, timeout=300)
        found = re.findall(r"rank (\d) no-import ccl checksum (-?\d+\.\d{10}) gloo checksum (-?\d+\.\d{10})", out)
        if sorted(r for r, _, _ in found) != ["0", "1"] or any(c != g for _, c, g in found):
            sys.exit(f"no-import script: expected equal ccl and gloo checksums from 2 ranks:\n{out[-4000:]}")
        rep["no_import"] = "trained"
        say(f"torch {torch} / Python {python}: no-import script trained on ccl through the entry point")
    else:
        rep["no_import"] = "n/a (torch < 2.14)"
    return rep


def markdown(done: list[dict]) -> str:
    rows = ["| wheel | tag | MiB | install (s) | checksum (torchrun, mpirun) | one process | no import |",
            "|---|---|---|---|---|---|---|"]
    rows += [f"| {r['wheel']} | {r['tag']} | {r['wheel_mib']} | {r['wheel_install_s']} | {r['checksum']} "
             f"| {r['one_process_checksum']} | {r['no_import']} |" for r in done]
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    releases.add_pair_options(ap, every=True)
    ap.add_argument("--dist", type=Path, default=releases.ROOT / "dist", help="the wheels (default: %(default)s)")
    ap.add_argument("--work", type=Path, help="where the fresh venvs go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    ap.add_argument("--json", type=Path, help="write sizes and times here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args()
    pairs = releases.selected_pairs(args)
    work = (args.work or Path(tempfile.mkdtemp(prefix="obp-wheel-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    done = []
    for torch, python in pairs:
        wheel = wheel_for(args.dist, torch, python)
        venv = work / f"venv-torch{torch}-py{python}"
        try:
            done.append(check(torch, python, wheel, venv))
        finally:
            if not args.keep:
                shutil.rmtree(venv, ignore_errors=True)
        if args.json:  # after each pair: a later failure keeps what was measured
            args.json.write_text(json.dumps(done, indent=2))
        if args.markdown:
            args.markdown.write_text(markdown(done))
    if not args.keep and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(done), end="")
    say(f"OK: {len(done)} wheels trained with equal checksums")
    return 0


if __name__ == "__main__":
    sys.exit(main())
