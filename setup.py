"""Builds oneccl_bind_pt._C: the ccl backend linked against oneCCL's CPU static archive.

oneCCL is looked up under $CCL_ROOT, else under this Python's prefix (where the
`oneccl-devel` wheel puts it). See README.md for the one-line setup.
"""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# The release table (generated from meta/releases.yaml): one row per supported torch minor.
TABLE = runpy.run_path(str(HERE / "oneccl_bind_pt" / "_version.py"))


def release_tuple(version):
    """'2.14.1+cu130' -> (2, 14, 1); '2.15.0a0+git1' -> (2, 15, 0)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def choose_release():
    """The row of the release table for the installed torch (same major.minor, same or later
    patch) and that torch's version; stops with the supported releases when there is none."""
    import torch

    row = TABLE["release_for"](torch.__version__)
    if row is None or release_tuple(torch.__version__) < release_tuple(row["torch"]):
        supported = ", ".join(f"{r['torch_requirement']} -> oneccl_bind_pt {r['version']}"
                              for r in TABLE["RELEASES"].values())
        suggest = (row or TABLE["RELEASES"][TABLE["DEFAULT"]])["torch"]
        sys.exit(
            f"oneccl_bind_pt: torch {torch.__version__} is installed, which no release here builds against.\n"
            f"Supported: {supported}.\n"
            f"Install one of them first, e.g.: pip install torch=={suggest} "
            "(or ./scripts/setup.sh --torch <version>), then build with --no-build-isolation."
        )
    return row, torch.__version__


def find_oneccl():
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
    return root


RELEASE, TORCH_VERSION = choose_release()
CCL_ROOT = find_oneccl()


class BuildPy(build_py):
    """Writes _build_info.py into the build, never into the source tree: builds for
    different torch releases from one tree cannot overwrite each other's."""

    def run(self):
        super().run()
        (Path(self.build_lib) / "oneccl_bind_pt" / "_build_info.py").write_text(
            "# Written by setup.py at build time.\n"
            f'RELEASE = "{RELEASE["torch"].rsplit(".", 1)[0]}"  # the row of _version.RELEASES built\n'
            f'TORCH_BUILT_WITH = "{TORCH_VERSION}"\n'
            f'ONECCL_ROOT_AT_BUILD = "{CCL_ROOT}"\n'
        )


def make_extension():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    root = CCL_ROOT
    lib = root / "lib"

    class Build(BuildExtension):
        def build_extensions(self):
            super().build_extensions()
            # A declared-but-undefined oneCCL symbol links fine and fails at import.
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                out = subprocess.run(
                    [os.environ.get("NM", "nm"), "-D", "--undefined-only", path], capture_output=True, text=True, check=True
                ).stdout
                bad = sorted({line.split()[-1] for line in out.splitlines() if "_ZN3ccl" in line})
                if bad:
                    sys.exit(f"{path} leaves oneCCL symbols undefined (import would fail): {bad}")

    ext = CppExtension(
        name="oneccl_bind_pt._C",
        sources=sorted(str(p.relative_to(HERE)) for p in (HERE / "src").glob("*.cpp")),
        include_dirs=[str(HERE / "src"), str(root / "include")],
        # -g0: no debug info, a quarter of the compile time and size.
        extra_compile_args=["-O2", "-g0", "-Wno-deprecated-declarations"],
        extra_objects=[str(lib / "ccl" / "cpu" / "lib" / "libccl.a")],
        extra_link_args=[
            # Keep oneCCL's symbols private to the extension.
            "-Wl,--exclude-libs,ALL",
            f"-L{lib}",
            "-l:libhwloc.so.15",
            "-ldl",
            "-lrt",
            # site-packages/oneccl_bind_pt -> <prefix>/lib: hwloc and libfabric.
            "-Wl,-rpath,$ORIGIN/../../..",
        ]
        # A oneCCL outside this prefix is found where it was at build time.
        + ([] if root == Path(sys.prefix) else [f"-Wl,-rpath,{lib}"]),
    )
    return [ext], {"build_ext": Build, "build_py": BuildPy}


ext_modules, cmdclass = make_extension()

# A conda build gets torch, hwloc and Intel MPI from conda packages (recipe/), so
# its metadata names only torch. Run time needs torch (any patch of the minor it was
# built with, as the conda package's pin_compatible and the import check), hwloc (tcmlib)
# and libfabric + mpirun (impi-rt); oneCCL itself is linked in statically.
install_requires = [RELEASE["torch_requirement"]]
if not os.environ.get("CONDA_BUILD"):
    install_requires += [f"impi-rt=={RELEASE['impi_rt']}", f"tcmlib=={RELEASE['tcmlib']}"]

setup(
    version=RELEASE["version"],
    packages=["oneccl_bind_pt", "oneccl_bind_pt.env", "oneccl_bind_pt.env.conda",
              "oneccl_bindings_for_pytorch", "torch_ccl"],
    # env/ (setvars.sh, conda activation) ships inside the package: <cwd>/env/setvars.sh.
    package_dir={"oneccl_bind_pt.env": "env", "oneccl_bind_pt.env.conda": "env/conda"},
    package_data={"oneccl_bind_pt.env": ["*.sh"], "oneccl_bind_pt.env.conda": ["*.sh"]},
    install_requires=install_requires,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # Objects, the linked extension and the wheel's staging tree per torch version: a build
    # never reuses (or skips as up to date) what was built against another torch.
    options={"build": {"build_base": f"build/torch-{TORCH_VERSION}"}},
)
