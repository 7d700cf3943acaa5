"""Compares a ccl run of the suite with the gloo run of the same cases."""

from __future__ import annotations

import dataclasses
import re

from pytorch_suite.known_issues import Known, known_for
from pytorch_suite.runner import FAILED, PASSED, SKIPPED, CaseResult, SuiteRun

NOT_RUN = "not run"


@dataclasses.dataclass
class Difference:
    name: str
    gloo: CaseResult | None
    ccl: CaseResult | None
    known: Known | None

    @property
    def ccl_outcome(self) -> str:
        if self.ccl is None:
            return NOT_RUN
        return "hang" if self.ccl.timed_out else self.ccl.outcome

    @property
    def gloo_outcome(self) -> str:
        if self.gloo is None:
            return NOT_RUN
        return "hang" if self.gloo.timed_out else self.gloo.outcome


@dataclasses.dataclass
class Comparison:
    world_size: int
    differences: list[Difference]  # ccl did worse than gloo, skipped differently, or has no baseline
    fixed: list[Difference]  # listed in KNOWN but as good as gloo now
    both_failed: list[str]  # failing on gloo too: the harness or the machine, not ccl
    ccl_only_passed: list[str]  # ccl passed where gloo did not

    @property
    def unexpected(self) -> list[Difference]:
        return [d for d in self.differences if d.known is None]


def compare(gloo: SuiteRun, ccl: SuiteRun, known: dict[str, Known] | None = None) -> Comparison:
    """gloo may hold only the cases ccl did not pass: a case ccl passed needs no baseline.
    known: the entries that apply (default: those of the shared-memory transport, where a run
    of the suite goes unless ONECCL_BIND_PT_SHM=0; a plan on the oneCCL path passes its own)."""
    assert gloo.world_size == ccl.world_size, (gloo.world_size, ccl.world_size)
    world = gloo.world_size
    if known is None:
        known = known_for(world, "shm")
    result = Comparison(world, [], [], [], [])
    for name in sorted(gloo.cases.keys() | ccl.cases.keys()):
        g, c = gloo.cases.get(name), ccl.cases.get(name)
        k = known.get(name)
        if k is not None and world not in k.world_sizes:
            k = None
        if _differs(g, c):
            result.differences.append(Difference(name, g, c, k))
        elif k is not None:
            result.fixed.append(Difference(name, g, c, k))
        if g is not None and c is not None:
            if g.outcome == FAILED and c.outcome == FAILED:
                result.both_failed.append(name)
            elif c.outcome == PASSED and g.outcome != PASSED:
                result.ccl_only_passed.append(name)
    return result


def _differs(g: CaseResult | None, c: CaseResult | None) -> bool:
    """Whether ccl did worse than gloo on a case, or skipped it for another reason."""
    if c is None:
        return g is not None  # the ccl run stopped before this case
    if c.outcome == PASSED:
        return False
    if g is None:
        return True  # no baseline to excuse it
    if g.outcome == PASSED:
        return True
    if g.outcome == SKIPPED:
        return c.outcome == FAILED or _reason(g) != _reason(c)
    return c.outcome == SKIPPED  # gloo failed: ccl failing too is no news, skipping it is


def _reason(case: CaseResult) -> str:
    # Skip messages name the backend ("ccl does not support ..."): compare them without it.
    return re.sub(r"\b(gloo|ccl|GLOO|CCL)\b", "<backend>", case.message)


def excerpt(case: CaseResult | None, max_chars: int = 600) -> str:
    """The first meaningful lines of a failure: the exception each failing rank raised."""
    if case is None:
        return "not reported (the run stopped before this case)"
    if case.outcome == SKIPPED:
        return f"skipped: {case.message}"
    if case.outcome == PASSED:
        return "passed"
    text = case.details or case.message
    if case.timed_out:
        m = re.search(r"terminated or timed out after ([\d.]+) seconds", text)
        return f"timed out after {float(m.group(1)):.0f} s (ranks killed)" if m else case.message.splitlines()[0]
    found = []
    for block in re.split(r"Process \d+ exited with error code \d+ and exception:", text)[1:] or [text]:
        found.append(_final_exception(block))
    found = [f for f in dict.fromkeys(found) if f]  # ranks often raise the same thing
    return (" / ".join(found) or text.strip().splitlines()[-1])[:max_chars]


_STOP = ("To execute this test", "Exception raised from", "This message can be suppressed")


def _final_exception(traceback_text: str) -> str:
    """The exception a traceback ends with, on one line."""
    lines = [ln[1:].strip() if ln.startswith("E ") else ln.strip() for ln in traceback_text.splitlines()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith('File "')]
    i = frames[-1] + 2 if frames else 0
    while i < len(lines) and (not lines[i] or set(lines[i]) <= set("^~ ")):
        i += 1
    out = []
    for ln in lines[i:]:
        if ln.startswith(_STOP) or re.match(r"^[\w/.-]+\.py:\d+: \w+$", ln):
            break
        if ln:
            out.append(ln)
    return " ".join(out)
