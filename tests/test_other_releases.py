"""The (torch, Python) pairs CI proves beside the default pair, inside the README's test command.

The rest of tests/ runs on the default pair (the venv running this file). meta/releases.yaml
lists under `ci` one pair per non-default Python and per other release. For each, the way a
release is made and installed:

1. scripts/build_wheels.py builds its wheel (from the release's sdist where the pair says
   from_sdist), auditwheel grants and repairs the manylinux tag, twine check passes. Build
   venvs and objects are kept under build/release/ between runs, never shared between pairs.
2. scripts/check_wheel.py installs that wheel into a fresh venv of the pair's Python that
   holds only its torch, with no compiler, and trains examples/ddp.py under torchrun and
   mpirun to the checksum one process computes (scripts/ddp_reference.py); on torch >= 2.14
   a script that never imports the package trains on "ccl" (the entry point).
3. That venv then gets the release's test pins, and its pytest runs SUBSET against the
   installed wheel: the package and build checks, the c10d API the release added, the op x
   dtype matrix on 2 ranks through both transports, async and errors where the release's
   APIs meet ours, FSDP training and the smoke plan of PyTorch's distributed suite (DDP
   under torchrun and mpirun was step 2's). A release's C++ API differs in src/compat.hpp
   only, so what the subset leaves out (3 and 4 ranks, more launchers, integrations) runs
   the same code. A pair on the default release's torch (another
   Python) runs SAME_RELEASE_SUBSET.

A clean machine downloads each pair's torch once (PyPI's torch for these Pythons is a CUDA
build: about 5.5 GB installed each); the pip cache serves later runs. Each pair's fresh venv
is removed after its tests, so the run needs one at a time; the build venvs (about 1.4 GB
each) stay for the next run.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import run_job
from test_conda import conda_proof

ROOT = Path(__file__).resolve().parent.parent
META = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
PAIRS = META["ci"]
WORK = ROOT / "build" / "release"

SUBSET = [
    "tests/test_package.py",
    "tests/test_release_api.py",
    "tests/test_matrix.py", "-k", "not test_case or 2-shm or 2-oneccl",
    # Async and errors where the release's Work, Future and exception APIs meet ours (every
    # form of async op, wait timeouts, constructing the backend, the deprecated names, errors
    # of gloo's kind, timeouts, the survivor's teardown on both transports); what is the same
    # C++ with more ranks or groups (two groups interleaved, subgroups, 3-rank bad input)
    # runs at home only.
    *(f"tests/test_async.py::{name}" for name in (
        "test_async_forms", "test_wait_timeout_raises_then_op_completes", "test_construct_backend_directly",
        "test_deprecated_collective_names")),
    *(f"tests/test_errors.py::{name}" for name in (
        "test_errors_are_the_kind_gloo_raises", "test_bad_input_raises_and_group_survives[2]",
        "test_group_timeout_raises_instead_of_hanging", "test_barrier_times_out_like_gloo[ccl-shm]",
        "test_barrier_times_out_like_gloo[ccl-oneccl]", "test_survivor_destroys_its_group_after_rank_0_exited")),
    # abort and shrink go through the release's own entry points (Backend.abort, shrink_group);
    # the shrink example on one transport: how oneCCL learns of the death (its group timeout)
    # is the same C++ on every release, and runs at home.
    *(f"tests/test_abort_shrink.py::{name}" for name in (
        "test_abort_fails_the_ops_in_flight_and_a_new_group_works",
        "test_a_peer_told_of_an_abort_finds_the_abandoned_op_recorded",
        "test_shrink_example_trains_on_after_a_rank_is_killed[shm]")),
    # DDP under torchrun and mpirun against one process is check_wheel's (step 2), not repeated here.
    "tests/test_examples.py::test_fsdp_example_trains_like_one_process_on_the_whole_batch",
    # PyTorch's own suite, its smoke plan (6 cases against gloo; marked slow at home).
    "tests/test_pytorch_suite.py::test_ccl_matches_gloo[smoke]", "--runslow",
]


# A pair on the default release's torch differs from the main run only in its interpreter
# (the same C++ against the same torch headers): the package checks (import, the doctor's
# self-test on both transports, the version guards) and what crosses between Python and the
# extension (async forms and futures, the exception classes), against its installed wheel;
# DDP is check_wheel's.
SAME_RELEASE_SUBSET = [
    "tests/test_package.py",
    "tests/test_async.py::test_async_forms",
    "tests/test_errors.py::test_errors_are_the_kind_gloo_raises",
]


def _clean_env():
    # The inner runs must import their own venv's packages, not this one's.
    return {k: v for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("PYTEST_")}


def _run(cmd, timeout):
    # Its own session: a timeout kills the inner run's ranks too, not only its pytest.
    return run_job(cmd, cwd=ROOT, env=_clean_env(), timeout=timeout)


def _subset_pins(torch):
    """What SUBSET needs beside the wheel: the release's oneCCL (the build checks), auditwheel and
    the build, test and bench groups (the default release's set also holds integrations, which
    need a newer Python than some pairs)."""
    rel = next(r for r in META["releases"] if r["torch"] == torch)
    # auditwheel: test_package checks the installed extension's symbol versions with it.
    auditwheel = [pin for pin in META["pip"]["release"]["pins"] if pin.startswith("auditwheel==")]
    return [f"oneccl-devel=={rel['oneccl']}", *auditwheel, *(pin for group in ("build", "test", "bench")
                                                             for pin in META["pip"][group]["pins"])]


def _id(pair):
    return f"torch{pair['torch']}-py{pair['python']}"


@pytest.fixture(scope="module", params=PAIRS, ids=_id)
def proven(request, tmp_path_factory):
    """The pair's wheel built, proven in a fresh venv (kept), that venv given the test pins."""
    pair = request.param
    dist = tmp_path_factory.mktemp("dist")
    select = ["--torch", pair["torch"], "--python", pair["python"]]
    start = time.monotonic()
    built = _run([sys.executable, "scripts/build_wheels.py", *select, "--dist", dist, "--work", WORK,
                  *(["--from-sdist"] if pair["from_sdist"] else [])], timeout=3600)
    build_s = time.monotonic() - start
    start = time.monotonic()
    checked = _run([sys.executable, "scripts/check_wheel.py", *select, "--dist", dist, "--work", WORK / "check",
                    "--keep"], timeout=3600)
    check_s = time.monotonic() - start
    venv = WORK / "check" / f"venv-torch{pair['torch']}-py{pair['python']}"
    _run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-compile",
          *_subset_pins(pair["torch"])], timeout=1800)
    print(f"{_id(pair)}: build {build_s:.0f} s, wheel check {check_s:.0f} s", file=sys.stderr)
    yield {"pair": pair, "dist": dist, "venv": venv, "built": built, "checked": checked}
    # About 5.5 GB (a CUDA torch) and made fresh every run: gone before the next pair's.
    shutil.rmtree(venv, ignore_errors=True)


