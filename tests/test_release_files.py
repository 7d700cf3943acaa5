"""meta/releases.yaml is the single source of versions: generated files must match it,
every (torch, Python) pair gets its files, and the recipe renders one conda package per pair."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import import_or_require

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_release_files as gen  # noqa: E402
import releases  # noqa: E402

META = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
RELEASES = META["releases"]
PAIRS = [(r["torch"], p) for r in RELEASES for p in r["python"]]
README_WITH_TABLE = f"# x\n\nbefore\n\n{gen.TABLE_BEGIN}\nold table\n{gen.TABLE_END}\n\nafter\n"


def run_gen(root, *args):
    return subprocess.run([sys.executable, str(root / "scripts" / "gen_release_files.py"), *args],
                          cwd=root.parent, capture_output=True, text=True, timeout=120)


def stale_in(out):
    return {line.strip() for line in out.splitlines()[1:]}


@pytest.fixture
def tree(tmp_path):
    """A copy of what the generator reads and writes, README.md with the table markers."""
    tree = tmp_path / "tree"
    for path in [ROOT / "scripts" / "gen_release_files.py", ROOT / "meta" / "releases.yaml", *gen.outputs()]:
        dst = tree / path.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dst)
    (tree / "README.md").write_text(README_WITH_TABLE)
    assert run_gen(tree).returncode == 0  # fills the README's table
    assert run_gen(tree, "--check").returncode == 0
    return tree


def edit_meta(tree, change):
    """Applies `change` to the copy's matrix (comments are lost; the generator does not read them)."""
    path = tree / "meta" / "releases.yaml"
    meta = yaml.safe_load(path.read_text())
    change(meta)
    path.write_text(yaml.safe_dump(meta, sort_keys=False))


def release(meta, torch):
    return next(r for r in meta["releases"] if r["torch"] == torch)


DEFAULT = META["default"]
OTHER = next(r["torch"] for r in RELEASES if r["torch"] != DEFAULT)
SHARED = {"recipe/conda_build_config.yaml", "oneccl_bind_pt/_version.py", "README.md"}


def test_generated_files_are_current():
    r = run_gen(ROOT, "--check")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("change, expect", [
    # A pin of one release: its files and the shared ones, nothing of the other releases.
    (lambda m: release(m, OTHER).update(impi_rt="2021.99.9"),
     SHARED | {f"environments/torch-{OTHER}-py{p}.yml" for p in release(META, OTHER)["python"]}
     | {f"requirements/torch-{OTHER}.txt"}),
    # The default release's oneCCL (requirements.txt includes its set).
    (lambda m: release(m, DEFAULT).update(oneccl="2022.9.9"),
     SHARED | {f"requirements/torch-{DEFAULT}.txt"}),
    # A Python added to a release: its environment file and the shared files.
    (lambda m: release(m, OTHER)["python"].append("3.14"),
     SHARED | {f"environments/torch-{OTHER}-py3.14.yml"}),
    # A tool pin every release's set holds.
    (lambda m: m["pip"]["test"]["pins"].__setitem__(1, "pytest==9.9.9"),
     {f"requirements/torch-{r['torch']}.txt" for r in RELEASES}),
], ids=["one-release", "default-release", "python", "tool"])
def test_check_names_exactly_the_stale_files_after_a_pin_changes(tree, change, expect):
    """Proves the check above can fail, and for the right files."""
    edit_meta(tree, change)
    r = run_gen(tree, "--check")
    assert r.returncode == 1
    assert stale_in(r.stdout) == expect, r.stdout
    assert run_gen(tree).returncode == 0
    assert run_gen(tree, "--check").returncode == 0


