"""Command line: run the suite for some backends and world sizes, and compare them.

    cd tests && ../.venv/bin/python -m pytorch_suite run --backend gloo ccl --world-size 2 --out DIR
    cd tests && ../.venv/bin/python -m pytorch_suite run --backend ccl --transport oneccl --out DIR
    cd tests && ../.venv/bin/python -m pytorch_suite report DIR [--markdown FILE]
    cd tests && ../.venv/bin/python -m pytorch_suite check --plan smoke

`run` writes DIR/<backend>-ws<N>.json (every case's outcome; ccl on the oneCCL path:
ccl-oneccl-ws<N>.json), .xml (JUnit) and .log (pytest's output); `report` compares each
ccl run with the gloo run of the same world size, applying the known exceptions of the
transport the ccl run used (known_issues.py). `check`
runs a plan of selection.py under the rule tests/test_pytorch_suite.py applies
(check.py) and exits 1 on any problem.
"""

import argparse
import sys
from pathlib import Path

from pytorch_suite.runner import DEFAULT_CASE_TIMEOUT, run_suite
from pytorch_suite.selection import PLANS, TRANSPORT_ENV


def _run(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for world in args.world_size:
        for backend in args.backend:
            # The transport pins ONECCL_BIND_PT_SHM either way (a caller's variable cannot move a
            # run); gloo ignores it.
            on_oneccl = backend == "ccl" and args.transport == "oneccl"
            stem = out / f"{backend}{'-oneccl' if on_oneccl else ''}-ws{world}"
            run = run_suite(backend, world, select=args.case or None, case_timeout=args.case_timeout,
                            init_method=args.init_method, start=args.start, junit_xml=stem.with_suffix(".xml"),
                            log=stem.with_suffix(".log"), env=TRANSPORT_ENV[args.transport])
            run.transport = args.transport
            run.save(stem.with_suffix(".json"))
            print(f"{stem.name} world size {world}: {run.counts()} in {run.wall_seconds:.0f} s"
                  + ("" if run.complete else f" (incomplete, pytest exit {run.returncode})"), flush=True)
    return 0


def _check(args) -> int:
    from pytorch_suite.check import check_plan
    from pytorch_suite.selection import PLANS

    plan = PLANS[args.plan]
    problems = check_plan(plan)
    for problem in problems:
        print(problem)
    print(f"plan {plan.name}: {len(problems)} problem(s)")
    return 1 if problems else 0


def _report(args) -> int:
    from pytorch_suite.report import render

    text = render([Path(d) for d in args.dirs])
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pytorch_suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the suite")
    run.add_argument("--backend", nargs="+", default=["gloo", "ccl"], choices=["gloo", "ccl"])
    run.add_argument("--world-size", nargs="+", type=int, default=[2])
    run.add_argument("--case", nargs="*", help="only these cases (test_... names)")
    run.add_argument("--case-timeout", type=int, default=DEFAULT_CASE_TIMEOUT)
    run.add_argument("--init-method", choices=["file", "env"], default="file")
    run.add_argument("--start", choices=["spawn", "fork"], default="spawn",
                     help="how a case starts its ranks (spawn: as torch's CI)")
    run.add_argument("--transport", choices=sorted(TRANSPORT_ENV), default="shm",
                     help="where ccl's data goes: shm (the package's shared memory, its default on one host) "
                          "or oneccl (ONECCL_BIND_PT_SHM=0)")
    run.add_argument("--out", required=True)
    run.set_defaults(fn=_run)
    check = sub.add_parser("check", help="run a plan of selection.py; exit 1 on a problem")
    check.add_argument("--plan", required=True, choices=sorted(PLANS))
    check.set_defaults(fn=_check)
    report = sub.add_parser("report", help="compare ccl with gloo")
    report.add_argument("dirs", nargs="+")
    report.add_argument("--markdown")
    report.set_defaults(fn=_report)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
