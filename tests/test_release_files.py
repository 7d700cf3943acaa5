"""meta/releases.yaml is the single source of versions: generated files must match it,
every release gets its files, and the recipe renders one conda package per release."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_release_files as gen  # noqa: E402
import releases  # noqa: E402

META = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
RELEASES = META["releases"]
README_WITH_TABLE = f"# x\n\nbefore\n\n{gen.TABLE_BEGIN}\nold table\n{gen.TABLE_END}\n\nafter\n"


def run_gen(root, *args):
    return subprocess.run([sys.executable, str(root / "scripts" / "gen_release_files.py"), *args],
                          cwd=root.parent, capture_output=True, text=True)


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
     SHARED | {f"environments/torch-{OTHER}/environment.yml", f"requirements/torch-{OTHER}.txt"}),
    # The default release's oneCCL: also pyproject.toml's build pin (requirements.txt includes its set).
    (lambda m: release(m, DEFAULT).update(oneccl="2022.9.9"),
     SHARED | {"pyproject.toml", f"requirements/torch-{DEFAULT}.txt"}),
    # A tool pin every release's set holds.
    (lambda m: m["pip"]["test"]["pins"].__setitem__(1, "pytest==9.9.9"),
     {f"requirements/torch-{r['torch']}.txt" for r in RELEASES}),
], ids=["one-release", "default-release", "tool"])
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
    assert stale_in(r.stdout) == SHARED | {"environments/torch-2.99.0/environment.yml",
                                           "requirements/torch-2.99.0.txt"}, r.stdout
    assert run_gen(tree).returncode == 0
    assert "torch==2.99.0" in (tree / "requirements" / "torch-2.99.0.txt").read_text()
    assert '"2.99": {' in (tree / "oneccl_bind_pt" / "_version.py").read_text()
    assert "| 2.99.0+cpu (pip)" in (tree / "README.md").read_text()
    assert run_gen(tree, "--check").returncode == 0

    # Dropping it again: its files are named, then removed.
    edit_meta(tree, lambda m: m["releases"].pop())
    r = run_gen(tree, "--check")
    assert "requirements/torch-2.99.0.txt (no such release)" in r.stdout, r.stdout
    assert run_gen(tree).returncode == 0
    assert not (tree / "requirements" / "torch-2.99.0.txt").exists()
    assert not (tree / "environments" / "torch-2.99.0" / "environment.yml").exists()


def test_every_release_has_its_files():
    variants = yaml.safe_load((ROOT / "recipe" / "conda_build_config.yaml").read_text())
    assert variants["pytorch"] == [r["torch"] for r in RELEASES]
    assert variants["oneccl_devel"] == [r["oneccl"] for r in RELEASES]
    table = releases.TABLE["RELEASES"]
    assert [row["torch"] for row in table.values()] == [r["torch"] for r in RELEASES]
    assert releases.DEFAULT == META["default"]
    for rel in RELEASES:
        torch = rel["torch"]
        env = yaml.safe_load((ROOT / "environments" / f"torch-{torch}" / "environment.yml").read_text())
        assert env["channels"] == META["channels"]
        assert f"pytorch={torch}={rel['flavour']}*" in env["dependencies"]
        assert f"impi_rt={rel['impi_rt']}" in env["dependencies"]
        assert any(d.startswith(f"oneccl_bind_pt={torch}=") for d in env["dependencies"])

        major, minor = map(int, torch.split(".")[:2])
        row = releases.TABLE["release_for"](f"{torch}+whatever")
        assert row["version"] == f"{torch}+{rel['flavour']}"
        assert row["torch_requirement"] == f"torch>={torch},<{major}.{minor + 1}"

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
        assert releases.venv(torch) == ROOT / (".venv" if torch == DEFAULT else f".venv-torch{torch}")
    assert (ROOT / "requirements.txt").read_text().splitlines()[-1] == f"-r requirements/torch-{DEFAULT}.txt"
    assert f'"torch=={DEFAULT}"' in (ROOT / "pyproject.toml").read_text()


def test_release_for_takes_any_patch_and_local_tag_of_a_minor():
    release_for = releases.TABLE["release_for"]
    for rel in RELEASES:
        major, minor = rel["torch"].split(".")[:2]
        for seen in (rel["torch"], f"{major}.{minor}.7+cu130", f"{major}.{minor}.0a0+git1234"):
            assert release_for(seen)["torch"] == rel["torch"], seen
    assert release_for("2.12.1+cpu") is None and release_for("3.0.0") is None


def test_readme_table_lists_every_release_and_how_it_was_checked():
    table = gen.release_table(META).splitlines()
    assert len(table) == 2 + len(RELEASES)
    for rel, row in zip(RELEASES, table[2:]):
        assert row.startswith(f"| {rel['torch']}+{rel['flavour']} (pip)"), row
        assert " ".join(rel["checked"].split()) in row


def test_recipe_renders_one_package_per_release_with_its_pins():
    rattler_build = pytest.importorskip("rattler_build")
    from rattler_build.render import RenderConfig
    from rattler_build.tool_config import PlatformConfig

    rendered = rattler_build.Stage0Recipe.from_file(str(ROOT / "recipe" / "recipe.yaml")).render(
        rattler_build.VariantConfig.from_file(str(ROOT / "recipe" / "conda_build_config.yaml")),
        RenderConfig(platform=PlatformConfig(target_platform="linux-64")))
    by_torch = {v.variant["pytorch"]: v.recipe for v in rendered}
    assert sorted(by_torch) == sorted(r["torch"] for r in RELEASES) and len(rendered) == len(RELEASES)
    for rel in RELEASES:
        recipe = by_torch[rel["torch"]]
        assert recipe.package.name == "oneccl_bind_pt"
        assert str(recipe.package.version) == rel["torch"]
        assert recipe.build.string.startswith(f"{rel['flavour']}_py311h")
        assert recipe.build.string.endswith(f"_{rel['build_number']}")
        host = recipe.requirements.host
        for pin in (f"pytorch {rel['torch']}.*", f"oneccl-devel {rel['oneccl']}.*", f"hwloc {rel['hwloc']}.*"):
            assert pin in host, (rel["torch"], host)
        run = recipe.requirements.run
        # Run-pinned to the torch minor it was built with: >=X.Y.Z,<X.(Y+1).0a0 once solved.
        assert {"pin_compatible": {"name": "pytorch", "lower_bound": "x.x.x.x.x.x", "upper_bound": "x.x"}} in run, run
        assert f"impi_rt >={rel['impi_rt']}" in run
