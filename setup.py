"""Builds oneccl_bind_pt._C: the ccl backend linked against oneCCL's CPU static archive.

The release (torch version, pins, Pythons) comes from the generated release table
(oneccl_bind_pt/_version.py): an sdist's own version, else $ONECCL_BIND_PT_RELEASE (a torch
version such as 2.14.1, for `python -m build --sdist` of another release), else the installed
torch, else the default release. Metadata and sdists need neither torch nor oneCCL.

Compiling needs that torch installed (`--no-deps` is enough: torch is located, never imported,
so a CUDA build without its nvidia-* packages works) and oneCCL, looked up under $CCL_ROOT,
else this Python's prefix (where the `oneccl-devel` wheel puts it). See README.md.
"""

import importlib.metadata
import importlib.util
import os
import re
import runpy
import shlex
import subprocess
import sys
from email.parser import Parser
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# The release table (generated from meta/releases.yaml): one row per supported torch minor.
TABLE = runpy.run_path(str(HERE / "oneccl_bind_pt" / "_version.py"))
PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"


def release_tuple(version):
    """'2.14.1+cu130' -> (2, 14, 1); '2.15.0a0+git1' -> (2, 15, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def installed_torch():
    """The installed torch's version, read from its metadata (importing a CUDA build installed
    without its nvidia-* packages fails, and compiling does not need it), or None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported():
    return "; ".join(f"torch {r['torch']} on Python {', '.join(r['python'])} -> oneccl_bind_pt {r['version']}"
                     for r in TABLE["RELEASES"].values())


def choose_release():
    """The release table's row this tree builds, and where that choice came from."""
    pkg_info = HERE / "PKG-INFO"
    if pkg_info.exists():  # an unpacked sdist: built for exactly one release
        version = Parser().parsestr(pkg_info.read_text())["Version"]
        row = next((r for r in TABLE["RELEASES"].values() if r["version"] == version), None)
        if row is None:
            sys.exit(f"oneccl_bind_pt: this sdist's version {version} is not in its release table")
        return row, f"this sdist (oneccl_bind_pt {version})"
    asked = os.environ.get("ONECCL_BIND_PT_RELEASE")
    if asked:
        row = TABLE["release_for"](asked)
        if row is None:
            sys.exit(f"oneccl_bind_pt: ONECCL_BIND_PT_RELEASE={asked} is no release. Supported: {supported()}.")
        return row, f"ONECCL_BIND_PT_RELEASE={asked}"
    torch = installed_torch()
    if torch is not None:
        row = TABLE["release_for"](torch)
        if row is not None:
            return row, f"the installed torch {torch}"
    return TABLE["RELEASES"][TABLE["DEFAULT"]], "the default release"


RELEASE, CHOSEN_BY = choose_release()


def install_hint():
    return (f"pip install torch=={RELEASE['torch']} oneccl-devel=={RELEASE['oneccl']} ninja 'setuptools>=77' wheel, "
            "then build with --no-build-isolation (or use ./scripts/setup.sh --torch "
            f"{RELEASE['torch']} --python {PYTHON} in a checkout)")


def check_build_inputs():
    """Stops, naming what to install, unless this Python, the installed torch and oneCCL are
    what the chosen release builds with. Returns (torch version, torch folder, oneCCL root)."""
    if PYTHON not in RELEASE["python"]:
        sys.exit(f"oneccl_bind_pt {RELEASE['version']} (chosen by {CHOSEN_BY}) supports Python "
                 f"{', '.join(RELEASE['python'])}, not {PYTHON}. Supported: {supported()}.")
    torch = installed_torch()
    spec = importlib.util.find_spec("torch")
    if torch is None or spec is None or spec.origin is None:
        sys.exit(f"oneccl_bind_pt {RELEASE['version']} builds against torch {RELEASE['torch']}, "
                 f"which is not installed in this Python ({sys.executable}).\nInstall the build inputs: "
                 f"{install_hint()}.")
    if TABLE["release_for"](torch) != RELEASE or release_tuple(torch) < release_tuple(RELEASE["torch"]):
        sys.exit(f"oneccl_bind_pt: torch {torch} is installed, but oneccl_bind_pt {RELEASE['version']} "
                 f"(chosen by {CHOSEN_BY}) builds against torch {RELEASE['torch']}.\n"
                 f"Supported: {supported()}.\nInstall the matching pair: {install_hint()}.")
    root = Path(os.environ.get("CCL_ROOT") or sys.prefix)
    need = {
        "header": root / "include" / "oneapi" / "ccl.hpp",
        "CPU static library": root / "lib" / "ccl" / "cpu" / "lib" / "libccl.a",
        "hwloc": root / "lib" / "libhwloc.so.15",
    }
    missing = [f"{what} ({path})" for what, path in need.items() if not path.exists()]
    if missing:
        sys.exit(
            "oneccl_bind_pt: oneCCL not found under "
            f"{root} ({'CCL_ROOT' if os.environ.get('CCL_ROOT') else 'the Python prefix'}); "
            f"missing: {', '.join(missing)}.\n"
            f"Install it with: pip install oneccl-devel=={RELEASE['oneccl']} "
            "(or set CCL_ROOT to a oneCCL install that has lib/ccl/cpu/lib/libccl.a)."
        )
    return torch, Path(spec.origin).parent, root