def test_adding_a_release_is_one_edit_and_one_command(tree):
    edit_meta(tree, lambda m: m["releases"].append({**m["releases"][-1], "torch": "2.99.0"}))
    r = run_gen(tree, "--check")
    assert r.returncode == 1
    pythons = META["releases"][-1]["python"]
    assert stale_in(r.stdout) == SHARED | {f"environments/torch-2.99.0-py{p}.yml" for p in pythons} | {
        "requirements/torch-2.99.0.txt"}, r.stdout
    assert run_gen(tree).returncode == 0
    assert "torch==2.99.0" in (tree / "requirements" / "torch-2.99.0.txt").read_text()
    assert '"2.99": {' in (tree / "oneccl_bind_pt" / "_version.py").read_text()
    assert "| 2.99.0 (pip)" in (tree / "README.md").read_text()
    assert run_gen(tree, "--check").returncode == 0

    # Dropping it again: its files are named, then removed.
    edit_meta(tree, lambda m: m["releases"].pop())
    r = run_gen(tree, "--check")
    assert "requirements/torch-2.99.0.txt (no such release)" in r.stdout, r.stdout
    assert run_gen(tree).returncode == 0
    assert not (tree / "requirements" / "torch-2.99.0.txt").exists()
    assert not list((tree / "environments").glob("torch-2.99.0-*"))


def test_every_pair_has_its_files():
    variants = yaml.safe_load((ROOT / "recipe" / "conda_build_config.yaml").read_text())
    assert list(zip(variants["pytorch"], variants["python"])) == PAIRS
    rel_of = {r["torch"]: r for r in RELEASES}
    assert variants["oneccl_devel"] == [rel_of[t]["oneccl"] for t, _ in PAIRS]
    assert "python" in variants["zip_keys"][0] and "pytorch" in variants["zip_keys"][0]
    table = releases.TABLE["RELEASES"]
    assert [row["torch"] for row in table.values()] == [r["torch"] for r in RELEASES]
    assert releases.DEFAULT == META["default"] and releases.DEFAULT_PYTHON == META["default_python"]
    assert releases.PAIRS == PAIRS
    for torch, python in PAIRS:
        rel = rel_of[torch]
        env = yaml.safe_load((ROOT / "environments" / f"torch-{torch}-py{python}.yml").read_text())
        assert env["channels"] == META["channels"]
        assert f"python={python}" in env["dependencies"]
        assert f"pytorch={torch}={rel['flavour']}*" in env["dependencies"]
        assert f"impi_rt={rel['impi_rt']}" in env["dependencies"]
        assert f"oneccl_bind_pt={torch}={rel['flavour']}_py{python.replace('.', '')}*_{rel['build_number']}" \
            in env["dependencies"]
        assert releases.venv(torch, python) == ROOT / (
            ".venv" if (torch, python) == (DEFAULT, META["default_python"])
            else f".venv-torch{torch}" if python == META["default_python"] else f".venv-torch{torch}-py{python}")
    for rel in RELEASES:
        torch = rel["torch"]
        major, minor = map(int, torch.split(".")[:2])
        row = releases.TABLE["release_for"](f"{torch}+whatever")
        # PyPI refuses local versions (+cpu): the plain torch version, .postN for a rebuild.
        assert row["version"] == torch + (f".post{rel['build_number']}" if rel["build_number"] else "")
        assert row["torch_requirement"] == f"torch>={torch},<{major}.{minor + 1}"
        assert row["python"] == rel["python"]
        low, high = rel["python"][0], rel["python"][-1]
        assert row["requires_python"] == f">={low},<{high.split('.')[0]}.{int(high.split('.')[1]) + 1}"

        reqs = releases.requirements(torch).read_text().splitlines()
        for pin in (f"torch=={torch}", f"oneccl-devel=={rel['oneccl']}", f"impi-rt=={rel['impi_rt']}",
                    f"tcmlib=={rel['tcmlib']}", "pytest==9.2.0"):
            assert pin in reqs, (torch, pin)
        assert any(line.startswith("numpy==") for line in reqs), torch  # object collectives need it
        # Transformers, DeepSpeed and the conda tools only where the tests that need them run: the default.
        only_default = {"transformers", "accelerate", "deepspeed", "py-rattler-build"}
        heavy = {line.split("==")[0] for line in reqs} & only_default
        assert heavy == (only_default if torch == DEFAULT else set())
        assert ("PIP_CONSTRAINT" in releases.pip_env(torch, {})) == bool(rel.get("lift_pip_constraint")), torch
    assert (ROOT / "requirements.txt").read_text().splitlines()[-1] == f"-r requirements/torch-{DEFAULT}.txt"


