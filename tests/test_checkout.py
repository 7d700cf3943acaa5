"""A fresh clone must set up on a machine that never saw the project.

Two ways that broke before: a tracked path that .gitignore means to exclude
(a `.venv` symlink into /tmp, committed by accident) and a tracked symlink
that points outside the tree. And scripts/setup.sh must cope with a `.venv`
that cannot work (dangling link, moved interpreter, another Python).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import oneccl_bind_pt

ROOT = Path(__file__).resolve().parent.parent
ENSURE_VENV = ROOT / "scripts" / "ensure_venv.py"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          timeout=300).stdout


def tree_problems(repo: Path) -> list[str]:
    """Tracked paths a fresh clone on another machine would trip over."""
    problems = [f"{p}: tracked, but .gitignore excludes it"
                for p in git(repo, "ls-files", "--cached", "--ignored", "--exclude-standard").splitlines()]
    top = Path(git(repo, "rev-parse", "--show-toplevel").strip()).resolve()
    for line in git(repo, "ls-files", "--stage").splitlines():
        meta, path = line.split("\t", 1)
        if not meta.startswith("120000"):  # git's mode for a symlink
            continue
        target = os.readlink(top / path) if (top / path).is_symlink() else git(repo, "show", f":{path}")
        resolved = Path(os.path.normpath((top / path).parent / target))
        if os.path.isabs(target) or top not in (resolved, *resolved.parents):
            problems.append(f"{path}: symlink to {target}, outside the tree")
    return problems


@pytest.fixture(scope="module")
def checkout():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or a copied tree)")
    return ROOT


def test_nothing_tracked_points_outside_or_is_ignored(checkout):
    assert tree_problems(checkout) == []


def test_the_check_catches_both_mistakes(tmp_path):
    """Proves the test above can fail: a repository with both mistakes committed."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text(".venv\n")
    (repo / "docs").mkdir()
    (repo / "docs" / "inside.md").write_text("x")
    os.symlink("docs/inside.md", repo / "fine")
    os.symlink("/tmp/v", repo / ".venv")
    os.symlink("../../elsewhere", repo / "docs" / "up")
    git(repo, "add", "-f", ".")
    found = tree_problems(repo)
    assert any(p.startswith(".venv: tracked, but .gitignore excludes it") for p in found), found
    assert ".venv: symlink to /tmp/v, outside the tree" in found, found
    assert "docs/up: symlink to ../../elsewhere, outside the tree" in found, found
    assert not any(p.startswith("fine") for p in found), found


def test_gitignore_covers_a_venv_that_is_a_symlink(tmp_path):
    """`.venv/` (with a slash) does not match a symlink; the pattern must."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info"),
                    symlinks=True)
    git(repo, "init", "-q")
    os.symlink("/nonexistent/venv", repo / ".venv")
    assert ".venv" not in git(repo, "status", "--porcelain", "--untracked-files=all").split()


# ---- scripts/ensure_venv.py (called by scripts/setup.sh) --------------------


def ensure(venv: Path):
    return subprocess.run([sys.executable, str(ENSURE_VENV), str(venv)], capture_output=True, text=True,
                          timeout=300)


def works(venv: Path) -> bool:
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"],
                       capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and Path(r.stdout.strip()) == venv


def test_dangling_symlink_is_replaced_by_a_venv(tmp_path):
    venv = tmp_path / ".venv"
    os.symlink(tmp_path / "gone", venv)
    r = ensure(venv)
    assert r.returncode == 0, r.stderr
    assert "symlink to" in r.stderr and "does not exist" in r.stderr
    assert not venv.is_symlink() and works(venv)


def test_venv_without_a_working_python_is_rebuilt(tmp_path):
    venv = tmp_path / ".venv"
    assert ensure(venv).returncode == 0
    marker = venv / "old"
    marker.write_text("x")
    for name in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        (venv / "bin" / name).unlink(missing_ok=True)
    r = ensure(venv)
    assert r.returncode == 0, r.stderr
    assert "does not run" in r.stderr and "rebuilding" in r.stderr
    assert works(venv) and not marker.exists()


def test_venv_of_another_python_version_is_rebuilt(tmp_path):
    venv = tmp_path / ".venv"
    assert ensure(venv).returncode == 0
    python = venv / "bin" / "python"
    python.unlink()
    python.write_text("#!/bin/sh\necho 3.6\n")  # what an old venv's interpreter would answer
    python.chmod(0o755)
    r = ensure(venv)
    assert r.returncode == 0, r.stderr
    assert "holds Python 3.6" in r.stderr and "rebuilding" in r.stderr
    assert works(venv)


def test_working_venv_is_kept(tmp_path):
    venv = tmp_path / ".venv"
    assert ensure(venv).returncode == 0
    (venv / "kept").write_text("x")
    r = ensure(venv)
    assert r.returncode == 0 and r.stderr == ""
    assert (venv / "kept").exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_something_that_is_not_a_venv_is_left_alone(tmp_path, kind):
    venv = tmp_path / ".venv"
    if kind == "file":
        venv.write_text("notes")
    else:
        venv.mkdir()
        (venv / "data").write_text("x")
    r = ensure(venv)
    assert r.returncode == 2
    assert "not a virtual environment" in r.stderr and "remove it" in r.stderr
    assert venv.exists() and (kind == "file" or (venv / "data").exists())


def test_setup_names_a_missing_interpreter_and_how_to_get_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    env.update(PATH=f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", PYENV_ROOT=str(tmp_path))
    missing = next(p for p in ("3.12", "3.13", "3.10") if not shutil.which(f"python{p}", path=env["PATH"]))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--python", missing], env=env,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0
    assert f"no Python {missing} interpreter found" in r.stderr and f"pyenv install {missing}" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["--torch", "2.0.0"], ["--python", "3.9"], ["--torch", "2.15.0", "--python", "3.10"]],
                         ids=["torch", "python", "pair"])
def test_setup_lists_the_supported_pairs_when_asked_for_another(args):
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "is not supported. Supported pairs (meta/releases.yaml):" in r.stderr, r.stderr
    for row in oneccl_bind_pt._version.RELEASES.values():
        assert f"torch {row['torch']}: Python {', '.join(row['python'])}" in r.stderr, r.stderr
    assert not list(ROOT.glob(".venv-torch2.0.0*")) and not (ROOT / ".venv-torch2.15.0-py3.10").exists()


def test_setup_documents_its_pair_flags():
    r = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0
    assert "--torch 2.14.1 --python 3.12" in r.stdout and ".venv-torch2.14.1-py3.12" in r.stdout