class BuildPy(build_py):
    """Writes _build_info.py into the build, never into the source tree: builds for
    different torch releases from one tree cannot overwrite each other's."""

    def run(self):
        super().run()
        torch, _, ccl_root = check_build_inputs()
        (Path(self.build_lib) / "oneccl_bind_pt" / "_build_info.py").write_text(
            "# Written by setup.py at build time.\n"
            f'RELEASE = "{RELEASE["torch"].rsplit(".", 1)[0]}"  # the row of _version.RELEASES built\n'
            f'TORCH_BUILT_WITH = "{torch}"\n'
            f'ONECCL_ROOT_AT_BUILD = "{ccl_root}"\n'
        )


PCH = HERE / "src" / "precompiled.hpp"


def uses_pch(src: Path) -> bool:
    """Every unit that includes a header of src/ (so torch's or oneCCL's); not the two shims that
    include system headers only: they define wrapped C library symbols and must not see torch."""
    return bool(re.search(r'^#include "', src.read_text(), re.M))


def ninja_compile(compiler, build_dir):
    """A compile() for the compiler object that builds every object with ninja: in parallel,
    and again only when a source or a header it includes changed (gcc's depfiles), which
    setuptools alone would not do."""

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0, extra_preargs=None,
                extra_postargs=None, depends=None):
        macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        cxx = getattr(compiler, "compiler_so_cxx", None) or compiler.compiler_so
        esc = lambda p: str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")  # noqa: E731
        build_dir.mkdir(parents=True, exist_ok=True)
        # builddir: ninja's log and dependency database go there, not into the checkout.
        lines = ["ninja_required_version = 1.3",
                 f"builddir = {esc(build_dir.resolve())}",
                 f"flags = {shlex.join([*cxx, *cc_args, *extra_postargs])}",
                 "rule cxx",
                 "  command = $flags $pch -MMD -MF $out.d -c $in -o $out",
                 "  depfile = $out.d",
                 "  deps = gcc",
                 "  description = c++ $in"]
        # The precompiled header: gcc takes <dir>/precompiled.hpp.gch in place of the copy beside it
        # when the flags match (else it reads the copy: slower, same result).
        header = build_dir / "pch" / PCH.name
        gch = header.with_name(PCH.name + ".gch")
        lines += ["rule pch",
                  "  command = cp $in $header && $flags -x c++-header -MMD -MF $out.d $header -o $out",
                  "  depfile = $out.d",
                  "  deps = gcc",
                  "  description = precompiled header",
                  f"build {esc(gch.resolve())}: pch {esc(PCH)}",
                  f"  header = {esc(header.resolve())}"]
        for obj, (src, _) in build.items():
            if uses_pch(Path(src)):
                lines += [f"build {esc(obj)}: cxx {esc(Path(src).resolve())} | {esc(gch.resolve())}",
                          f"  pch = -include {esc(header.resolve())} -Winvalid-pch"]
            else:
                lines += [f"build {esc(obj)}: cxx {esc(Path(src).resolve())}"]
        header.parent.mkdir(parents=True, exist_ok=True)
        ninja_file = build_dir / "build.ninja"
        text = "\n".join(lines) + "\n"
        if not ninja_file.exists() or ninja_file.read_text() != text:
            ninja_file.write_text(text)
        try:
            import ninja

            exe = str(Path(ninja.BIN_DIR) / "ninja")
        except ImportError:
            exe = "ninja"
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([exe, "-f", str(ninja_file), "-j", jobs], check=True)
        return objects

    return compile


class BuildExt(build_ext):
    def build_extensions(self):
        torch, torch_dir, ccl_root = check_build_inputs()
        lib = ccl_root / "lib"
        for ext in self.extensions:
            # torch's C++ extension flags (torch.utils.cpp_extension), without importing torch.
            ext.include_dirs += [str(ccl_root / "include"), str(torch_dir / "include"),
                                 str(torch_dir / "include" / "torch" / "csrc" / "api" / "include")]
            ext.library_dirs += [str(torch_dir / "lib"), str(lib)]
            ext.extra_objects += [str(lib / "ccl" / "cpu" / "lib" / "libccl.a")]
            # A oneCCL outside this prefix is found where it was at build time.
            if ccl_root != Path(sys.prefix):
                ext.extra_link_args += [f"-Wl,-rpath,{lib}"]
        self.compiler.compile = ninja_compile(self.compiler, Path(self.build_temp) / "ninja")
        # Always link (a second): ninja already skips up-to-date objects, and setuptools' own
        # check would keep a library linked with other flags.
        self.force = self.compiler.force = True
        super().build_extensions()
        # A declared-but-undefined oneCCL symbol links fine and fails at import.
        for ext in self.extensions:
            path = self.get_ext_fullpath(ext.name)
            out = subprocess.run([os.environ.get("NM", "nm"), "-D", "--undefined-only", path],
                                 capture_output=True, text=True, check=True).stdout
            bad = sorted({line.split()[-1] for line in out.splitlines() if "_ZN3ccl" in line})
            if bad:
                sys.exit(f"{path} leaves oneCCL symbols undefined (import would fail): {bad}")