def test_a_pin_that_differs_by_python_resolves_for_every_python_of_the_matrix():
    """Every pinned requirement applies, by its marker, to exactly one version per Python."""
    from packaging.requirements import Requirement

    for rel in RELEASES:
        reqs = [Requirement(line) for line in releases.requirements(rel["torch"]).read_text().splitlines()
                if line and not line.startswith("#")]
        for python in rel["python"]:
            names = [r.name for r in reqs if r.marker is None or r.marker.evaluate({"python_version": python})]
            assert len(names) == len(set(names)), (rel["torch"], python, names)


def test_release_for_takes_any_patch_and_local_tag_of_a_minor():
    release_for = releases.TABLE["release_for"]
    for rel in RELEASES:
        major, minor = rel["torch"].split(".")[:2]
        for seen in (rel["torch"], f"{major}.{minor}.7+cu130", f"{major}.{minor}.0a0+git1234"):
            assert release_for(seen)["torch"] == rel["torch"], seen
    assert release_for("2.8.0+cpu") is None and release_for("3.0.0") is None


def test_readme_tables_list_every_pair_and_how_each_release_was_checked():
    matrix, pins, features = gen.release_table(META).split("\n\n")
    matrix, pins, features = matrix.splitlines(), pins.splitlines(), features.splitlines()
    pythons = sorted({p for _, p in PAIRS})
    assert matrix[0] == "| torch | " + " | ".join(f"Python {p}" for p in pythons) + " |"
    ci = {(e["torch"], e["python"]) for e in META["ci"]} | {(DEFAULT, META["default_python"])}
    for rel, row in zip(RELEASES, matrix[2:]):
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        for python, cell in zip(pythons, cells):
            want = "-" if python not in rel["python"] else rel["torch"] + (" (CI)" if (rel["torch"], python) in ci else "")
            assert cell == want, (rel["torch"], python, row)
    assert len(pins) == 2 + len(RELEASES)
    for rel, row in zip(RELEASES, pins[2:]):
        assert row.startswith(f"| {rel['torch']} (pip)"), row
        assert " ".join(rel["checked"].split()) in row
    # Each feature row marks the releases whose torch minor is at least the one that added it.
    assert features[0] == "| feature | " + " | ".join(".".join(r["torch"].split(".")[:2]) for r in RELEASES) + " |"
    assert len(features) == 2 + len(META["features"])
    for feature, row in zip(META["features"], features[2:]):
        marks = [c.strip() for c in row.rsplit("|", len(RELEASES) + 1)[1:-1]]
        since = tuple(int(x) for x in feature["since"].split("."))
        assert marks == ["yes" if releases.version_tuple(r["torch"])[:2] >= since else "-" for r in RELEASES], row


def test_every_ci_pair_names_a_proof_subset_that_exists():
    from make_release import SUBSETS

    assert {e["subset"] for e in META["ci"]} <= set(SUBSETS), META["ci"]
    # Every release but the default one is proven in CI, and every Python by one pair.
    assert {e["torch"] for e in META["ci"]} == {r["torch"] for r in RELEASES} - {DEFAULT}
    assert {e["python"] for e in META["ci"]} | {META["default_python"]} == {p for _, p in PAIRS}


