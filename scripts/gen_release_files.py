#!/usr/bin/env python3
"""Write the files that follow from meta/releases.yaml.

    python scripts/gen_release_files.py           # rewrite them
    python scripts/gen_release_files.py --check   # exit 1 and list the stale ones

Outputs: recipe/conda_build_config.yaml (one variant per (python, torch) pair),
environments/torch-<t>-py<p>.yml per pair, requirements/torch-<t>.txt per release (pins
that differ by Python carry python_version markers), oneccl_bind_pt/_version.py (the
release table setup.py, the scripts and the package use), requirements.txt (the default
release's set), and README.md's tables when README.md has the markers.
"""

import argparse
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Generated from meta/releases.yaml by scripts/gen_release_files.py: do not edit.\n"
# README.md's compatibility table sits between these lines (the generator leaves a README
# without them alone).
TABLE_BEGIN = "<!-- releases table: generated from meta/releases.yaml by scripts/gen_release_files.py -->"
TABLE_END = "<!-- end of releases table -->"
# A requirement set whose first lines carry this is installed with pip's global constraint
# lifted (scripts/setup.sh, scripts/check_wheel.py).
LIFT_MARKER = "# lift-pip-constraint:"


def load(path=ROOT / "meta" / "releases.yaml"):
    """The matrix and its default release."""
    meta = yaml.safe_load(path.read_text())
    releases = meta["releases"]
    if not releases:
        sys.exit("meta/releases.yaml lists no release")
    default = next((r for r in releases if r["torch"] == meta["default"]), None)
    if default is None:
        sys.exit(f"meta/releases.yaml: default {meta['default']} is not one of its releases")
    if meta["default_python"] not in default["python"]:
        sys.exit(f"meta/releases.yaml: default_python {meta['default_python']} is not one of "
                 f"torch {default['torch']}'s pythons {default['python']}")
    listed = set(pairs(meta))
    for entry in meta.get("ci", []):
        if (entry["torch"], entry["python"]) not in listed:
            sys.exit(f"meta/releases.yaml: ci pair torch {entry['torch']} / Python {entry['python']} "
                     "is not in the matrix")
    return meta, default


def pairs(meta):
    """Every (torch, python) pair the matrix lists, in its order."""
    return [(r["torch"], p) for r in meta["releases"] for p in r["python"]]


def minor(version):
    """'2.14.1' -> '2.14'."""
    return ".".join(version.split(".")[:2])


def package_version(rel):
    """PyPI version: the torch release it is built with (PyPI refuses local versions such as
    +cpu), with .postN for a rebuild of the same release."""
    return rel["torch"] + (f".post{rel['build_number']}" if rel["build_number"] else "")


def requires_python(rel):
    """'>=3.10,<3.14' from ['3.10', ..., '3.13']: the Pythons torch ships this release for."""
    low, high = rel["python"][0], rel["python"][-1]
    major, mnr = map(int, high.split("."))
    return f">={low},<{major}.{mnr + 1}"


def torch_requirement(rel):
    """What a wheel built against this release accepts: any later patch of the same minor
    (torch keeps its C++ ABI within a minor), as the conda package's
    pin_compatible(upper_bound='x.x') and the import check do."""
    major, mnr = map(int, rel["torch"].split(".")[:2])
    return f"torch>={rel['torch']},<{major}.{mnr + 1}"


