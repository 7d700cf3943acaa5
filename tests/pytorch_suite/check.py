"""The pass/fail rule for a plan: ccl does as well as gloo, except for known_issues.py.

Used by tests/test_pytorch_suite.py and by `python -m pytorch_suite check`, so
an environment with another torch release applies the same rule.
"""

from __future__ import annotations

from pytorch_suite import known_issues
from pytorch_suite.compare import compare, excerpt
from pytorch_suite.runner import PASSED, SuiteRun, run_suite
from pytorch_suite.selection import TRANSPORT_ENV, Plan


def check_plan(plan: Plan) -> list[str]:
    """Runs `plan` on ccl and returns its problems (none: the plan passes).

    gloo only runs the cases ccl did not pass and known_issues.py does not
    explain (normally none, so the baseline costs nothing). A problem is: such
    a case passing on gloo (a regression); failing on gloo too (the harness or
    the machine is at fault); a listed case that ccl now passes (remove the
    entry, so the list stays true); a run that stopped early.
    """
    ccl = run_suite("ccl", plan.world_size, select=plan.cases, timeout=plan.timeout, case_timeout=plan.case_timeout,
                    start=plan.start, env=TRANSPORT_ENV[plan.transport])
    known = known_issues.known_for(plan.world_size, plan.transport)
    again = sorted(name for name, case in ccl.cases.items() if case.outcome != PASSED and name not in known)
    gloo = (run_suite("gloo", plan.world_size, select=again, timeout=plan.timeout, case_timeout=plan.case_timeout,
                      start=plan.start)
            if again else None)
    return judge(plan, ccl, gloo)


def judge(plan: Plan, ccl: SuiteRun, gloo: SuiteRun | None) -> list[str]:
    """check_plan's verdict on its runs (gloo: the cases rerun there, or None)."""
    cmp = compare(gloo or SuiteRun("gloo", ccl.world_size, {}, 0.0, 0, ""), ccl,
                  known_issues.known_for(plan.world_size, plan.transport))
    problems = []
    passed = ccl.counts()[PASSED]
    if passed < plan.min_passed:
        problems.append(f"only {passed} case(s) passed on ccl, fewer than the plan's minimum of {plan.min_passed}: "
                        f"{ccl.counts()}")
    if not ccl.complete:
        problems.append(f"the ccl run stopped early (pytest exit {ccl.returncode})")
    problems += [f"{d.name}: gloo {d.gloo_outcome}, ccl {d.ccl_outcome}: {excerpt(d.ccl)}" for d in cmp.unexpected]
    problems += [f"{d.name}: listed in known_issues.py ({d.known.category}) but ccl now does as well as gloo: "
                 "remove the entry" for d in cmp.fixed]
    problems += [f"{name}: fails on gloo too, so the harness or this machine is at fault: "
                 f"{excerpt(gloo.cases[name])}" for name in cmp.both_failed]
    return problems
