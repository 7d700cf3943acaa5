"""The (torch, Python) pairs CI proves beside the default pair, inside the README's test command.

The rest of tests/ runs on the default pair (the venv running this file). meta/releases.yaml
lists under `ci` one pair per other release, every Python in at least one. For each, the way a
release is made and installed:

1. scripts/build_wheels.py builds its wheel (from the release's sdist where the pair says
   from_sdist), auditwheel grants and repairs the manylinux tag, twine check passes. Build
   venvs and objects are kept under build/release/ between runs, never shared between pairs.
2. scripts/check_wheel.py installs that wheel into a fresh venv of the pair's Python that
   holds only its torch, with no compiler, and trains examples/ddp.py under torchrun and
   mpirun to the checksum one process computes (scripts/ddp_reference.py); on torch >= 2.14
   a script that never imports the package trains on "ccl" (the entry point).
3. That venv then gets the test pins, and its pytest runs the pair's `subset` (the lists in
   scripts/make_release.py's SUBSETS) against the installed wheel.

A pair marked release_command is made instead the way a new release is (docs/releasing.md):
in a copy of the tree without its entry, the entry put back, then scripts/make_release.py.

A clean machine downloads each pair's torch once (PyPI's torch for these Pythons is a CUDA
build: 4.6-7 GB installed each). Each pair's fresh venv
is removed after its tests, so the run needs one at a time; the build venvs (about 1.4 GB
each) stay for the next run, except under CI (a fresh clone), which removes each once used.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import run_job, wait_for_disk
from test_conda import conda_proof

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import releases  # noqa: E402
from make_release import clean_env, prove_subset  # noqa: E402

META = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
PAIRS = META["ci"]
WORK = ROOT / "build" / "release"
# A fresh clone under CI never reuses a build venv (1.4 GB each, six pairs): each goes once its
# wheel is built. A developer's rerun reuses them.
PRUNE = ["--prune"] if os.environ.get("CI") else []


def _run(cmd, timeout, cwd=ROOT, env=None):
    # Its own session: a timeout kills the inner run's ranks too, not only its pytest.
    return run_job(cmd, cwd=cwd, env=env or clean_env(), timeout=timeout)


def _uv_cache(pair) -> Path:
    """The pair's own uv cache (scripts/releases.py install_command): its build venv and its proof
    venv take torch from it, linked, not unpacked twice. Removed with the pair's proof venv: it
    holds what the pair's venvs hold (a CUDA torch and its nvidia-* packages, about 7 GB)."""
    return WORK / "uv-cache" / _id(pair)


def _id(pair):
    return f"torch{pair['torch']}-py{pair['python']}"


def _tree_before(tmp, torch):
    """A copy of the checkout's files as they were before torch's release: its entry and its ci
    pair cut out of meta/releases.yaml, and the generated files made from that."""
    tree = tmp / "tree"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    meta = tree / "meta" / "releases.yaml"
    text, n_ci = re.subn(rf'^  - {{torch: "{re.escape(torch)}".*\n', "", meta.read_text(), flags=re.M)
    # The entry: its first line through the line before the next entry or top-level key.
    text, n_entry = re.subn(rf'^  - torch: "{re.escape(torch)}"\n(?:(?:    .*)?\n)*?(?=^  - |^\S|\Z)', "", text,
                            flags=re.M)
    assert (n_ci, n_entry) == (1, 1), f"torch {torch}: {n_ci} ci pairs, {n_entry} entries cut"
    meta.write_text(text)
    _run([sys.executable, "scripts/gen_release_files.py"], timeout=300, cwd=tree)
    assert not (tree / "requirements" / f"torch-{torch}.txt").exists()
    return tree


def _via_release_command(pair, tmp, dist, env):
    """The release path of docs/releasing.md on a tree without the pair's release: one edit
    (meta/releases.yaml given its entry and ci pair again) and one command (scripts/make_release.py)."""
    tree = _tree_before(tmp, pair["torch"])
    (tree / "meta" / "releases.yaml").write_text((ROOT / "meta" / "releases.yaml").read_text())  # the one edit
    out = _run([sys.executable, "scripts/make_release.py", "--torch", pair["torch"], "--python", pair["python"],
                "--subset", pair["subset"], "--dist", dist, "--work", WORK, *PRUNE], timeout=3600, cwd=tree, env=env)
    # The command wrote what the checkout holds for that release, and named what to publish.
    for name in (f"requirements/torch-{pair['torch']}.txt", "oneccl_bind_pt/_version.py", "README.md",
                 "recipe/conda_build_config.yaml", f"environments/torch-{pair['torch']}-py{pair['python']}.yml"):
        assert (tree / name).read_text() == (ROOT / name).read_text(), name
    assert "Publish:" in out and f"oneccl_bind_pt-{pair['torch']}.tar.gz" in out, out
    return out