def variants(meta):
    rels = {r["torch"]: r for r in meta["releases"]}
    matrix = pairs(meta)
    tc = meta["toolchain"]
    doc = {
        "cxx_compiler": [tc["cxx_compiler"]],
        "cxx_compiler_version": [tc["cxx_compiler_version"]],
        "c_stdlib": [tc["c_stdlib"]],
        "c_stdlib_version": [tc["c_stdlib_version"]],
        # One entry per (python, torch) pair, zipped: releases support different Pythons,
        # so python is zipped with each release's pins rather than crossed with them.
        "python": [p for _, p in matrix],
        "pytorch": [t for t, _ in matrix],
        "oneccl_devel": [rels[t]["oneccl"] for t, _ in matrix],
        "impi_rt": [rels[t]["impi_rt"] for t, _ in matrix],
        "hwloc": [rels[t]["hwloc"] for t, _ in matrix],
        "oneccl_bind_pt_build": [rels[t]["build_number"] for t, _ in matrix],
        "zip_keys": [["python", "pytorch", "oneccl_devel", "impi_rt", "hwloc", "oneccl_bind_pt_build"]],
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


def environment(meta, rel, python):
    deps = [
        f"python={python}",
        f"pytorch={rel['torch']}={rel['flavour']}*",
        f"oneccl_bind_pt={rel['torch']}={rel['flavour']}_py{python.replace('.', '')}*_{rel['build_number']}",
        f"impi_rt={rel['impi_rt']}",
        f"hwloc={rel['hwloc']}",
    ]
    doc = {
        "name": f"oneccl-bind-pt-torch{rel['torch']}-py{python}",
        "channels": list(meta["channels"]),
        "dependencies": deps,
    }
    return HEADER + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)


VERSION_PY = '''"""The supported releases: one oneccl_bind_pt release per PyTorch minor, keyed by it.

setup.py builds the row of the installed torch (its version, the pins its wheel declares,
the Pythons it supports) and records the row it chose in _build_info.py, which it writes
into the build.
"""

RELEASES = {
%(rows)s}
DEFAULT = "%(default)s"
DEFAULT_PYTHON = "%(default_python)s"


def release_for(torch_version):
    """The row for a torch of the same major.minor (any patch or local tag), else None."""
    return RELEASES.get(".".join(torch_version.split("+")[0].split(".")[:2]))


try:  # the row this build was made for
    from ._build_info import RELEASE as _BUILT
except ImportError:  # a tree nobody built, or setup.py reading this file on its own
    _BUILT = DEFAULT
__version__ = RELEASES[_BUILT]["version"]
TORCH_VERSION = RELEASES[_BUILT]["torch"]
ONECCL_VERSION = RELEASES[_BUILT]["oneccl"]
IMPI_RT_VERSION = RELEASES[_BUILT]["impi_rt"]
TCMLIB_VERSION = RELEASES[_BUILT]["tcmlib"]
'''


def version_py(meta, default):
    def row(r):
        fields = {"version": package_version(r), "torch": r["torch"], "torch_requirement": torch_requirement(r),
                  "python": r["python"], "requires_python": requires_python(r),
                  "oneccl": r["oneccl"], "impi_rt": r["impi_rt"], "tcmlib": r["tcmlib"]}
        return (f'    "{minor(r["torch"])}": {{\n'
                + "".join(f'        "{k}": {v!r},\n'.replace("'", '"') for k, v in fields.items()) + "    },\n")

    return HEADER + VERSION_PY % {"rows": "".join(row(r) for r in meta["releases"]),
                                  "default": minor(default["torch"]), "default_python": meta["default_python"]}


def requirements(meta, rel):
    lines = [HEADER.rstrip(),
             f"# The pinned stack oneccl_bind_pt {package_version(rel)} builds and is tested with "
             f"(scripts/setup.sh --torch {rel['torch']})."]
    if rel.get("lift_pip_constraint"):
        lines.append(f"{LIFT_MARKER} torch {rel['torch']} is above the cap in this project's build machines' "
                     "pip configuration; scripts/setup.sh installs this set with PIP_CONSTRAINT=/dev/null")
    # torch is pinned: an unpinned torch pulls the CUDA build.
    lines += [f"torch=={rel['torch']}", f"oneccl-devel=={rel['oneccl']}",
              f"impi-rt=={rel['impi_rt']}", f"tcmlib=={rel['tcmlib']}"]
    for group in rel["pip"]:
        lines.append(f"# {group}: {meta['pip'][group]['about']}")
        lines += meta["pip"][group]["pins"]
    return "\n".join(lines) + "\n"


def default_requirements(default):
    return (HEADER + "# The default release's set (scripts/setup.sh without --torch, CI); "
            "the others: requirements/torch-<version>.txt.\n"
            f"-r requirements/torch-{default['torch']}.txt\n")


