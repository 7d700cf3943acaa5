"""PyTorch's own distributed test suite (DistributedTest._DistTestBase) on ccl, with gloo as the baseline.

tests/pytorch_suite/ runs torch's suite for one backend as torch's CI does
(each case on WORLD_SIZE real rank processes); see its __init__.py. Here:

- without spawning anything, that ccl meets the same gates as gloo (no case
  is skipped because of the backend's name) and that known_issues.py names
  real cases;
- the suite on ccl, plan by plan (selection.py), where every case that does
  not pass on ccl and is not in known_issues.py is run on gloo too: it fails
  the test whether gloo passes it (a regression) or not (the harness or the
  machine is at fault); so does a listed case that now passes on ccl.

By default the ci-ws2 and ci-ws3 plans run (selection.py), and oneccl-ws2 on the
oneCCL path; the whole suite at world sizes 2 and 3, and the smoke plan, with --runslow.
"""

import dataclasses
import functools
import json
import re
import types

import pytest

from pytorch_suite import known_issues, loader
from pytorch_suite.check import check_plan, judge
from pytorch_suite.compare import compare
from pytorch_suite.report import render
from pytorch_suite.runner import FAILED, PASSED, SKIPPED, CaseResult, SuiteRun, inventory
from pytorch_suite.selection import PLANS, TRANSPORT_ENV


GATES = """
BACKEND = "ccl"
class Backend:
    GLOO = "gloo"
def require_backend_is_available(names):
    return sorted(names)
admitted = [
    BACKEND == "gloo", "gloo" == BACKEND, BACKEND != "gloo",
    BACKEND in {"gloo", "nccl"}, BACKEND not in ("gloo",),
    os.environ["BACKEND"] == "gloo",
]
required = require_backend_is_available({"gloo"})
profiled = [Backend.GLOO, "mpi"]
untouched = [{"backend_name": "ccl"}.get("backend_name") == "gloo", dict(backend="gloo")["backend"]]
def hook(bucket: Backend): pass
"""


def test_loader_rewrites_name_gates_only():
    namespace = {"os": types.SimpleNamespace(environ={"BACKEND": "ccl"})}
    code, rewrites = loader._transform(GATES, "<gates>")
    exec(code, namespace)
    assert namespace["admitted"] == [True, True, False, True, False, True]
    assert namespace["required"] == ["ccl", "gloo"]
    assert namespace["profiled"] == ["gloo", "mpi", "ccl"]
    assert namespace["untouched"] == [False, "gloo"]
    # Annotations stay objects (DDP compares a comm hook's annotation with dist.GradBucket).
    assert namespace["hook"].__annotations__["bucket"] is namespace["Backend"]
    assert [r.kind for r in rewrites] == ["compare"] * 6 + ["call", "list"]


def _run(backend, **outcomes):
    cases = {name: CaseResult(name, outcome, 1.0, "boom" if outcome == FAILED else "") for name, outcome in outcomes.items()}
    return SuiteRun(backend, 2, cases, 1.0, 0, "")


def test_compare_flags_regressions_fixes_and_broken_baselines():
    known = {name: known_issues.Known(known_issues.BUG, "listed") for name in ("test_listed", "test_fixed")}
    gloo = _run("gloo", test_regressed=PASSED, test_listed=PASSED, test_broken=FAILED, test_gpu=SKIPPED)
    ccl = _run("ccl", test_regressed=FAILED, test_listed=FAILED, test_fixed=PASSED, test_broken=FAILED,
               test_gpu=SKIPPED, test_fine=PASSED)
    cmp = compare(gloo, ccl, known)
    assert [d.name for d in cmp.unexpected] == ["test_regressed"]
    assert [d.name for d in cmp.differences] == ["test_listed", "test_regressed"]
    assert [d.name for d in cmp.fixed] == ["test_fixed"]
    assert cmp.both_failed == ["test_broken"]


@functools.lru_cache(maxsize=None)
def _inventory(backend, world):
    return inventory(backend, world)


def _unnamed(reason):
    return reason and re.sub(r"\b(gloo|ccl)\b", "<backend>", reason)


@pytest.mark.timeout(1500)  # two inventories, up to 600 s each
@pytest.mark.parametrize("world", [2, 3])
def test_ccl_meets_the_gates_gloo_meets(world):
    gloo, ccl = _inventory("gloo", world), _inventory("ccl", world)
    assert gloo["cases"].keys() == ccl["cases"].keys()
    differ = {
        name: (gloo["cases"][name], ccl["cases"][name])
        for name in gloo["cases"]
        if _unnamed(gloo["cases"][name]) != _unnamed(ccl["cases"][name])
    }
    assert not differ, f"skipped before spawning on one backend only (gloo reason, ccl reason): {differ}"
    # Every kind of gate loader.py opens is still found: if a torch release drops one,
    # check what replaced it rather than losing cases silently.
    assert {r["kind"] for r in ccl["rewrites"]} == {"compare", "call", "list"}, ccl["rewrites"]
    runs = [name for name, reason in ccl["cases"].items() if reason is None]
    assert len(runs) > 50, f"only {len(runs)} cases would spawn ranks"