def test_wheel_is_manylinux_and_trains_from_a_fresh_venv(proven):
    pair = proven["pair"]
    tag = f"cp{pair['python'].replace('.', '')}"
    wheels = list(proven["dist"].glob(f"oneccl_bind_pt-{pair['torch']}-{tag}-{tag}-manylinux_2_*_x86_64.whl"))
    assert len(wheels) == 1, sorted(p.name for p in proven["dist"].iterdir())
    assert "twine check --strict passed" in proven["built"], proven["built"]
    assert "wheels trained with equal checksums" in proven["checked"], proven["checked"]
    no_import = "no-import script trained on ccl through the entry point" in proven["checked"]
    assert no_import == pair["no_import"], proven["checked"]


def test_wheel_for_another_python_is_refused_by_pip(proven):
    """This venv's pip (the default Python) must not take another Python's wheel."""
    pair = proven["pair"]
    if pair["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}":
        pytest.skip("the pair's Python is this one")
    wheel = next(proven["dist"].glob("oneccl_bind_pt-*.whl"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is not a supported wheel on this platform" in proc.stderr, proc.stderr


def test_conda_package_on_the_pairs_python(proven, tmp_path):
    """The offline conda proof (tests/test_conda.py) for the pair marked `conda`: another
    Python's interpreter, whose torch on PyPI is a CUDA build (its nvidia-* stand-ins too)."""
    pair = proven["pair"]
    if not pair.get("conda"):
        pytest.skip(f"the conda proof runs on the pair marked conda in meta/releases.yaml, not {_id(pair)}")
    _run([proven["venv"] / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          "--no-compile", *META["pip"]["conda"]["pins"]], timeout=1800)
    start = time.monotonic()
    # Its stand-ins (a CUDA torch's nvidia-* libraries) take about 12 GB: not kept for the next run.
    cache = tmp_path / "cache"
    try:
        rep = conda_proof(proven["venv"] / "bin" / "python", tmp_path, torch=pair["torch"], cache=cache, timeout=3000)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(tmp_path / "work", ignore_errors=True)
    assert rep["python"] == pair["python"] and rep["torch"] == pair["torch"], rep
    print(f"{_id(pair)}: conda proof {time.monotonic() - start:.0f} s", file=sys.stderr)


def test_installed_wheel_passes_the_subset(proven):
    start = time.monotonic()
    subset = SAME_RELEASE_SUBSET if proven["pair"]["torch"] == META["default"] else SUBSET
    _run([proven["venv"] / "bin" / "pytest", "-q", "-p", "no:cacheprovider", *subset], timeout=3600)
    print(f"{_id(proven['pair'])}: subset {time.monotonic() - start:.0f} s", file=sys.stderr)