@pytest.fixture(scope="module", params=PAIRS, ids=_id)
def proven(request, tmp_path_factory):
    """The pair's wheel built, proven in a fresh venv, and the pair's subset run against it: what
    each step gave, under its name, up to the first that failed (its error under "failed").

    It never raises: after a module-scoped fixture raised for one pair, pytest errored every
    later pair on that worker without running it (an internal assertion in its fixture teardown),
    so one pair's failure hid whether the others worked."""
    pair = request.param
    proof = {"pair": pair, "dist": tmp_path_factory.mktemp("dist"), "venv": None}
    select = ["--torch", pair["torch"], "--python", pair["python"]]
    venv = WORK / "check" / f"venv-torch{pair['torch']}-py{pair['python']}"
    env = {**clean_env(), "UV_CACHE_DIR": str(_uv_cache(pair))}
    proof["env"] = env
    took = []
    try:
        # Its build venv and the proof venv's CUDA torch: about 7 GB.
        waited = wait_for_disk(ROOT, 8, f"{_id(pair)}'s build and proof venvs")
        took.append(f"waited {waited:.0f} s for disk")
        start = time.monotonic()
        if pair.get("release_command"):
            proof["built"] = proof["checked"] = proof["subset"] = _via_release_command(
                pair, tmp_path_factory.mktemp("release"), proof["dist"], env)
            took.append(f"make_release {time.monotonic() - start:.0f} s")
        else:
            proof["built"] = _run([sys.executable, "scripts/build_wheels.py", *select, "--dist", proof["dist"], "--work",
                                   WORK, *(["--from-sdist"] if pair["from_sdist"] else []), *PRUNE], timeout=3600, env=env)
            took.append(f"build {time.monotonic() - start:.0f} s")
            start = time.monotonic()
            proof["checked"] = _run([sys.executable, "scripts/check_wheel.py", *select, "--dist", proof["dist"], "--work",
                                     WORK / "check", "--keep"], timeout=3600, env=env)
            proof["venv"] = venv
            took.append(f"wheel check {time.monotonic() - start:.0f} s")
            start = time.monotonic()
            proof["subset"] = prove_subset(venv, META, pair["torch"], pair["subset"], env=env)
            took.append(f"subset {pair['subset']} {time.monotonic() - start:.0f} s")
    except (Exception, SystemExit) as e:  # a failed step exits with its output (make_release.step)
        proof["failed"] = f"{type(e).__name__}: {e}"
        took.append("then failed")
    proof["took"] = f"{_id(pair)}: " + ", ".join(took)
    try:
        yield proof
    finally:
        # About 5.5 GB (a CUDA torch) and made fresh every run: gone before the next pair's, with
        # the cache it was linked from.
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(_uv_cache(pair), ignore_errors=True)


def _step(proven, name):
    """What the pair's step `name` gave, or this test fails with the error of the step that failed."""
    if name not in proven:
        pytest.fail(f"{_id(proven['pair'])}: {proven['failed']}", pytrace=False)
    return proven[name]


def test_wheel_is_manylinux_and_trains_from_a_fresh_venv(proven, record_property):
    pair = proven["pair"]
    record_property("took", proven["took"])  # the run's summary lists where CI's time went
    built, checked = _step(proven, "built"), _step(proven, "checked")
    tag = f"cp{pair['python'].replace('.', '')}"
    wheels = list(proven["dist"].glob(f"oneccl_bind_pt-{pair['torch']}-{tag}-{tag}-manylinux_2_*_x86_64.whl"))
    assert len(wheels) == 1, sorted(p.name for p in proven["dist"].iterdir())
    assert "twine check --strict passed" in built, built
    assert "wheels trained with equal checksums" in checked, checked
    no_import = "no-import script trained on ccl through the entry point" in checked
    assert no_import == pair["no_import"], checked


def test_wheel_for_another_python_is_refused_by_pip(proven):
    """This venv's pip (the default Python) must not take another Python's wheel."""
    pair = proven["pair"]
    if pair["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}":
        pytest.skip("the pair's Python is this one")
    _step(proven, "built")
    wheel = next(proven["dist"].glob("oneccl_bind_pt-*.whl"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is not a supported wheel on this platform" in proc.stderr, proc.stderr


@pytest.mark.slow  # 8-10 min, a sixth of CI's time: --runslow (the default pair's proof runs on every CI run)
def test_conda_package_on_the_pairs_python(proven, tmp_path, record_property):
    """The offline conda proof (tests/test_conda.py) for the pair marked `conda`: another
    Python's interpreter, whose torch on PyPI is a CUDA build (its nvidia-* stand-ins too)."""
    pair = proven["pair"]
    if not pair.get("conda"):
        pytest.skip(f"the conda proof runs on the pair marked conda in meta/releases.yaml, not {_id(pair)}")
    _step(proven, "checked")
    install, env = releases.install_command(proven["venv"] / "bin" / "python", proven["env"])
    _run([*install, *META["pip"]["conda"]["pins"]], timeout=1800, env=env)
    waited = wait_for_disk(tmp_path, 10, f"{_id(pair)}'s conda proof")
    start = time.monotonic()
    # Its stand-ins (a CUDA torch's nvidia-* libraries) take about 12 GB at the peak (3 GB of wheels,
    # 3 GB of packages, 6 GB extracted), 9 GB lean: not kept for the next run.
    cache = tmp_path / "cache"
    try:
        rep = conda_proof(proven["venv"] / "bin" / "python", tmp_path, torch=pair["torch"], cache=cache, timeout=3000,
                          lean=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(tmp_path / "work", ignore_errors=True)
    assert rep["python"] == pair["python"] and rep["torch"] == pair["torch"], rep
    record_property("took", f"{_id(pair)}: conda proof {time.monotonic() - start:.0f} s (waited {waited:.0f} s for disk)")


def test_installed_wheel_passes_the_subset(proven):
    """The pair's `subset` (scripts/make_release.py's SUBSETS) ran green against its wheel."""
    if proven["pair"]["subset"] == "none":
        pytest.skip("this pair's proof is its wheel's DDP under torchrun and mpirun (subset: none)")
    # Counted, not searched for " failed": the per-transport closing line says "0 failed".
    subset = _step(proven, "subset")
    assert re.search(r"\b\d+ passed\b", subset), subset
    assert not re.search(r"\b[1-9]\d* (failed|errors?)\b", subset), subset
