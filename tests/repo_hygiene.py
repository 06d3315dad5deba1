"""What a checkout of this repository may hold, asked of git itself: a stray file at the top level (an
empty `slurm-11.out` committed by accident), or a committed file that the ignore rules exclude without an
exception (a clean clone has it, a `git add` of its folder does not take a new one, and nothing says
which rule wins).

tests/test_repo_hygiene.py checks a checkout as it stands; tests/conftest.py also fails a test session
that left a new stray at the top level (tests/test_repo_hygiene.py may have run before the test that
made it, or on another worker).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

# What the top level of the repository holds. A new entry is a decision written here, not an accident.
TOP_LEVEL = frozenset(
    {
        ".ci",
        ".gitignore",
        "README.md",
        "bench",
        "conf",
        "docs",
        "examples",
        "experiments",
        "hydra_plugins",
        "orchestrator",
        "pyproject.toml",
        "reports",
        "scripts",
        "tests",
    }
)


def _git(root: Path, *args: str) -> list[str]:
    """git's NUL-separated answer as a list of paths."""
    out = subprocess.run(
        ["git", "-C", str(root), *args, "-z"], capture_output=True, check=True, text=True
    ).stdout
    return [p for p in out.split("\0") if p]


def not_a_checkout(root: Path) -> str | None:
    """Why `root` cannot be checked (no git, or not the top of a git work tree), None where it can."""
    if shutil.which("git") is None:
        return "git is not installed"
    answer = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True, text=True
    )
    if answer.returncode != 0:
        return f"{root} is not a git checkout (an sdist or an installed copy)"
    if Path(answer.stdout.strip()).resolve() != root.resolve():
        return f"{root} is not the top of its git checkout ({answer.stdout.strip()} is)"
    return None


def tracked_but_ignored(root: Path) -> list[str]:
    """Committed files that .gitignore excludes, with no `!` exception that lets them in."""
    return _git(root, "ls-files", "--cached", "--ignored", "--exclude-standard")


def top_level(root: Path) -> dict[str, str]:
    """Each entry at the top level that git sees -> `tracked` or `untracked` (untracked and not
    ignored: what a `git add .` would commit)."""
    entries = {
        p.split("/")[0]: "untracked"
        for p in _git(
            root, "ls-files", "--others", "--exclude-standard", "--directory", "--no-empty-directory"
        )
    }
    entries.update({p.split("/")[0]: "tracked" for p in _git(root, "ls-files", "--cached")})
    return entries


def strays(root: Path, allowed: frozenset[str] = TOP_LEVEL) -> list[str]:
    """The top-level entries that are not in `allowed`, each named with what git knows of it."""
    return [f"{name} ({state})" for name, state in sorted(top_level(root).items()) if name not in allowed]


# --- the test session's own strays (hooks, imported by tests/conftest.py) ------------------------------

_BEFORE = pytest.StashKey[set[str]]()


def _on_controller(session: pytest.Session) -> bool:
    # under pytest-xdist the workers run the tests; the controller checks once, before and after them all
    return not hasattr(session.config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    root = session.config.rootpath
    if _on_controller(session) and not_a_checkout(root) is None:
        # strays already there are tests/test_repo_hygiene.py's to name; the session answers for new ones
        session.config.stash[_BEFORE] = set(strays(root))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    before = session.config.stash.get(_BEFORE, None)
    if before is None:
        return
    root = session.config.rootpath
    new = sorted(set(strays(root)) - before)
    if not new:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", "stray files at the top level of the checkout", red=True)
        reporter.write_line(
            f"this test session left {', '.join(new)} in {root}: a test must write under its tmp_path "
            f"(tests/repo_hygiene.py)"
        )
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