def release_table(meta):
    """README.md's tables: which oneccl_bind_pt to install for each torch and Python, then
    every release's pins and how it was checked."""
    pythons = sorted({p for r in meta["releases"] for p in r["python"]}, key=lambda v: tuple(map(int, v.split("."))))
    ci = {(e["torch"], e["python"]) for e in meta.get("ci", [])} | {(meta["default"], meta["default_python"])}
    rows = ["| torch | " + " | ".join(f"Python {p}" for p in pythons) + " |",
            "|---|" + "---|" * len(pythons)]
    for r in meta["releases"]:
        cells = [(f"{package_version(r)}" + (" (CI)" if (r["torch"], p) in ci else "")) if p in r["python"] else "-"
                 for p in pythons]
        rows.append(f"| {minor(r['torch'])}.x | " + " | ".join(cells) + " |")
    rows += ["", "| oneccl_bind_pt | torch | oneCCL | Intel MPI runtime | hwloc | Python | how it was checked |",
             "|---|---|---|---|---|---|---|"]
    for r in meta["releases"]:
        rows.append(
            f"| {package_version(r)} (pip), {r['torch']} `{r['flavour']}_*` (conda) "
            f"| {minor(r['torch'])}.x (built with {r['torch']}) | {r['oneccl']} | {r['impi_rt']} | {r['hwloc']} "
            f"| {', '.join(r['python'])} | {' '.join(r['checked'].split())} |")
    # What each release offers: a feature is there from the torch minor that added it to c10d.
    rows += ["", "| feature | " + " | ".join(minor(r["torch"]) for r in meta["releases"]) + " |",
             "|---|" + "---|" * len(meta["releases"])]
    for f in meta.get("features", []):
        since = tuple(map(int, f["since"].split(".")))
        marks = ["yes" if tuple(map(int, minor(r["torch"]).split("."))) >= since else "-" for r in meta["releases"]]
        rows.append(f"| {f['what']} | " + " | ".join(marks) + " |")
    return "\n".join(rows)


def readme(path, meta):
    """README.md with the table between the markers replaced; None without the markers."""
    text = path.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return None
    head, rest = text.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{release_table(meta)}\n{TABLE_END}{tail}"


def outputs(root=ROOT):
    meta, default = load(root / "meta" / "releases.yaml")
    files = {
        root / "recipe" / "conda_build_config.yaml": variants(meta),
        root / "oneccl_bind_pt" / "_version.py": version_py(meta, default),
        root / "requirements.txt": default_requirements(default),
    }
    for r in meta["releases"]:
        for python in r["python"]:
            files[root / "environments" / f"torch-{r['torch']}-py{python}.yml"] = environment(meta, r, python)
        files[root / "requirements" / f"torch-{r['torch']}.txt"] = requirements(meta, r)
    if (root / "README.md").exists() and (text := readme(root / "README.md", meta)) is not None:
        files[root / "README.md"] = text
    return files


def obsolete(files, root=ROOT):
    """Per-release files of a release the matrix no longer lists."""
    found = [*root.glob("environments/torch-*/environment.yml"), *root.glob("environments/torch-*.yml"),
             *root.glob("requirements/torch-*.txt")]
    return sorted(p for p in found if p not in files)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = ap.parse_args()
    files = outputs()
    stale = [p for p, text in files.items() if not (p.exists() and p.read_text() == text)]
    gone = obsolete(files)
    if args.check:
        if stale or gone:
            print("stale (run python scripts/gen_release_files.py):",
                  *(str(p.relative_to(ROOT)) for p in stale),
                  *(f"{p.relative_to(ROOT)} (no such release)" for p in gone), sep="\n  ")
            return 1
        return 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p])
        print("wrote", p.relative_to(ROOT))
    root_env = ROOT / "environments"
    for p in gone:
        p.unlink()
        if p.parent != root_env and not any(p.parent.iterdir()):
            p.parent.rmdir()
        print("removed", p.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
