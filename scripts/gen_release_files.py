#!/usr/bin/env python3
"""Write the files that follow from meta/releases.yaml.

    python scripts/gen_release_files.py           # rewrite them
    python scripts/gen_release_files.py --check   # exit 1 and list the stale ones

Outputs: recipe/conda_build_config.yaml, environments/torch-<v>/environment.yml,
oneccl_bind_pt/_version.py, and the torch / oneccl-devel pins in pyproject.toml and
requirements.txt. This checkout builds the newest release in the matrix.
"""

import argparse
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Generated from meta/releases.yaml by scripts/gen_release_files.py: do not edit.\n"


def load(path=ROOT / "meta" / "releases.yaml"):
    meta = yaml.safe_load(path.read_text())
    releases = meta["releases"]
    if not releases:
        sys.exit("meta/releases.yaml lists no release")
    return meta, releases[-1]


def package_version(rel):
    """PyPI version: the torch release plus the flavour, as torch's own CPU wheels."""
    return f"{rel['torch']}+{rel['flavour']}"


def variants(meta):
    rels = meta["releases"]
    pythons = sorted({p for r in rels for p in r["python"]}, key=lambda v: tuple(map(int, v.split("."))))
    tc = meta["toolchain"]
    doc = {
        "cxx_compiler": [tc["cxx_compiler"]],
        "cxx_compiler_version": [tc["cxx_compiler_version"]],
        "c_stdlib": [tc["c_stdlib"]],
        "c_stdlib_version": [tc["c_stdlib_version"]],
        "python": pythons,
        # One entry per release, zipped: each PyTorch release with its own pins.
        "pytorch": [r["torch"] for r in rels],
        "oneccl_devel": [r["oneccl"] for r in rels],
        "impi_rt": [r["impi_rt"] for r in rels],
        "hwloc": [r["hwloc"] for r in rels],
        "oneccl_bind_pt_build": [r["build_number"] for r in rels],
        "zip_keys": [["pytorch", "oneccl_devel", "impi_rt", "hwloc", "oneccl_bind_pt_build"]],
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def environment(meta, rel):
    python = rel["python"][-1]
    deps = [
        f"python={python}",
        f"pytorch={rel['torch']}={rel['flavour']}*",
        f"oneccl_bind_pt={rel['torch']}={rel['flavour']}_py{python.replace('.', '')}*_{rel['build_number']}",
        f"impi_rt={rel['impi_rt']}",
        f"hwloc={rel['hwloc']}",
    ]
    doc = {
        "name": f"oneccl-bind-pt-torch{rel['torch']}",
        "channels": list(meta["channels"]),
        "dependencies": deps,
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def version_py(rel):
    return (
        HEADER
        + "# The torch release this build pairs with, and the CPU flavour.\n"
        + f'__version__ = "{package_version(rel)}"\n'
        + f'TORCH_VERSION = "{rel["torch"]}"\n'
        + f'ONECCL_VERSION = "{rel["oneccl"]}"\n'
        + f'IMPI_RT_VERSION = "{rel["impi_rt"]}"\n'
        + f'TCMLIB_VERSION = "{rel["tcmlib"]}"\n'
    )


def repin(text, name, version):
    """Replace `"name==x"` / `name==x` pins, keeping everything else."""
    new, n = re.subn(rf'(?m)^(\s*"?){re.escape(name)}==[^"\s,]+', rf"\g<1>{name}=={version}", text)
    if n == 0:
        sys.exit(f"no {name}== pin found to update")
    return new


def pinned(path, rel):
    text = path.read_text()
    text = repin(text, "torch", rel["torch"])
    return repin(text, "oneccl-devel", rel["oneccl"])


def outputs():
    meta, rel = load()
    files = {
        ROOT / "recipe" / "conda_build_config.yaml": variants(meta),
        ROOT / "oneccl_bind_pt" / "_version.py": version_py(rel),
        ROOT / "pyproject.toml": pinned(ROOT / "pyproject.toml", rel),
        ROOT / "requirements.txt": pinned(ROOT / "requirements.txt", rel),
    }
    for r in meta["releases"]:
        files[ROOT / "environments" / f"torch-{r['torch']}" / "environment.yml"] = environment(meta, r)
    return files


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = ap.parse_args()
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("stale (run python scripts/gen_release_files.py):", *map(str, stale), sep="\n  ")
        return 1
    for p in stale:
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
