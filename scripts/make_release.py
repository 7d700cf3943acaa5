#!/usr/bin/env python3
"""A release from its row in meta/releases.yaml: regenerate, build, prove, say what to publish.

    $EDITOR meta/releases.yaml                       # the one edit: append the new torch's entry
    python scripts/make_release.py --torch 2.16.0    # the one command

Steps, each stopping the command on failure:
1. scripts/gen_release_files.py: the release table, requirements, environments, conda
   variants and README's tables follow from the new row.
2. scripts/build_wheels.py: the release's sdist and one manylinux wheel per Python of its row
   (auditwheel repair, twine check --strict).
3. scripts/check_wheel.py: each wheel installed into a fresh venv of its Python with only its
   torch and no compiler, examples/ddp.py trained under torchrun and mpirun to the checksum
   one process computes (and, on torch >= 2.14, a script that never imports the package).
4. The proof subset of tests/ (--subset, default `release`: the package checks, the c10d API
   the release added, the op x dtype matrix on both transports, async, errors, abort/shrink,
   FSDP and PyTorch's own suite's smoke plan) against the installed wheel of the first Python.
5. Prints the artifacts to publish and the commands that publish them.

--python narrows steps 2-4 to some Pythons (CI's proof of this path does one). docs/releasing.md
has the whole procedure.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import releases  # this folder's: run as a script, or imported with it on sys.path (the tests)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"

# What step 4 runs against an installed wheel, by name (tests/test_other_releases.py uses the
# same lists for the pairs meta/releases.yaml's `ci` names). A release's C++ differs from the
# others in src/compat.hpp only, so what `release` leaves out (3 and 4 ranks, more launchers,
# integrations) runs the same code.
SUBSETS = {
    "release": [
        "tests/test_package.py",
        "tests/test_release_api.py",
        # The matrix at 2 ranks on both transports, and every kernel and copy path the CPU runs.
        # The helper threads (their count, their splits) and oneCCL's worker threads carrying the
        # matrix are the package's own threads and environment, no torch API: at home only.
        "tests/test_matrix.py", "-k", "not test_case or 2-shm or 2-oneccl",
        *(arg for name in ("test_helper_threads_split_large_messages_exactly",
                           "test_default_helpers_leave_the_cores_compute_uses",
                           "test_helper_count_follows_the_cores_a_rank_has",
                           "test_an_unknown_helper_count_fails_the_group_with_its_name",
                           "test_oneccl_worker_threads_carry_collectives_exactly")
          for arg in ("--deselect", f"tests/test_matrix.py::{name}")),
        # Async and errors where the release's Work, Future and exception APIs meet ours (every
        # form of async op, wait timeouts, constructing the backend, the deprecated names, errors
        # of gloo's kind, timeouts, the survivor's teardown on both transports); what is the same
        # C++ with more ranks or groups (two groups interleaved, subgroups, 3-rank bad input),
        # and the async and timeout cases on oneCCL (the same Work either way), runs at home only.
        *(f"tests/test_async.py::{name}[shm]" for name in (
            "test_async_forms", "test_wait_timeout_raises_then_op_completes", "test_construct_backend_directly",
            "test_deprecated_collective_names")),
        *(f"tests/test_errors.py::{name}" for name in (
            "test_errors_are_the_kind_gloo_raises", "test_bad_input_raises_and_group_survives[2]",
            "test_group_timeout_raises_instead_of_hanging[shm]", "test_barrier_times_out_like_gloo[ccl-shm]",
            "test_barrier_times_out_like_gloo[ccl-oneccl]", "test_survivor_destroys_its_group_after_rank_0_exited")),
        # p2p on both transports (tags, any-source receive, batched isend/irecv); the oneCCL
        # path's send order and queued ops (P2pTurn) are the same C++ on every release: at home.
        "tests/test_p2p.py",
        "--deselect", "tests/test_p2p.py::test_oneccl_path_keeps_send_order_with_several_in_flight",
        "--deselect", "tests/test_p2p.py::test_oneccl_path_fails_a_queued_recv_once_the_group_broke",
        # A group built directly, as torch-ccl's own test file builds it.
        "tests/test_torch_ccl_compat.py",
        # abort and shrink go through the release's own entry points (Backend.abort, shrink_group);
        # the shrink example on one transport: how oneCCL learns of the death (its group timeout)
        # is the same C++ on every release, and runs at home.
        *(f"tests/test_abort_shrink.py::{name}" for name in (
            "test_abort_fails_the_ops_in_flight_and_a_new_group_works",
            "test_a_peer_told_of_an_abort_finds_the_abandoned_op_recorded",
            "test_shrink_example_trains_on_after_a_rank_is_killed[shm]")),
        # DDP under torchrun and mpirun against one process is check_wheel's (step 3), not repeated here.
        "tests/test_examples.py::test_fsdp_example_trains_like_one_process_on_the_whole_batch",
        # PyTorch's own suite, its smoke plan (6 cases against gloo; marked slow at home).
        "tests/test_pytorch_suite.py::test_ccl_matches_gloo[smoke]", "--runslow",
    ],
    # The package checks (import, the version guards, the doctor's self-test on both transports),
    # what the release's c10d API added or changed (compat.hpp's branches: test_release_api.py)
    # and PyTorch's own suite's smoke plan: where the release's API meets ours.
    "api": [
        "tests/test_package.py",
        "tests/test_release_api.py",
        "tests/test_pytorch_suite.py::test_ccl_matches_gloo[smoke]", "--runslow",
    ],
    # check_wheel's DDP under two launchers is the whole proof.
    "none": [],
}


def say(msg: str) -> None:
    print(f"[make_release {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def clean_env() -> dict:
    # The inner runs import their own venv's packages, never the caller's.
    return {k: v for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("PYTEST_")}


def step(cmd, timeout: float = 3600, cwd: Path = ROOT, env: dict | None = None) -> str:
    """Runs one step in its own session (a timeout ends its ranks too); its output, or exits."""
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        sys.exit(f"{' '.join(map(str, cmd))} did not finish within {timeout:.0f} s:\n{out[-6000:]}")
    if proc.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{out[-6000:]}")
    return out


def subset_pins(meta: dict, torch: str) -> list[str]:
    """What a subset needs beside the wheel: the release's oneCCL (the build checks), auditwheel
    (the symbol-version check) and the build, test and bench groups. oneccl-cpu-devel has the
    same headers and CPU archive as oneccl-devel without its SYCL runtime (1.5 GB less per venv)."""
    rel = next(r for r in meta["releases"] if r["torch"] == torch)
    auditwheel = [pin for pin in meta["pip"]["release"]["pins"] if pin.startswith("auditwheel==")]
    return [f"oneccl-cpu-devel=={rel['oneccl']}", *auditwheel,
            *(pin for group in ("build", "test", "bench") for pin in meta["pip"][group]["pins"])]


def prove_subset(venv: Path, meta: dict, torch: str, name: str, root: Path = ROOT, timeout: float = 3600,
                 env: dict | None = None) -> str:
    """Runs SUBSETS[name] of root's tests/ with venv's pytest against the wheel installed there.
    env: the install's environment (by default clean_env())."""
    if not SUBSETS[name]:
        return ""
    install, install_env = releases.install_command(venv / "bin" / "python", env or clean_env(), compile=True)
    step([*install, *subset_pins(meta, torch)], timeout=1800, cwd=root, env=install_env)
    return step([venv / "bin" / "pytest", "-q", "-p", "no:cacheprovider", *SUBSETS[name]], timeout=timeout, cwd=root)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch", required=True, metavar="VERSION", help="the release: its row's torch in meta/releases.yaml")
    ap.add_argument("--python", action="append", metavar="X.Y", help="only these of its Pythons (repeatable)")
    ap.add_argument("--subset", choices=sorted(SUBSETS), default="release",
                    help="what of tests/ runs against the first Python's wheel (default: %(default)s)")
    ap.add_argument("--dist", type=Path, default=ROOT / "dist", help="the artifacts (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "release",
                    help="build venvs, and the proof venvs while they are used (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the proof venvs (check_wheel's)")
    ap.add_argument("--prune", action="store_true", help="remove the build venvs once the wheels are built")
    args = ap.parse_args()
    start = time.monotonic()
    dist, work = args.dist.resolve(), args.work.resolve()

    step([sys.executable, SCRIPTS / "gen_release_files.py"], timeout=300)
    table = runpy.run_path(str(ROOT / "oneccl_bind_pt" / "_version.py"))
    row = table["release_for"](args.torch)
    if row is None or row["torch"] != args.torch:
        have = ", ".join(r["torch"] for r in table["RELEASES"].values())
        sys.exit(f"meta/releases.yaml has no release torch {args.torch} (it has {have}): append its entry first")
    pythons = args.python or row["python"]
    missing = [p for p in pythons if p not in row["python"]]
    if missing:
        sys.exit(f"torch {args.torch}'s row lists Pythons {', '.join(row['python'])}, not {', '.join(missing)}")
    say(f"release files regenerated for oneccl_bind_pt {row['version']} (torch {args.torch}, Python {', '.join(pythons)})")

    select = ["--torch", args.torch, *(a for p in pythons for a in ("--python", p))]
    out = step([sys.executable, SCRIPTS / "build_wheels.py", *select, "--dist", dist, "--work", work,
                *(["--prune"] if args.prune else [])])
    print(out, end="", flush=True)
    out = step([sys.executable, SCRIPTS / "check_wheel.py", *select, "--dist", dist, "--work", work / "check",
                "--keep"])
    print(out, end="", flush=True)
    venvs = [work / "check" / f"venv-torch{args.torch}-py{p}" for p in pythons]
    try:
        if SUBSETS[args.subset]:
            import yaml  # the release tools' venv has it (the test group)

            meta = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
            t = time.monotonic()
            out = prove_subset(venvs[0], meta, args.torch, args.subset)
            say(f"subset {args.subset} on Python {pythons[0]}: {out.strip().splitlines()[-1]} "
                f"({time.monotonic() - t:.0f} s)")
    finally:
        if not args.keep:
            for venv in venvs:
                shutil.rmtree(venv, ignore_errors=True)

    tag = {p: f"cp{p.replace('.', '')}" for p in pythons}
    artifacts = [dist / f"oneccl_bind_pt-{row['version']}.tar.gz"] + [
        w for p in pythons for w in sorted(dist.glob(f"oneccl_bind_pt-{row['version']}-{tag[p]}-{tag[p]}-manylinux_*.whl"))]
    say(f"oneccl_bind_pt {row['version']} built and proven in {time.monotonic() - start:.0f} s. Publish:")
    for a in artifacts:
        print(f"  {a}")
    print(f"  pip:   python -m twine upload {' '.join(str(a) for a in artifacts)}")
    print(f"  conda: the recipe's variants for torch {args.torch} (recipe/conda_build_config.yaml), built as "
          "recipe/README.md says")
    print(f"  git:   commit meta/releases.yaml and the files step 1 wrote, tag v{row['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
