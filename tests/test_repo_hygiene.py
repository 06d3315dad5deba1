"""The checkout holds what it should (tests/repo_hygiene.py): nothing stray at the top level, and no committed
file that .gitignore excludes without an exception. The checks run on a small repository made here too,
one with each fault, so a check that sees nothing is seen to fail; and a test session that leaves a stray
at the top level fails, whichever test made it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.repo_hygiene import not_a_checkout, strays, tracked_but_ignored

ROOT = Path(__file__).resolve().parents[1]
WHY_NOT = not_a_checkout(ROOT)
needs_checkout = pytest.mark.skipif(WHY_NOT is not None, reason=f"no checkout to check: {WHY_NOT}")
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@needs_checkout
def test_no_committed_file_is_excluded_by_gitignore_without_an_exception():
    found = tracked_but_ignored(ROOT)
    assert not found, (
        f"committed, yet .gitignore excludes them: {found}. Keep one with a `!path` line after the rule "
        f"that excludes it (`git check-ignore -v --no-index PATH` names the rule), or `git rm --cached` it"
    )


@needs_checkout
def test_the_top_level_holds_only_what_it_should():
    found = strays(ROOT)
    assert not found, (
        f"stray at the top level of {ROOT}: {found}. Remove it, ignore it in .gitignore, or, if it belongs "
        f"there, add it to TOP_LEVEL in tests/repo_hygiene.py"
    )


def git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        check=True,
        capture_output=True,
    )


def repo_with(tmp_path: Path, files: dict[str, str], committed: list[str]) -> Path:
    """A git repository holding `files` (path -> text), `committed` added with `git add -f` and committed."""
    repo = tmp_path / "repo"
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", "-f", *committed)
    git(repo, "commit", "-q", "-m", "the files")
    return repo


@needs_git
def test_the_checks_name_a_stray_and_a_committed_file_the_rules_exclude(tmp_path):
    files = {
        ".gitignore": "*.log\n/slurm-*.out\n",
        "README.md": "",
        "data/kept.log": "",
        "slurm-11.out": "",  # committed by accident, though ignored
        "slurm-13.out": "",  # ignored and untracked: a SLURM job's output, fine
        "notes.txt": "",  # untracked and not ignored: a `git add .` would commit it
    }
    repo = repo_with(tmp_path, files, [".gitignore", "README.md", "data/kept.log", "slurm-11.out"])
    allowed = frozenset({".gitignore", "README.md", "data"})

    assert tracked_but_ignored(repo) == ["data/kept.log", "slurm-11.out"]
    assert strays(repo, allowed) == ["notes.txt (untracked)", "slurm-11.out (tracked)"]

    # an exception lets the log in; a removed leftover is gone
    (repo / ".gitignore").write_text("*.log\n!data/kept.log\n/slurm-*.out\n")
    git(repo, "rm", "-q", "--cached", "slurm-11.out")
    (repo / "slurm-11.out").unlink()
    (repo / "notes.txt").unlink()
    assert tracked_but_ignored(repo) == []
    assert strays(repo, allowed) == []


def test_a_folder_outside_any_checkout_is_named_as_such(tmp_path):
    why = not_a_checkout(tmp_path)
    assert why is not None and ("not a git checkout" in why or "git is not installed" in why)


@needs_git
def test_a_test_session_that_leaves_a_stray_at_the_top_level_fails(tmp_path):
    # a checkout of its own, with the hooks tests/conftest.py takes; one test writes beside the checkout's
    # files, one under its tmp_path
    files = {
        "pytest.ini": "[pytest]\n",
        "conftest.py": "from tests.repo_hygiene import pytest_sessionfinish, pytest_sessionstart\n",
        "test_writes.py": (
            "from pathlib import Path\n"
            "def test_into_the_checkout(request):\n"
            "    (request.config.rootpath / 'leftover.out').write_text('')\n"
            "def test_into_its_tmp_path(tmp_path):\n"
            "    (tmp_path / 'fine.out').write_text('')\n"
        ),
    }
    repo = repo_with(tmp_path, files, list(files))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def session(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
        )

    clean = session("-k", "tmp_path")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    left = session()
    assert left.returncode == 1, left.stdout + left.stderr
    assert "2 passed" in left.stdout  # the tests passed; the session did not
    assert "leftover.out (untracked)" in left.stdout
    # a stray that was there before the session is not the session's: the test above names it
    again = session("-k", "tmp_path")
    assert again.returncode == 0, again.stdout + again.stderr
