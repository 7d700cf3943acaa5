"""Markdown tables from saved runs (runner.SuiteRun.save): counts, then every ccl difference."""

from __future__ import annotations

import re
from pathlib import Path

from pytorch_suite.compare import compare, excerpt
from pytorch_suite.known_issues import known_for
from pytorch_suite.runner import FAILED, PASSED, SKIPPED, SuiteRun


def label(run: SuiteRun) -> str:
    """gloo, ccl (on shared memory) or ccl-oneccl: a run's row, and its file's stem."""
    return "ccl-oneccl" if run.backend == "ccl" and run.transport == "oneccl" else run.backend


def load_runs(dirs: list[Path]) -> dict[tuple[str, int], SuiteRun]:
    runs = {}
    for d in dirs:
        for path in sorted(Path(d).glob("*-ws*.json")):
            run = SuiteRun.load(path)
            runs[(label(run), run.world_size)] = run
    return runs


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text).replace("|", "\\|")


def counts_table(runs: dict[tuple[str, int], SuiteRun]) -> str:
    rows = ["| world size | backend | passed | failed | skipped | cases | wall time |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for (backend, world), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "gloo")):
        c = run.counts()
        note = "" if run.complete else " (incomplete)"
        rows.append(f"| {world} | {backend} | {c[PASSED]} | {c[FAILED]} | {c[SKIPPED]} | {len(run.cases)} "
                    f"| {run.wall_seconds / 60:.1f} min{note} |")
    return "\n".join(rows)


def differences_table(gloo: SuiteRun, ccl: SuiteRun) -> str:
    """The cases ccl does worse on, one row per known issue (its cases together), then the unlisted."""
    cmp = compare(gloo, ccl, known_for(ccl.world_size, ccl.transport))
    rows = [f"Cases that pass on gloo but not on {label(ccl)} (or skip differently), world size {cmp.world_size}: "
            f"{len(cmp.differences)}, {len(cmp.unexpected)} of them not in known_issues.py.", "",
            "| category | issue | cases | ccl outcome | ccl error (first lines, first case) |", "|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list] = {}
    for d in cmp.differences:
        key = (d.known.category, d.known.reason) if d.known else ("**unlisted**", d.name)
        groups.setdefault(key, []).append(d)
    for (category, reason), diffs in groups.items():
        names = ", ".join(f"`{d.name}`" for d in diffs)
        outcomes = "/".join(sorted({d.ccl_outcome for d in diffs}))
        rows.append(f"| {category} | {_cell(reason)} | {len(diffs)}: {names} | {outcomes} | {_cell(excerpt(diffs[0].ccl))} |")
    if cmp.fixed:
        rows += ["", "Listed in known_issues.py but as good as gloo now: "
                 + ", ".join(f"`{d.name}`" for d in cmp.fixed)]
    if cmp.both_failed:
        rows += ["", "Failing on gloo too (not about ccl):", ""]
        rows += [f"- `{n}`: gloo: {_cell(excerpt(gloo.cases[n]))[:300]}; ccl: {_cell(excerpt(ccl.cases[n]))[:300]}"
                 for n in cmp.both_failed]
    if cmp.ccl_only_passed:
        rows += ["", "Passing on ccl only: " + ", ".join(f"`{n}`" for n in cmp.ccl_only_passed)]
    return "\n".join(rows)


def render(dirs: list[Path]) -> str:
    runs = load_runs(dirs)
    out = ["## Outcomes", "", counts_table(runs)]
    for world in sorted({w for _, w in runs}):
        for name in ("ccl", "ccl-oneccl"):
            if ("gloo", world) in runs and (name, world) in runs:
                out += ["", f"## World size {world}, {name}", "",
                        differences_table(runs[("gloo", world)], runs[(name, world)])]
    return "\n".join(out) + "\n"