def test_known_issues_name_real_cases():
    cases = _inventory("ccl", 2)["cases"].keys()
    for plan in PLANS.values():
        assert not set(plan.cases or ()) - cases, f"plan {plan.name} selects unknown cases"
    assert not known_issues.KNOWN.keys() - cases, "known_issues.py lists cases the suite does not have"
    for name, known in known_issues.KNOWN.items():
        assert known.category in (known_issues.BUG, known_issues.GLOO, known_issues.GATE), name
        assert known.reason, name
        assert known.transports and set(known.transports) <= set(TRANSPORT_ENV), name


def test_default_plans_run_a_listed_case():
    # check_plan fails on a listed case that now passes only where a plan runs it: each
    # plan CI runs keeps one, so that the check can fire there.
    for plan in PLANS.values():
        if plan.quick:
            listed = [name for name in plan.cases if name in known_issues.known_for(plan.world_size, plan.transport)]
            assert listed, f"plan {plan.name} runs no case of known_issues.py"


def _plan_params():
    for plan in PLANS.values():
        # Both backends' runs, each bounded by the plan's timeout.
        marks = [pytest.mark.timeout(2 * plan.timeout + 600)] + ([] if plan.quick else [pytest.mark.slow])
        yield pytest.param(plan.name, marks=marks, id=plan.name)


@pytest.mark.parametrize("plan_name", list(_plan_params()))
def test_ccl_matches_gloo(plan_name):
    problems = check_plan(PLANS[plan_name])
    assert not problems, f"{len(problems)} problem(s) in plan {plan_name}:\n" + "\n".join(problems)


def test_a_plan_fails_when_too_few_cases_pass():
    # Skipped on both backends compares equal: only the plan's minimum catches a run in
    # which (nearly) nothing ran.
    plan = PLANS["smoke"]
    skipped = _run("ccl", **{name: SKIPPED for name in plan.cases})
    problems = judge(plan, skipped, _run("gloo", **{name: SKIPPED for name in plan.cases}))
    assert len(problems) == 1 and "passed on ccl" in problems[0], problems
    assert judge(plan, _run("ccl", **{name: PASSED for name in plan.cases}), None) == []


def test_the_report_judges_a_whole_run_by_its_transports_known_issues(tmp_path):
    # `run --transport oneccl` saves ccl-oneccl-ws2.json beside the shared-memory run; the report
    # compares each with gloo, with its own transport's list.
    gloo = _run("gloo", test_send_recv_any_source=PASSED)
    gloo.save(tmp_path / "gloo-ws2.json")
    _run("ccl", test_send_recv_any_source=FAILED).save(tmp_path / "ccl-ws2.json")
    on_oneccl = dataclasses.replace(_run("ccl", test_send_recv_any_source=FAILED), transport="oneccl")
    on_oneccl.save(tmp_path / "ccl-oneccl-ws2.json")
    text = render([tmp_path])
    shm, oneccl = text.split("## World size 2, ccl-oneccl")
    assert "## World size 2, ccl\n" in shm and "1 of them not in known_issues.py" in shm and "**unlisted**" in shm, text
    assert "0 of them not in known_issues.py" in oneccl and "**unlisted**" not in oneccl, text
    # A run saved before runs recorded their transport was on shared memory.
    data = json.loads((tmp_path / "ccl-ws2.json").read_text())
    del data["transport"]
    (tmp_path / "ccl-ws2.json").write_text(json.dumps(data))
    assert SuiteRun.load(tmp_path / "ccl-ws2.json").transport == "shm"


def test_a_plan_is_judged_by_its_transports_known_issues():
    # The receive from any source is listed for the oneCCL path only: failing there is
    # expected; on shared memory, where gloo passes it, it is a regression.
    passing = {name: PASSED for name in PLANS["oneccl-ws2"].cases if name != "test_send_recv_any_source"}
    ccl = _run("ccl", test_send_recv_any_source=FAILED, **passing)
    gloo = _run("gloo", test_send_recv_any_source=PASSED)
    assert judge(PLANS["oneccl-ws2"], ccl, gloo) == []
    shm_twin = dataclasses.replace(PLANS["oneccl-ws2"], name="shm-twin", transport="shm")
    problems = judge(shm_twin, ccl, gloo)
    assert len(problems) == 1 and problems[0].startswith("test_send_recv_any_source: gloo passed, ccl failed"), problems
    # Passing it on the oneCCL path would mean the plan ran on shared memory: flagged as fixed.
    fixed = judge(PLANS["oneccl-ws2"], _run("ccl", test_send_recv_any_source=PASSED, **passing), None)
    assert len(fixed) == 1 and "now does as well as gloo" in fixed[0], fixed
    assert TRANSPORT_ENV["oneccl"] == {"ONECCL_BIND_PT_SHM": "0"} and TRANSPORT_ENV["shm"] == {"ONECCL_BIND_PT_SHM": "1"}
