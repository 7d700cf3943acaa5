#!/usr/bin/env python3
"""The performance set on a many-core host, in two parts of one command each, and what it needs carried there.

Here (a checkout with the build tools), once per host image:

    python scripts/build_wheels.py --torch 2.11.0 --python 3.12 --dist build/perf-wheel
    .venv/bin/python scripts/perf_set.py prepare --wheel build/perf-wheel --dest build/perf-carry

There (the host: no compiler, no registry; its own Python with torch):

    python3 scripts/perf_set.py run --carry build/perf-carry --out DIR1 --part 1
    python3 scripts/perf_set.py run --carry build/perf-carry --out DIR2 --part 2

`prepare` copies the wheel and the run-time libraries a wheel for PyPI leaves to its declared
requirements (libfabric and its tcp, shm and rxm providers from impi-rt, hwloc from tcmlib)
into one folder, checks that each library is the one those packages installed (their RECORD
hashes), and that the folder stays under --max-mib.

`run` builds nothing and asks no registry. It installs the wheel for the host's Python with
`pip install --no-deps --no-index` into a venv made with --system-site-packages (the image's
torch), or into the image's Python (--into-image), puts the libraries in the folder the
extension's RUNPATH names ($ORIGIN/../../.. from the package; a different file of the same
name already there is an error, not overwritten), then runs from a folder that is not a
checkout:

  - python -m oneccl_bind_pt.bench_ddp at each of --ddp (the threads are OMP_NUM_THREADS;
    part 1: 2 ranks x 8 threads, 4 x 4, and 2 x 8 with DDP's gradient_as_bucket_view; part 2:
    2 x 7 with one oneCCL worker per rank; `2x8:helpers=2` and `2x8:idle=auto` are other
    forms), each with the configurations ccl, ccl+idle (idle helpers, in the same processes),
    oneccl, gloo and local; first in part 1, last in part 2 (which starts with its longest
    run, the 8-rank benchmark);
  - python -m oneccl_bind_pt.bench at each of --ranks (part 1: 2 and 4; part 2: 8), allreduce,
    allgather, reduce_scatter, alltoall, broadcast, sendrecv (--ops), --sizes (4 KiB to 64 MiB;
    part 2 without 64 KiB), with
    ccl, oneccl and oneccl+w, and pg at 2 ranks (float32 and bfloat16), single from 4 ranks
    (float32) (--backends, --many-backends, --many-dtypes);
  - at 2 ranks, staged against single copy (--single-sizes, e.g. 256K,1M,4M,16M,64M): where
    reading peers directly wins on this CPU;
  - at 2 ranks, the helper sweep: bench of our transport alone (pg) with ONECCL_BIND_PT_HELPERS
    at each of --helpers (e.g. 0,3,6; `3:kernels=avx512` is another form), allreduce,
    allgather, reduce_scatter, broadcast, sendrecv, 1-64 MiB.
    Run D answered both on the 16-core Xeon; no part runs them unless asked.

A host lent 15 minutes in all takes the two parts as two calls one after the other
(--part 1, about 420 s, then --part 2, about 200 s, each into its own --out: their files
share names); --part all runs both in one.

Everything lands in one folder (--out, required), at most 8 files: perf.log (every
table, as printed), one JSON per bench run (bench-<N>ranks.json), single.json, helpers.json (the
sweep, by --helpers entry: `3`, `3kavx512`), ddp.json (each bench_ddp run, by its --ddp entry), and summary.json
(host, versions, each run's command, exit status and seconds). A run that fails or passes its
--step-timeout is recorded and the next one still runs; the exit status is 1 if any failed.

`report DIR` (anywhere) prints, from a run's bench JSON, ccl against the best oneCCL column
(oneccl or oneccl+w) at every point: the ratio issue-style targets are stated in; and from
ddp.json each run's communication time (step - local) for ccl, ccl+idle, oneccl and gloo,
with ratios.

--installed skips the install and runs the package this interpreter already has (a
development .venv); with --quick (2 ranks, float32, 2 sizes, a small DDP model) that is
the check of the script itself on a small machine.
"""

from __future__ import annotations

