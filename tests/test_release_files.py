"""meta/releases.yaml is the single source of versions: generated files must match it."""

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
GEN = ["recipe/conda_build_config.yaml", "oneccl_bind_pt/_version.py", "pyproject.toml", "requirements.txt"]


def run_gen(root, *args):
    return subprocess.run([sys.executable, str(root / "scripts" / "gen_release_files.py"), *args],
                          cwd=root.parent, capture_output=True, text=True)


def test_generated_files_are_current():
    r = run_gen(ROOT, "--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_names_stale_files_after_a_pin_changes(tmp_path):
    """Proves the check above can fail: bump oneCCL in a copy of the tree."""
    tree = tmp_path / "tree"
    for rel in ["scripts/gen_release_files.py", "meta/releases.yaml", "environments", *GEN]:
        src, dst = ROOT / rel, tree / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
    meta_path = tree / "meta" / "releases.yaml"
    meta_path.write_text(meta_path.read_text().replace('oneccl: "2022.1.2"', 'oneccl: "2022.9.9"'))
    r = run_gen(tree, "--check")
    assert r.returncode == 1
    for stale in ("recipe/conda_build_config.yaml", "oneccl_bind_pt/_version.py", "pyproject.toml",
                  "requirements.txt"):
        assert stale in r.stdout, r.stdout
    assert run_gen(tree).returncode == 0
    assert 'ONECCL_VERSION = "2022.9.9"' in (tree / "oneccl_bind_pt" / "_version.py").read_text()
    assert "oneccl-devel==2022.9.9" in (tree / "requirements.txt").read_text()
    assert run_gen(tree, "--check").returncode == 0


def test_generated_values_follow_the_matrix():
    meta = yaml.safe_load((ROOT / "meta" / "releases.yaml").read_text())
    rel = meta["releases"][-1]
    variants = yaml.safe_load((ROOT / "recipe" / "conda_build_config.yaml").read_text())
    assert variants["pytorch"][-1] == rel["torch"] and variants["oneccl_devel"][-1] == rel["oneccl"]
    env = yaml.safe_load((ROOT / "environments" / f"torch-{rel['torch']}" / "environment.yml").read_text())
    assert env["channels"] == meta["channels"]
    assert f"pytorch={rel['torch']}={rel['flavour']}*" in env["dependencies"]
    assert any(d.startswith(f"oneccl_bind_pt={rel['torch']}=") for d in env["dependencies"])
    import oneccl_bind_pt

    assert oneccl_bind_pt.__version__ == f"{rel['torch']}+{rel['flavour']}"
    assert f"torch=={rel['torch']}" in (ROOT / "pyproject.toml").read_text()