# References bound to symbol versions newer than manylinux_2_28 (glibc 2.28, GCC 8's
# libstdc++) when linking on a newer system: src/glibc_compat.cpp defines a __wrap_ for each,
# calling the old version. scripts/build_wheels.py reports any other symbol that pins the tag.
WRAPPED = [
    "pthread_create", "pthread_join", "pthread_once", "pthread_barrier_init", "pthread_barrier_wait",
    "pthread_setaffinity_np", "pthread_getaffinity_np", "pthread_attr_setaffinity_np", "__pthread_key_create",
    "pthread_mutex_trylock", "pthread_setname_np", "pthread_sigmask", "pthread_getcpuclockid",
    "dlopen", "dlsym", "dlclose", "dlerror", "dladdr", "dlinfo", "log2", "fstat", "pthread_cond_clockwait",
    "__libc_single_threaded", "_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE",
]

ext = Extension(
    name="oneccl_bind_pt._C",
    language="c++",
    sources=sorted(str(p.relative_to(HERE)) for p in (HERE / "src").glob("*.cpp")),
    depends=sorted(str(p.relative_to(HERE)) for pattern in ("*.hpp", "*.inc") for p in (HERE / "src").glob(pattern)),
    include_dirs=[str(HERE / "src")],
    define_macros=[("TORCH_API_INCLUDE_EXTENSION_H", None), ("TORCH_EXTENSION_NAME", "_C")],
    # -g0: no debug info, a quarter of the compile time and size.
    extra_compile_args=["-std=c++20", "-O2", "-g0", "-Wno-deprecated-declarations"],
    libraries=["c10", "torch", "torch_cpu", "torch_python"],
    extra_link_args=[
        # Keep oneCCL's symbols private to the extension.
        "-Wl,--exclude-libs,ALL",
        "-l:libhwloc.so.15",
        # Recorded as needed even where glibc >= 2.34 has these in libc: glibc 2.28 defines the
        # old versions the wrappers below bind to in libpthread and libdl.
        # (By file name: glibc >= 2.34 ships only empty static archives for -lpthread and -ldl.)
        "-Wl,--push-state,--no-as-needed", "-l:libpthread.so.0", "-l:libdl.so.2", "-Wl,--pop-state",
        "-lrt",
        *(f"-Wl,--wrap={symbol}" for symbol in WRAPPED),
        # site-packages/oneccl_bind_pt -> <prefix>/lib: hwloc (tcmlib) and libfabric (impi-rt).
        "-Wl,-rpath,$ORIGIN/../../..",
    ],
)

# A conda build gets torch, hwloc and Intel MPI from conda packages (recipe/), so
# its metadata names only torch. Run time needs torch (any patch of the minor it was
# built with, as the conda package's pin_compatible and the import check), hwloc (tcmlib)
# and libfabric + mpirun (impi-rt); oneCCL itself is linked in statically.
install_requires = [RELEASE["torch_requirement"]]
if not os.environ.get("CONDA_BUILD"):
    install_requires += [f"impi-rt=={RELEASE['impi_rt']}", f"tcmlib=={RELEASE['tcmlib']}"]

setup(
    version=RELEASE["version"],
    python_requires=RELEASE["requires_python"],
    packages=["oneccl_bind_pt", "oneccl_bind_pt.env", "oneccl_bind_pt.env.conda",
              "oneccl_bindings_for_pytorch", "torch_ccl"],
    # env/ (setvars.sh, conda activation) ships inside the package: <cwd>/env/setvars.sh.
    package_dir={"oneccl_bind_pt.env": "env", "oneccl_bind_pt.env.conda": "env/conda"},
    package_data={"oneccl_bind_pt.env": ["*.sh"], "oneccl_bind_pt.env.conda": ["*.sh"]},
    install_requires=install_requires,
    # torch >= 2.14 looks backends up in this group when init_process_group meets a name it
    # does not know: "ccl" works without importing the package first.
    entry_points={"torch.distributed.backends": ["ccl = oneccl_bind_pt._registration:register"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
    # Objects, the linked extension and the wheel's staging tree per torch and Python: a
    # build never reuses (or skips as up to date) what was built against another torch.
    options={"build": {"build_base": f"build/torch-{installed_torch() or RELEASE['torch']}-py{PYTHON}"}},
)