import argparse
import base64
import glob
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = "allreduce,allgather,reduce_scatter,alltoall,broadcast,sendrecv"
# The helper-thread sweep (ONECCL_BIND_PT_HELPERS): 2 ranks, our transport only, the ops
# that copy and reduce large messages (a send's ring slots in runs), at sizes the split reaches.
HELPER_OPS = "allreduce,allgather,reduce_scatter,broadcast,sendrecv"
HELPER_SIZES = "1M,16M,64M"
# What the extension dlopens or links that its wheel does not carry: libfabric and the
# providers one host needs (without them the first group fails with "fi_getinfo error: ret
# -61"), from impi-rt; hwloc, from tcmlib.
LIBS = {"libfabric.so.1": "impi-rt", "libtcp-fi.so": "impi-rt", "libshm-fi.so": "impi-rt",
        "librxm-fi.so": "impi-rt", "libhwloc.so.15": "tcmlib"}
# bench_ddp runs may name knobs after a colon, e.g. 2x7:workers=1 (one oneCCL worker per rank
# beside 7 torch threads), 2x6:helpers=2, 2x8:idle=auto (helpers only while the host has idle
# cores: DDP's last buckets), or 2x8:view=1 (DDP with gradient_as_bucket_view).
DDP_KNOBS = {"workers": "ONECCL_BIND_PT_WORKERS", "helpers": "ONECCL_BIND_PT_HELPERS",
             "idle": "ONECCL_BIND_PT_IDLE_HELPERS"}
DDP_FLAGS = {"view": "--bucket-view"}
# Helper sweep entries: a count, optionally with the staging chunk, the kernels' instruction
# set or the copy, e.g. 3:chunk=2M, 3:kernels=avx512, 0:copy=loop. Each knob's letter goes
# into the entry's label in helpers.json (3c2M, 3kavx512, 0mloop).
HELPER_KNOBS = {"chunk": ("ONECCL_BIND_PT_SHM_CHUNK_BYTES", "c"), "kernels": ("ONECCL_BIND_PT_KERNELS", "k"),
                "copy": ("ONECCL_BIND_PT_COPY", "m")}
# The set in two parts, for a host lent 15 minutes (start and transfers included): two calls
# one after the other, part 1 then part 2 (or `--part all` where one call may take longer).
# Sized from run C on the 16-core Xeon (docs/performance.md): every column and both dtypes at
# 2 ranks ran past 140 s, four columns at 4 ranks took 122 s and at 8 ranks past 123 s, each
# bench_ddp 40-60 s, each helper run 13-16 s. DDP, the number users feel, runs first in part 1;
# part 2 starts with its longest run, the 8-rank benchmark, whose JSON is written only at its end.
# Part 1, about 420 s: DDP 2x8, 4x4 and 2x8 with bucket views, each with idle helpers as one
# more configuration in the same processes (about 180 s); bench at 2 ranks (four columns,
# float32 and bfloat16, 119 s in run D) and at 4 ranks (122 s). Run D's part 1 also ran staged
# against single copy and the helper sweep (31 s and 60 s), which it answered: `--single-sizes`
# and `--helpers` bring them back.
# Part 2, about 200 s: bench at 8 ranks (without 64 KiB: three columns and four sizes ran past
# 105 s in run D; now four, with oneccl+w); DDP with a oneCCL worker. (Run D answered the
# AVX-512 kernels against AVX2's, which part 2 swept before: no steady difference.)
# From 4 ranks `single` (single copy at every size) takes `pg`'s place: at 4 ranks and 16 MiB run B
# (single copy, reads split across the helpers) read allgather 1,927 us, all-to-all 1,507 and
# broadcast 914 where run C (staged, the copies split across them) read 3,803, 3,235 and 1,697,
# on two hosts of one image whose best oneCCL agreed within 2%: the column puts the two paths in
# one run. `pg` is `ccl` less torch.distributed's Python layer, which 2 ranks measure.
COMMON = dict(dtypes="float32,bfloat16", sizes="4K,64K,1M,16M,64M", seconds=0.02, rounds=2,
              backends="ccl,pg,oneccl,oneccl+w", many_backends="ccl,single,oneccl,oneccl+w", many_dtypes="float32",
              ddp_args=["--steps", "5", "--configs", "ccl,ccl+idle,oneccl,gloo,local"])
