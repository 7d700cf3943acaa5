"""Builds oneccl_bind_pt._C: the ccl backend linked against oneCCL's CPU static archive.

oneCCL is looked up under $CCL_ROOT, else under this Python's prefix (where the
`oneccl-devel` wheel puts it). See README.md for the one-line setup.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def read_version_info():
    text = (HERE / "oneccl_bind_pt" / "_version.py").read_text()
    return dict(re.findall(r'^(\w+) = "([^"]+)"', text, re.M))


VERSION_INFO = read_version_info()


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
            f"Install it with: pip install oneccl-devel=={VERSION_INFO['ONECCL_VERSION']} "
            "(or set CCL_ROOT to a oneCCL install that has lib/ccl/cpu/lib/libccl.a)."
        )
    return root


def check_torch():
    import torch

    built = torch.__version__.split("+")[0]
    if built != VERSION_INFO["TORCH_VERSION"]:
        sys.exit(
            f"oneccl_bind_pt {VERSION_INFO['__version__']} builds against torch=="
            f"{VERSION_INFO['TORCH_VERSION']}, but torch {torch.__version__} is installed.\n"
            f"Install it with: pip install torch=={VERSION_INFO['TORCH_VERSION']}"
        )
    return torch.__version__


def write_build_info(torch_version, ccl_root):
    (HERE / "oneccl_bind_pt" / "_build_info.py").write_text(
        "# Written by setup.py at build time.\n"
        f'TORCH_BUILT_WITH = "{torch_version}"\n'
        f'ONECCL_ROOT_AT_BUILD = "{ccl_root}"\n'
    )


def make_extension():
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    root = find_oneccl()
    torch_version = check_torch()
    write_build_info(torch_version, root)
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
    return [ext], {"build_ext": Build}


ext_modules, cmdclass = make_extension()

# A conda build gets torch, hwloc and Intel MPI from conda packages (recipe/), so
# its metadata names only torch, with the same minor pin as the conda package.
if os.environ.get("CONDA_BUILD"):
    _torch_minor = ".".join(VERSION_INFO["TORCH_VERSION"].split(".")[:2])
    install_requires = [f"torch>={VERSION_INFO['TORCH_VERSION']},=={_torch_minor}.*"]
else:
    # Run time needs torch, hwloc (tcmlib) and libfabric + mpirun (impi-rt);
    # oneCCL itself is linked in statically.
    install_requires = [
        f"torch=={VERSION_INFO['TORCH_VERSION']}",
        f"impi-rt=={VERSION_INFO['IMPI_RT_VERSION']}",
        f"tcmlib=={VERSION_INFO['TCMLIB_VERSION']}",
    ]

setup(
    version=VERSION_INFO["__version__"],
    packages=["oneccl_bind_pt", "oneccl_bind_pt.env", "oneccl_bind_pt.env.conda",
              "oneccl_bindings_for_pytorch", "torch_ccl"],
    # env/ (setvars.sh, conda activation) ships inside the package: <cwd>/env/setvars.sh.
    package_dir={"oneccl_bind_pt.env": "env", "oneccl_bind_pt.env.conda": "env/conda"},
    package_data={"oneccl_bind_pt.env": ["*.sh"], "oneccl_bind_pt.env.conda": ["*.sh"]},
    install_requires=install_requires,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