def test_recipe_renders_one_package_per_pair_with_its_pins():
    rattler_build = import_or_require("rattler_build")
    from rattler_build.render import RenderConfig
    from rattler_build.tool_config import PlatformConfig

    rendered = rattler_build.Stage0Recipe.from_file(str(ROOT / "recipe" / "recipe.yaml")).render(
        rattler_build.VariantConfig.from_file(str(ROOT / "recipe" / "conda_build_config.yaml")),
        RenderConfig(platform=PlatformConfig(target_platform="linux-64")))
    by_pair = {(v.variant["pytorch"], v.variant["python"]): v.recipe for v in rendered}
    assert sorted(by_pair) == sorted(PAIRS) and len(rendered) == len(PAIRS)
    rel_of = {r["torch"]: r for r in RELEASES}
    for (torch, python), recipe in by_pair.items():
        rel = rel_of[torch]
        assert recipe.package.name == "oneccl_bind_pt"
        assert str(recipe.package.version) == rel["torch"]
        assert recipe.build.string.startswith(f"{rel['flavour']}_py{python.replace('.', '')}h")
        assert recipe.build.string.endswith(f"_{rel['build_number']}")
        host = recipe.requirements.host
        for pin in (f"pytorch {rel['torch']}.*", f"oneccl-devel {rel['oneccl']}.*", f"hwloc {rel['hwloc']}.*"):
            assert pin in host, (rel["torch"], host)
        run = recipe.requirements.run
        # Run-pinned to the torch minor it was built with: >=X.Y.Z,<X.(Y+1).0a0 once solved.
        assert {"pin_compatible": {"name": "pytorch", "lower_bound": "x.x.x.x.x.x", "upper_bound": "x.x"}} in run, run
        assert f"impi_rt >={rel['impi_rt']}" in run


def test_install_command_carries_pips_settings_to_uv(tmp_path):
    """The release pairs' venvs get their torch through uv (releases.install_command): from where
    pip would take it. pip's settings become uv's options, its [install] section over [global] (and
    its environment over both), values one per line as pip.conf allows, and a constraint of
    /dev/null (pip_env's lift of a machine's cap) is no constraint."""
    import_or_require("uv")
    conf = tmp_path / "pip.conf"
    # [install] as well as [global]: a machine's own [install] settings would outrank a test's [global].
    conf.write_text("[global]\nindex-url = https://wrong.example/simple\ncert = /certs/wrong.pem\n"
                    "[install]\nindex-url = https://mirror.example/simple\n"
                    "extra-index-url =\n    file:///a/simple\n    file:///b/simple\nfind-links = /wheels\n"
                    "trusted-host = mirror.example\ncert = /certs/ca.pem\nconstraint = /caps.txt\ntimeout = 77\n"
                    "no-index = false\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PIP_CONFIG_FILE": str(conf)}
    cmd, out_env = releases.install_command(Path("/venv/bin/python"), env)
    assert cmd[1:5] == ["pip", "install", "--quiet", "--python"] and cmd[5] == "/venv/bin/python", cmd
    pairs = list(zip(cmd[6::2], cmd[7::2]))
    assert pairs == [("--index-strategy", "unsafe-best-match"), ("--index-url", "https://mirror.example/simple"),
                     ("--extra-index-url", "file:///a/simple"), ("--extra-index-url", "file:///b/simple"),
                     ("--find-links", "/wheels"), ("--constraint", "/caps.txt"),
                     ("--allow-insecure-host", "mirror.example"), ("--cert", "/certs/ca.pem")], cmd
    assert out_env["UV_HTTP_TIMEOUT"] == "77"
    lifted, _ = releases.install_command(Path("/venv/bin/python"), {**env, "PIP_CONSTRAINT": "/dev/null"})
    assert "--constraint" not in lifted and "/caps.txt" not in lifted, lifted
    offline, _ = releases.install_command(Path("/venv/bin/python"), {**env, "PIP_NO_INDEX": "1"})
    assert "--no-index" in offline and "--no-index" not in cmd, offline
    assert "--compile-bytecode" not in cmd
    assert "--compile-bytecode" in releases.install_command(Path("/venv/bin/python"), env, compile=True)[0]


def test_install_command_installs_into_the_named_venv(tmp_path):
    """It installs from this machine's configured sources into the venv it names, not the caller's."""
    import_or_require("uv")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    pin = next(p for p in META["pip"]["test"]["pins"] if p.startswith("execnet=="))
    cmd, env = releases.install_command(venv / "bin" / "python")
    proc = subprocess.run([*cmd, pin], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    found = subprocess.run([venv / "bin" / "python", "-c", "import execnet; print(execnet.__version__, execnet.__file__)"],
                           capture_output=True, text=True, timeout=60)
    version, path = found.stdout.split()
    assert pin == f"execnet=={version}" and path.startswith(str(venv)), found