PARTS = {
    "1": dict(COMMON, ranks="2,4", helpers="", single_sizes="", ddp="2x8,4x4,2x8:view=1",
              budget=450, step_timeout=150, ddp_first=True),
    "2": dict(COMMON, ranks="8", sizes="4K,1M,16M,64M", helpers="", single_sizes="",
              ddp="2x7:workers=1", budget=300, step_timeout=200, ddp_first=False),
}
PARTS["all"] = dict(COMMON, ranks="2,4,8", helpers="", single_sizes="", ddp=PARTS["1"]["ddp"] + "," + PARTS["2"]["ddp"],
                    budget=760, step_timeout=200, ddp_first=True)
QUICK = dict(ranks="2", dtypes="float32", sizes="4K,1M", seconds=0.02, rounds=2, backends="", many_backends="",
             many_dtypes="", helpers="0,1", single_sizes="1M", ddp="2x1", budget=570, step_timeout=150, ddp_first=True,
             ddp_args=["--width", "256", "--layers", "3", "--batch", "4", "--steps", "3", "--warmup", "1"])


def say(msg: str) -> None:
    print(f"[perf_set {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- prepare (here)

def record_hashes(prefix: Path, package: str) -> dict[str, str]:
    """{file name in <prefix>/lib: its sha256 as RECORD writes it} for one installed package."""
    name = package.replace("-", "_")
    found = {}
    for record in glob.glob(str(prefix / "lib" / "python3*" / "site-packages" / f"{name}-*.dist-info" / "RECORD")):
        for line in Path(record).read_text().splitlines():
            path, _, rest = line.partition(",")
            if path.startswith("../../") and rest.startswith("sha256="):
                found[Path(path).name] = rest.split(",")[0].removeprefix("sha256=")
    return found


def file_hash(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def prepare(args) -> int:
    wheel = args.wheel
    if wheel.is_dir():
        tag = f"cp{args.python.replace('.', '')}"
        found = sorted(wheel.glob(f"oneccl_bind_pt-{args.torch}-{tag}-{tag}-*.whl"))
        if not found:
            sys.exit(f"no oneccl_bind_pt {args.torch} wheel for {tag} in {wheel}; build it with\n"
                     f"  python scripts/build_wheels.py --torch {args.torch} --python {args.python} --dist {wheel}")
        wheel = found[-1]
    prefix = args.libs_from
    dest = args.dest
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "lib").mkdir(parents=True)
    shutil.copy2(wheel, dest / wheel.name)
    manifest = {"wheel": wheel.name, "libs": {}}
    hashes = {pkg: record_hashes(prefix, pkg) for pkg in set(LIBS.values())}
    for name, package in LIBS.items():
        src = next((p for p in (prefix / "lib" / name, prefix / "lib" / "prov" / name) if p.exists()), None)
        if src is None:
            sys.exit(f"{name} is not under {prefix}/lib: install oneccl-devel there (it brings impi-rt and tcmlib)")
        want = hashes[package].get(name)
        if want is None or want != file_hash(src.resolve()):
            sys.exit(f"{src} is not the file {package} installed under {prefix} (RECORD "
                     f"{'has no entry' if want is None else 'hash differs'}): carry the package's own")
        shutil.copy2(src.resolve(), dest / "lib" / name)  # by its soname: the name the loader asks for
        manifest["libs"][name] = {"from": package, "bytes": src.resolve().stat().st_size}
    if args.with_udev:  # the system's, for a host image without one
        dirs = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
        udev = next((Path(d) / "libudev.so.1" for d in dirs if (Path(d) / "libudev.so.1").exists()), None)
        if udev is None:
            sys.exit("no libudev.so.1 on this system (apt-get install libudev1)")
        shutil.copy2(udev.resolve(), dest / "lib" / "libudev.so.1")
        manifest["libs"]["libudev.so.1"] = {"from": "system", "bytes": udev.resolve().stat().st_size}
    site = prefix / "lib"
    manifest["packages"] = {  # the versions the libraries came with
        pkg: ", ".join(d.name.removesuffix(".dist-info").split("-")[1]
                       for d in site.glob(f"python3*/site-packages/{pkg.replace('-', '_')}-*.dist-info"))
        for pkg in sorted(set(LIBS.values()))}
    (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    mib = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file()) / 2**20
    if mib > args.max_mib:
        sys.exit(f"{dest} holds {mib:.1f} MiB, over --max-mib {args.max_mib}")
    say(f"{dest}: {wheel.name} and {len(manifest['libs'])} libraries ({mib:.1f} MiB; "
        + ", ".join(f"{p} {v}" for p, v in manifest["packages"].items()) + ")")
    return 0


# ---------------------------------------------------------------- run (there)

def py_out(python: str, code: str, cwd: Path) -> str:
    return subprocess.run([python, "-c", code], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def install(args, work: Path, log) -> str:
    """Installs the carried wheel and libraries; returns the interpreter to run."""
    carry = args.carry.resolve()
    base = args.python
    version = py_out(base, "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')", work)
    torch = py_out(base, "import torch; print(torch.__version__.split('+')[0])", work)
    wheels = sorted(carry.glob(f"oneccl_bind_pt-*-cp{version}-cp{version}-*.whl"))
    if not wheels:
        sys.exit(f"no wheel for cp{version} in {carry}: {sorted(p.name for p in carry.glob('*.whl'))}")
    wheel = wheels[-1]
    release = wheel.name.split("-")[1]
    if release.split(".")[:2] != torch.split(".")[:2]:
        sys.exit(f"{wheel.name} is the release for torch {release}; this Python has torch {torch}")
    python = base
    if not args.into_image:
        # --without-pip: an image's Python may lack ensurepip; the image's pip is visible
        # through --system-site-packages and installs into the venv it runs in.
        venv = work / "venv"
        made = subprocess.run([base, "-m", "venv", "--system-site-packages", "--without-pip", venv],
                              capture_output=True).returncode == 0
        if made and subprocess.run([venv / "bin" / "python", "-c", "import torch"], cwd=work,
                                   capture_output=True).returncode == 0:
            python = str(venv / "bin" / "python")
        else:  # one try per host: go on as --into-image rather than stop
            say(f"a venv over {base} {'does not see its torch (is it a venv itself?)' if made else 'failed'}: "
                "installing into it instead (--into-image)")
    # --force-reinstall: the same version seen elsewhere on the path must not satisfy it.
    pip = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "--force-reinstall",
           "--disable-pip-version-check"]
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
        proc = subprocess.run([*pip, wheel], capture_output=True, text=True)
        if "externally-managed-environment" in proc.stderr:  # --into-image on a distribution's Python
            proc = subprocess.run([*pip, "--break-system-packages", wheel], capture_output=True, text=True)
        log.write(proc.stdout + proc.stderr)
        if proc.returncode:
            sys.exit(f"pip install {wheel.name} failed:\n{proc.stdout}{proc.stderr}")
    else:  # no pip at all: a wheel is a zip of the site-packages tree
        site = py_out(python, "import sysconfig; print(sysconfig.get_paths()['platlib'])", work)
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    # The extension's RUNPATH is $ORIGIN/../../..: the lib folder above site-packages.
    package = py_out(python, "import importlib.util as u; "
                     "print(u.find_spec('oneccl_bind_pt').submodule_search_locations[0])", work)
    libdir = (Path(package) / ".." / ".." / "..").resolve()
    for lib in sorted((carry / "lib").iterdir()):
        target = libdir / lib.name
        if os.path.lexists(target):  # --into-image: the image's own libraries live there (e.g. /usr/lib)
            if target.exists() and target.read_bytes() == lib.read_bytes():
                continue
            sys.exit(f"{target} already exists and differs from the carried {lib.name}: refusing to overwrite it")
        shutil.copy2(lib, target)
    say(f"installed {wheel.name} for {python}; {len(list((carry / 'lib').iterdir()))} libraries into {libdir}")
    return python


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_step(name, cmd, env, cwd, timeout, log) -> dict:
    """One run, its output to the terminal and the log; killed with its ranks past `timeout`."""
    say(f"{name}: {' '.join(map(str, cmd))}")
    log.write(f"\n===== {name}: {' '.join(map(str, cmd))}\n")
    log.flush()
    start = time.monotonic()
    # Its own process group: the ranks it spawns go with it on a timeout.
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(timeout, kill_group, (proc.pid,))
    timer.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
    finally:
        timer.cancel()
    seconds = round(time.monotonic() - start, 1)
    timed_out = rc == -signal.SIGKILL and seconds >= timeout
    say(f"{name}: exit {rc}{' (past --step-timeout)' if timed_out else ''}, {seconds} s")
    log.write(f"===== {name}: exit {rc}, {seconds} s\n")
    log.flush()
    return {"name": name, "cmd": [str(c) for c in cmd], "rc": rc, "timed_out": timed_out, "seconds": seconds}


def host_facts(python: str, cwd: Path) -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    versions = py_out(python, "import json, sys, torch, oneccl_bind_pt as o; print(json.dumps({'python': "
                      "sys.version.split()[0], 'torch': torch.__version__, 'oneccl_bind_pt': o.__version__, "
                      "'package': o.__file__}))", cwd)
    return {"cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "cpu": model,
            "kernel": platform.release(), **json.loads(versions)}


def helper_runs(spec: str) -> list[tuple[str, str, dict]]:
    """--helpers' entries as (entry, file label, environment); exits naming what is wrong
    before anything is installed or run."""
    runs, labels = [], set()
    for entry in filter(None, spec.split(",")):
        count, _, extra = entry.partition(":")
        if not count.isdigit():
            sys.exit(f"--helpers {entry}: {count!r} is not a helper count")
        env, label = {"ONECCL_BIND_PT_HELPERS": count}, count
        for kv in filter(None, extra.split(";")):
            key, eq, value = kv.partition("=")
            if not eq or key not in HELPER_KNOBS or not value.isalnum():
                sys.exit(f"--helpers {entry}: {kv!r} is not NAME=VALUE with NAME one of {', '.join(HELPER_KNOBS)}")
            var, letter = HELPER_KNOBS[key]
            env[var] = value
            label += f"{letter}{value}"
        if label in labels:
            sys.exit(f"--helpers {entry}: named twice (its results would overwrite each other)")
        labels.add(label)
        runs.append((entry, label, env))
    return runs


def ddp_runs(spec: str) -> list[tuple[str, str, str, dict, str]]:
    """--ddp's runs as (ranks, threads, knobs as given, knobs, file label); exits naming what
    is wrong before anything is installed or run."""
    runs, labels = [], set()
    for config in filter(None, spec.split(",")):
        shape, _, extra = config.partition(":")
        n, _, threads = shape.partition("x")
        if not (n.isdigit() and threads.isdigit()):
            sys.exit(f"--ddp {config}: {shape!r} is not RANKSxTHREADS (e.g. 2x8)")
        knobs = {}
        for kv in filter(None, extra.split(";")):
            key, eq, value = kv.partition("=")
            if not eq or key not in {**DDP_KNOBS, **DDP_FLAGS}:
                sys.exit(f"--ddp {config}: {kv!r} is not NAME=VALUE with NAME one of "
                         f"{', '.join(sorted({**DDP_KNOBS, **DDP_FLAGS}))}")
            if key in DDP_FLAGS and value not in ("0", "1"):
                sys.exit(f"--ddp {config}: {key} is 0 or 1, not {value!r}")
            knobs[key] = value
        label = "".join(f"-{k}{v}" for k, v in knobs.items())
        if (n, threads, label) in labels:
            sys.exit(f"--ddp {config}: named twice (its results would overwrite each other)")
        labels.add((n, threads, label))
        runs.append((n, threads, extra, knobs, label))
    return runs


def two_rank_runs(args, python, out: Path, work: Path) -> list:
    """Staged against single copy, and the helper sweep: 2 ranks, float32."""
    steps = []
    if args.single_sizes:
        # Where reading peers directly (single copy) beats the staging buffers on this
        # CPU: the crossovers in route.cpp were measured on one other machine.
        steps.append(("bench 2 ranks, staged against single copy",
                      [python, "-m", "oneccl_bind_pt.bench", "--nprocs", "2", "--ops", args.ops,
                       "--dtypes", "float32", "--sizes", args.single_sizes, "--backends", "staged,single",
                       "--seconds", args.seconds, "--rounds", args.rounds, "--quiet",
                       "--json", out / "single.json"], {}))
    for entry, label, helper_env in helper_runs(args.helpers):
        count, _, extra = entry.partition(":")
        steps.append((f"bench 2 ranks, {count} helpers{' ' + extra if extra else ''}",
                      [python, "-m", "oneccl_bind_pt.bench", "--nprocs", "2", "--ops", HELPER_OPS,
                       "--dtypes", "float32", "--sizes", HELPER_SIZES, "--backends", "pg",
                       "--seconds", args.seconds, "--rounds", args.rounds, "--quiet",
                       "--json", work / f"helpers-{label}.json"], helper_env))
    return steps


def run(args) -> int:
    preset = QUICK if args.quick else PARTS[args.part]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    ddp_runs(args.ddp)  # a mistyped run stops here, before the install
    helper_runs(args.helpers)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="perf-set-"))  # not a checkout: the installed package is imported
    summary = {"mode": "quick" if args.quick else f"part {args.part}", "steps": []}
    try:
        with open(out / "perf.log", "w") as log:
            python = args.python if args.installed else install(args, work, log)
            summary["host"] = host_facts(python, work)
            say(f"host: {summary['host']}")
            env = dict(os.environ)
            # gloo binds the interface its host name resolves to; a host whose NIC has no route
            # needs the loopback (no other variable: the ccl column runs on the package's defaults).
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
            # DDP (the number users feel; a budget cuts the last runs), the benchmark at 2 ranks
            # with the 2-rank runs beside it, then at more ranks; part 2 puts DDP last.
            ddp_steps = []
            for n, threads, extra, knobs, label in ddp_runs(args.ddp):
                env_extra = {"OMP_NUM_THREADS": threads,
                             **{DDP_KNOBS[k]: v for k, v in knobs.items() if k in DDP_KNOBS}}
                flags = [DDP_FLAGS[k] for k, v in knobs.items() if k in DDP_FLAGS and v == "1"]
                ddp_steps.append((f"bench_ddp {n} ranks x {threads} threads{' ' + extra if extra else ''}",
                                  [python, "-m", "oneccl_bind_pt.bench_ddp", "--nprocs", n, *args.ddp_args, *flags,
                                   *(["--dtypes", args.ddp_dtypes] if args.ddp_dtypes else []),
                                   "--json", work / f"ddp-{n}x{threads}{label}.json"], env_extra))
            steps = list(ddp_steps) if preset["ddp_first"] else []
            ranks = sorted(dict.fromkeys(filter(None, args.ranks.split(","))), key=lambda n: n != "2")
            for n in ranks:
                backends = args.backends if n == "2" else args.many_backends or args.backends
                dtypes = args.dtypes if n == "2" else args.many_dtypes or args.dtypes
                steps.append((f"bench {n} ranks", [python, "-m", "oneccl_bind_pt.bench", "--nprocs", n, "--ops", args.ops,
                                                   "--dtypes", dtypes, "--sizes", args.sizes,
                                                   *(["--backends", backends] if backends else []),
                                                   "--seconds", args.seconds, "--rounds", args.rounds, "--quiet",
                                                   "--json", out / f"bench-{n}ranks.json"], {}))
                if n == "2":  # the 2-rank runs after the 2-rank benchmark
                    steps += two_rank_runs(args, python, out, work)
            if "2" not in ranks:
                steps += two_rank_runs(args, python, out, work)
            if not preset["ddp_first"]:
                steps += ddp_steps
            for name, cmd, extra in steps:
                left = args.budget - (time.monotonic() - start)
                if left < 10:
                    say(f"{name}: not started, --budget {args.budget:.0f} s spent")
                    step = {"name": name, "cmd": [str(c) for c in cmd], "rc": None, "skipped": "budget"}
                else:
                    step = run_step(name, cmd, {**env, **extra}, work, min(args.step_timeout, left), log)
                summary["steps"].append({**step, "env": extra})  # what this run set beside the host's
                summary["seconds"] = round(time.monotonic() - start, 1)
                (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")  # kept if a later step hangs
        # One file for the sweep (a host may send back only a few files).
        sweep = {p.stem.split("-")[1]: json.loads(p.read_text()) for p in sorted(work.glob("helpers-*.json"))}
        if sweep:
            (out / "helpers.json").write_text(json.dumps(sweep, indent=1) + "\n")
        ddp = {p.stem.removeprefix("ddp-"): json.loads(p.read_text()) for p in sorted(work.glob("ddp-*.json"))}
        if ddp:
            (out / "ddp.json").write_text(json.dumps(ddp, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    failed = [s["name"] for s in summary["steps"] if s["rc"] != 0]
    say(f"{len(summary['steps'])} runs in {round(time.monotonic() - start, 1)} s, outputs in {out}"
        + (f"; not run or failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# ---------------------------------------------------------------- report (anywhere)

def report(args) -> int:
    """ccl against the best oneCCL column at every point of each bench JSON in args.dir."""
    files = sorted(args.dir.glob("bench-*ranks.json"), key=lambda f: int(f.stem.split("-")[1].removesuffix("ranks")))
    if not files:
        sys.exit(f"no bench-<N>ranks.json in {args.dir}")
    worst = 0.0
    for f in files:
        run = json.loads(f.read_text())
        points: dict[tuple, dict[str, float]] = {}
        for p in run["points"]:
            points.setdefault((p["op"], p["dtype"], p["bytes"]), {})[p["backend"]] = p["median_us"]
        cut = "; PARTIAL: a time limit stopped it, its later sets of processes are missing" if run.get("partial") else ""
        print(f"{run['world']} ranks ({f.name}{cut}): median us; best = the faster of oneccl and oneccl+w; "
              "single (where run): single copy at every size")
        print(f"  {'op':<15}{'dtype':<10}{'bytes':>10}{'ccl':>11}{'oneccl':>11}{'oneccl+w':>11}{'ccl/best':>9}  "
              f"{'single':>11}{'single/ccl':>11}")
        for (op, dtype, size), by in points.items():
            ours = by.get("ccl")
            best = min((by[c] for c in ("oneccl", "oneccl+w") if c in by), default=None)
            if ours is None or best is None:
                continue
            ratio = ours / best
            worst = max(worst, ratio)
            cells = "".join(f"{by[c]:>11,.1f}" if c in by else f"{'-':>11}" for c in ("ccl", "oneccl", "oneccl+w"))
            single = f"{by['single']:>11,.1f}{by['single'] / ours:>11.2f}" if "single" in by else ""
            print(f"  {op:<15}{dtype:<10}{size:>10}{cells}{ratio:>9.2f}{' *' if ratio > 1 else '  '}{single}")
    print(f"worst ccl/best: {worst:.2f} (* above 1)")
    ddp_file = args.dir / "ddp.json"
    if ddp_file.exists():
        # The DDP targets are on comm ms (step - local): ccl (and ccl with idle helpers, where
        # it ran) against oneccl and against gloo.
        configs, ours = ("ccl", "ccl+idle", "oneccl", "gloo"), ("ccl", "ccl+idle")
        print("DDP (ddp.json): comm ms = step - local, median; idle = ccl+idle")
        print(f"  {'run':<16}{'dtype':<10}" + "".join(f"{c:>10}" for c in configs)
              + "".join(f"{a.replace('ccl+idle', 'idle') + '/' + o:>12}" for a in ours for o in ("oneccl", "gloo")))
        for entry, run in json.loads(ddp_file.read_text()).items():
            for dtype, by in run["results"].items():
                comm = {c: by[c]["comm_ms"] for c in configs if "comm_ms" in by.get(c, {})}
                cells = "".join(f"{comm[c]:>10,.1f}" if c in comm else f"{'-':>10}" for c in configs)
                ratios = "".join(f"{comm[a] / comm[o]:>12.2f}" if a in comm and comm.get(o, 0) > 0 else f"{'-':>12}"
                                 for a in ours for o in ("oneccl", "gloo"))
                print(f"  {entry:<16}{dtype:<10}{cells}{ratios}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: collect the wheel and the libraries to carry into one folder")
    p.add_argument("--wheel", type=Path, default=ROOT / "build" / "perf-wheel",
                   help="the wheel, or the folder build_wheels.py wrote it to (default: %(default)s)")
    p.add_argument("--torch", default="2.11.0", help="the host's torch release (default: %(default)s)")
    p.add_argument("--python", default="3.12", help="the host's Python (default: %(default)s)")
    p.add_argument("--libs-from", type=Path, default=Path(sys.prefix),
                   help="a prefix where oneccl-devel's requirements (impi-rt, tcmlib) are installed "
                   "(default: this interpreter's, %(default)s)")
    p.add_argument("--with-udev", action="store_true", help="also carry this system's libudev.so.1 (hwloc needs "
                   "it; for a host image without it)")
    p.add_argument("--dest", type=Path, default=ROOT / "build" / "perf-carry",
                   help="the folder to carry (default: %(default)s)")
    p.add_argument("--max-mib", type=float, default=64, help="refuse a folder larger than this (default: %(default)s)")
    r = sub.add_parser("run", help="there: install what was carried and run the performance set")
    r.add_argument("--carry", type=Path, default=ROOT / "build" / "perf-carry",
                   help="prepare's folder (default: %(default)s)")
    r.add_argument("--python", default=sys.executable, help="the interpreter with torch (default: this one)")
    r.add_argument("--into-image", action="store_true", help="install into --python itself, not a venv over it")
    r.add_argument("--installed", action="store_true",
                   help="install nothing: run the oneccl_bind_pt --python already has")
    r.add_argument("--out", type=Path, required=True, help="output folder (required)")
    r.add_argument("--part", choices=sorted(PARTS), default="1",
                   help="which part of the set: 1 (DDP, 2 and 4 ranks), 2 (8 ranks, more DDP and the kernels' sweep), "
                   "or all in one call (default: %(default)s); each option below overrides the part's value")
    r.add_argument("--quick", action="store_true", help="a check of the script: 2 ranks, float32, 2 sizes, "
                   "a small DDP model on 2 ranks x 1 thread")
    r.add_argument("--ranks", help=f"bench's rank counts (part 1: {PARTS['1']['ranks']}; part 2: {PARTS['2']['ranks']}; --quick {QUICK['ranks']})")
    r.add_argument("--ops", default=OPS, help="bench's ops, at every rank count and in the staged-against-single-copy "
                   "run (default: %(default)s)")
    r.add_argument("--dtypes", help=f"bench's dtypes (default: {COMMON['dtypes']})")
    r.add_argument("--sizes", help=f"bench's message sizes (default: {COMMON['sizes']}; --quick {QUICK['sizes']})")
    r.add_argument("--seconds", type=float, help=f"bench's time per column per point (default: {COMMON['seconds']})")
    r.add_argument("--rounds", type=int, help=f"bench's interleaved rounds (default: {COMMON['rounds']})")
    r.add_argument("--helpers", help=f"the helper sweep's runs at 2 ranks: ONECCL_BIND_PT_HELPERS values, each "
                   f"optionally with :chunk=SIZE (ONECCL_BIND_PT_SHM_CHUNK_BYTES), :kernels=ISA (_KERNELS) or :copy=glibc|loop "
                   f"(_COPY), joined by ';', '' for none (default: "
                   f"part 1: {PARTS['1']['helpers']}; part 2: {PARTS['2']['helpers']}; --quick {QUICK['helpers']})")
    r.add_argument("--backends", help=f"bench's columns at 2 ranks, '' for all of bench's (default: {COMMON['backends']})")
    r.add_argument("--many-backends", help="bench's columns from 4 ranks on (default: --backends)")
    r.add_argument("--many-dtypes", help=f"bench's dtypes from 4 ranks on (default: {COMMON['many_dtypes']}; "
                   "'' for --dtypes)")
    r.add_argument("--ddp-dtypes", help="bench_ddp's dtypes (default: bench_ddp's, float32 and bfloat16)")
    r.add_argument("--single-sizes", help=f"sizes of the staged-against-single-copy run at 2 ranks, '' for none "
                   f"(default: part 1: {PARTS['1']['single_sizes']})")
    r.add_argument("--ddp", help=f"bench_ddp's RANKSxTHREADS[:workers=N;helpers=N;view=1] runs (part 1: {PARTS['1']['ddp']}; part 2: {PARTS['2']['ddp']}; --quick {QUICK['ddp']})")
    r.add_argument("--step-timeout", type=float, help="seconds before one run is killed with its ranks (default: "
                   + ", ".join(f"part {k} {v['step_timeout']:.0f}" for k, v in PARTS.items()) + ")")
    r.add_argument("--budget", type=float, help="seconds from the start after which no run starts and the one in "
                   "progress is killed (default: " + ", ".join(f"part {k} {v['budget']:.0f}" for k, v in PARTS.items())
                   + ")")
    q = sub.add_parser("report", help="anywhere: ccl against the best oneCCL column, from a run's folder")
    q.add_argument("dir", type=Path, help="a run's --out folder")
    args = ap.parse_args()
    if args.command == "report":
        return report(args)
    if args.command == "prepare":
        return prepare(args)
    args.ddp_args = None
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
