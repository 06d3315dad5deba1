"""Every fenced shell command in README.md and docs/ is exercised by a test, so the docs cannot drift.

Each command of a ```bash, ```sh or ```console block (a console block's commands are its `$ ` lines;
`\\` continuations joined, `#` comments dropped, `a && b` taken as two commands) lands in exactly one
class (`CLASSES`), and a command that fits none fails, named by its file and line:

- run for real, cheap: `--help`, a `dry_run=true` the docs already give, a rehearsal (`rehearse.studies`
  cut to a few), a read-only script;
- a study, run as a dry run (`dry_run=true` appended): it exits 0 and lists the arms;
- checked structurally, where running it needs a package install, a GPU, a network, a server or minutes:
  the script it names exists (and knows its sub-command), every Hydra override names an existing config
  group and option (or a `my_*` placeholder the page asks the reader to create) and an existing key, a
  `python -m` module exists, and our own CLIs know every `--option` given.

Runs write only under a temporary folder (tracking store, reports, Hydra's sweep and run dirs).
Also: every relative link of README.md and docs/*.md points at an existing file (and heading), and the
README stays a first-day page (under 150 lines, the two set-up commands verbatim).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import warm

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "console"}
SETUP_COMMANDS = (
    "pip install -e . && python -m orchestrator",
    "pip install -e '.[test]' && python -m pytest",
)
README_MAX_LINES = 150
# a rehearsal's thousands of studies are its point, not the docs': a few show the command works
REHEARSED_STUDIES = 2
# scripts that only read the source tree, in about a second
CHEAP_SCRIPTS = {"scripts/import_graph.py"}
# tools outside our package that the docs call, and the Python package that provides each (None: the OS)
TOOLS = {"mlflow": "mlflow", "ray": "ray", "ssh": None}
# a value the page asks the reader to create (`cluster=my_cluster` after "copy conf/cluster/ssh_local.yaml")
PLACEHOLDER = re.compile(r"^my_\w+$")
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class DocCommand:
    file: str  # relative to the repo root
    line: int  # where the command starts
    text: str  # as written, continuations joined

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def fenced_shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) for each command of the shell fences of one Markdown file."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    pending: tuple[int, str] | None = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence not in SHELL_FENCES:
            continue
        if pending is not None:
            start, text = pending
            text = text + " " + stripped
        elif fence == "console":
            if not stripped.startswith("$ "):
                continue  # the command's output
            start, text = number, stripped[2:]
        else:
            if not stripped or stripped.startswith("#"):
                continue
            start, text = number, stripped
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        out.append((start, text))
    return out


def doc_commands() -> list[DocCommand]:
    """Every command of the docs, `a && b` split into its parts."""
    commands = []
    for path in DOC_FILES:
        for line, text in fenced_shell_lines(path):
            for part in re.split(r"\s+&&\s+", text):
                commands.append(DocCommand(str(path.relative_to(ROOT)), line, part.strip()))
    return commands


# --- what a command is -------------------------------------------------------------------------------


def python_module(words: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `python -m MODULE ...`, else None."""
    if len(words) >= 3 and words[0] == "python" and words[1] == "-m":
        return words[2], words[3:]
    return None


def is_install(words: list[str]) -> bool:
    return words[:2] == ["pip", "install"] or words[:4] == ["python", "-m", "pip", "install"]


def asks_help(words: list[str]) -> bool:
    return "--help" in words or "-h" in words


def needs_outside(args: list[str]) -> bool:
    """A study that reaches past this machine's embedded default: a cluster or file the reader makes, a
    shell variable set by an earlier line, the real engine's host checks, a server elsewhere."""
    for arg in args:
        _, _, value = arg.partition("=")
        if any(PLACEHOLDER.match(v) for v in value.split(",")) or "$" in arg:
            return True
        if arg == "preflight_only=true" or value.startswith(("http://", "https://")):
            return True
        if arg.startswith("hydra.launcher.ray.init.address="):
            return True
    return False


def script_path(words: list[str]) -> str | None:
    """The repo file a command runs: `scripts/x.sh ...`, `bash x`, `python bench/x.py`, or the command
    inside `eval "$(...)"` / `NAME=$(...)`."""
    inner = re.fullmatch(r"(?:eval\s+|\w+=)?\$\((.*)\)", " ".join(words))
    if inner:
        words = shlex.split(inner.group(1))
    if words and words[0] in ("bash", "sh", "python") and len(words) > 1 and not words[1].startswith("-"):
        words = words[1:]
    if words and "/" in words[0] and not words[0].startswith(("/", "-")):
        return words[0]
    return None


def is_orchestrator(words: list[str]) -> bool:
    found = python_module(words)
    return found is not None and found[0] == "orchestrator"


# Each class: (name, does it apply, how it is exercised). Exactly one applies to every doc command.
def _help(words: list[str]) -> bool:
    return python_module(words) is not None and asks_help(words) and not is_install(words)


def _dry_run_as_written(words: list[str]) -> bool:
    return is_orchestrator(words) and "dry_run=true" in words and not asks_help(words)


def _rehearsal(words: list[str]) -> bool:
    found = python_module(words)
    return found is not None and found[0] == "orchestrator.study.rehearse" and not asks_help(words)


def _study_as_dry_run(words: list[str]) -> bool:
    args = words[3:]
    return (
        is_orchestrator(words)
        and "dry_run=true" not in args
        and not asks_help(words)
        and not needs_outside(args)
    )


def _study_structural(words: list[str]) -> bool:
    args = words[3:]
    return (
        is_orchestrator(words) and "dry_run=true" not in args and not asks_help(words) and needs_outside(args)
    )


def _module_structural(words: list[str]) -> bool:
    found = python_module(words)
    return (
        found is not None
        and found[0] not in ("orchestrator", "orchestrator.study.rehearse")
        and not asks_help(words)
        and not is_install(words)
    )


def _cheap_script(words: list[str]) -> bool:
    return python_module(words) is None and script_path(words) in CHEAP_SCRIPTS


def _script_structural(words: list[str]) -> bool:
    path = script_path(words)
    return python_module(words) is None and path is not None and path not in CHEAP_SCRIPTS


def _install(words: list[str]) -> bool:
    return is_install(words)


def _tool(words: list[str]) -> bool:
    return bool(words) and words[0] in TOOLS


# --- structural checks -------------------------------------------------------------------------------


def cli_help(*argv: str) -> str:
    done = run_module(argv)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@functools.cache
def config_groups() -> dict[str, set[str]]:
    """Every config group the app composes from and its options: the app's own from the shipped conf/ (as
    the command line's checks read them, `config.catalog`), Hydra's as `--hydra-help` lists them, and
    `experiment` from experiments/."""
    from orchestrator.config.catalog import SHIPPED_CONF, option_files

    groups: dict[str, set[str]] = {"experiment": {p.stem for p in (ROOT / "experiments").glob("*.yaml")}}
    for folder in sorted(p for p in SHIPPED_CONF.rglob("*") if p.is_dir()):
        group = folder.relative_to(SHIPPED_CONF).as_posix()
        if options := option_files(group):
            groups[group] = set(options)
    text = cli_help("-m", "orchestrator", "--hydra-help")
    listing = text.split("== Configuration groups ==", 1)[1].split("== Config", 1)[0]
    for line in listing.splitlines():
        match = re.fullmatch(r"([\w/]+): (.+)", line.strip())
        if match:
            groups[match.group(1)] = {o.strip() for o in match.group(2).split(",")}
    return groups


@functools.cache
def top_level_keys() -> set[str]:
    """The primary config's top-level keys (as `--cfg job` prints it), its groups', and `hydra`."""
    config = cli_help("-m", "orchestrator", "--cfg", "job")
    keys = {m.group(1) for m in re.finditer(r"^(\w+):", config, re.MULTILINE)}
    return keys | {group.split("/")[0] for group in config_groups()} | {"hydra"}


def check_hydra_overrides(args: list[str]) -> None:
    """Every override names an existing group and option, or an existing top-level key."""
    groups = config_groups()
    for arg in args:
        if arg in ("-m", "--multirun"):
            continue
        key, sep, value = arg.lstrip("+").partition("=")
        assert sep, f"{arg!r} is not a Hydra override"
        if key in groups or "/" in key:
            assert key in groups, f"{arg}: no config group {key!r} (groups: {sorted(groups)})"
            for option in value.split(","):
                assert option in groups[key] or PLACEHOLDER.match(option), (
                    f"{arg}: group {key!r} has no option {option!r} (options: {sorted(groups[key])})"
                )
        else:
            first = key.split(".")[0]
            assert first in top_level_keys(), f"{arg}: no config key {first!r}"


def our_module_file(module: str) -> Path | None:
    """The file `python -m module` runs, for a module of this repo; None for another package's."""
    parts = module.split(".")
    if parts[0] not in ("orchestrator", "hydra_plugins"):
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base / "__main__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return base / "__main__.py"  # missing: the assertion names it


def check_module(module: str, args: list[str]) -> None:
    """The module runs with `python -m`; our own CLIs know every `--option` given; pytest's paths and
    markers exist."""
    ours = our_module_file(module)
    if ours is not None:
        assert ours.is_file(), f"python -m {module}: no {ours.relative_to(ROOT)}"
        usage = cli_help("-m", module, "--help")
        for arg in args:
            if arg.startswith("--"):
                option = arg.split("=", 1)[0]
                assert option in usage, f"python -m {module} has no option {option} (its --help)"
        return
    assert importlib.util.find_spec(module) is not None, f"python -m {module}: the module is not installed"
    if module == "pytest":
        markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
        declared = {m.split(":")[0] for m in markers["markers"]}
        words = iter(args)
        for arg in words:
            if arg == "-m":
                expression = next(words)
                named = set(re.findall(r"\w+", expression)) - {"not", "and", "or"}
                assert named <= declared, f"pytest -m {expression!r}: undeclared marker(s) {named - declared}"
            elif arg == "-n":
                next(words)
            elif not arg.startswith("-"):
                assert (ROOT / arg).exists(), f"pytest {arg}: no such path"


def check_script(words: list[str]) -> None:
    """The script exists, and the sub-command it is given (a plain word) is one it handles."""
    path = script_path(words)
    assert path is not None
    assert (ROOT / path).is_file(), f"{path}: no such file"
    inner = re.fullmatch(r"(?:eval\s+|\w+=)?\$\((.*)\)", " ".join(words))
    rest = shlex.split(inner.group(1)) if inner else words
    rest = rest[rest.index(path) + 1 :]
    if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
        assert re.search(rf"\b{re.escape(rest[0])}\b", (ROOT / path).read_text()), (
            f"{path} does not handle {rest[0]!r}"
        )


def check_install(words: list[str]) -> None:
    """`pip install -e .` or `.[extras]` of this repo, with extras that pyproject.toml declares."""
    target = words[-1]
    match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
    assert match, f"pip install {target}: the docs install this repo (`.` or `.[extra]`)"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in (match.group(1) or "").split(","):
        assert not extra or extra in extras, f"pip install {target}: no extra {extra!r} in pyproject.toml"


def check_tool(words: list[str]) -> None:
    package = TOOLS[words[0]]
    if package is not None:
        assert importlib.util.find_spec(package) is not None, f"{words[0]}: {package} is not installed"


# --- runs --------------------------------------------------------------------------------------------


@functools.cache
def run_module(argv: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    """`python *argv` (`-m MODULE ...`) in the repo root, forked from the warm zygote where it can be
    (tests/warm.py: a cold start spends ~3.5 s of a ~5 s dry run importing). Pages repeat their key
    commands (the README's, again where a page explains them): each runs once per worker, and
    `xdist_group` sends the repeats to one worker."""
    assert argv[0] == "-m"
    return warm.run(
        [sys.executable, *argv], cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip


def run_python(argv: list[str]) -> subprocess.CompletedProcess[str]:
    if argv[0] == "-m":
        done = run_module(tuple(argv))
    else:
        done = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def away_from_the_repo(tmp: Path) -> list[str]:
    """Overrides that send everything a run writes under tmp."""
    return [
        f"tracking.uri=sqlite:///{tmp}/mlruns.db",
        f"report.dir={tmp}/reports",
        f"hydra.sweep.dir={tmp}/multirun",
        f"hydra.run.dir={tmp}/outputs",
    ]


def run_help(words: list[str], tmp: Path) -> None:
    assert run_python(words[1:]).stdout.strip()


def run_dry(words: list[str], tmp: Path) -> None:
    """The study's dry run (given, or appended): exit 0, every arm listed."""
    args = words[1:] if "dry_run=true" in words else [*words[1:], "dry_run=true"]
    done = run_python([*args, *away_from_the_repo(tmp)])
    output = done.stdout + done.stderr
    assert re.search(r"\b\d+ arm\(s\), \d+ job\(s\)", output), f"no arms listed:\n{output[-3000:]}"


def run_rehearsal(words: list[str], tmp: Path) -> None:
    args = [w for w in words[1:] if not w.startswith("rehearse.studies=")]
    done = run_python([*args, f"rehearse.studies={REHEARSED_STUDIES}", *away_from_the_repo(tmp)])
    assert "rehearsed studies" in done.stdout or "sessions per study" in done.stdout, done.stdout[-3000:]


def run_script(words: list[str], tmp: Path) -> None:
    run_python(words[1:])


def structural_study(words: list[str], tmp: Path) -> None:
    check_hydra_overrides(words[3:])


def structural_module(words: list[str], tmp: Path) -> None:
    module, args = python_module(words)  # type: ignore[misc]
    check_module(module, args)


CLASSES: dict[str, tuple[Callable[[list[str]], bool], Callable[[list[str], Path], None]]] = {
    "run: --help": (_help, run_help),
    "run: dry run as written": (_dry_run_as_written, run_dry),
    "run: rehearsal, a few studies": (_rehearsal, run_rehearsal),
    "run: read-only script": (_cheap_script, run_script),
    "dry run of a study": (_study_as_dry_run, run_dry),
    "structural: study needing more than this machine": (_study_structural, structural_study),
    "structural: python -m module": (_module_structural, structural_module),
    "structural: script": (_script_structural, lambda words, tmp: check_script(words)),
    "structural: install": (_install, lambda words, tmp: check_install(words)),
    "structural: external tool": (_tool, lambda words, tmp: check_tool(words)),
}


def classes_of(command: DocCommand) -> list[str]:
    return [name for name, (applies, _) in CLASSES.items() if applies(command.words)]


COMMANDS = doc_commands()


def same_run(command: DocCommand) -> str:
    """One name for the commands that run the same thing (`X` and `X dry_run=true` both dry-run X)."""
    words = [w for w in command.words if w != "dry_run=true"]
    return "docs-" + hashlib.sha1(" ".join(words).encode()).hexdigest()[:8]


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every run of this module writes (one per worker, so the cached runs agree on it)."""
    return tmp_path_factory.mktemp("doc-runs")


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.xdist_group(same_run(c))) for c in COMMANDS],
    ids=[f"{c.file}:{c.line}:{' '.join(c.words[:5])}" for c in COMMANDS],
)
def test_doc_command(command: DocCommand, run_dir: Path) -> None:
    found = classes_of(command)
    assert found, f"{command}\nmatches no rule of tests/test_docs.py: add one, so it is exercised"
    assert len(found) == 1, f"{command}\nmatches several rules: {found}"
    _, exercise = CLASSES[found[0]]
    exercise(command.words, run_dir)


# --- links and the README's shape --------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def prose_lines(path: Path, keep_code: bool = False) -> list[tuple[int, str]]:
    """The lines outside fenced blocks, inline code removed (a link inside code is not a link), or with
    `keep_code` only its backticks (a heading's anchor keeps the code's text, as GitHub makes it)."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((number, line.replace("`", "") if keep_code else re.sub(r"`[^`]*`", "", line)))
    return out


def anchors(path: Path) -> set[str]:
    return {github_anchor(line.lstrip("#")) for _, line in prose_lines(path, True) if line.startswith("#")}


def test_a_headings_anchor_keeps_its_inline_code_as_github_does(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n\n## A pool (`bench_pool.py`, `pool_phases.py`)\n\n```\n# not a heading\n```\n")
    assert anchors(doc) == {"top", "a-pool-bench_poolpy-pool_phasespy"}


LINKS = [
    (str(path.relative_to(ROOT)), number, target)
    for path in DOC_FILES
    for number, line in prose_lines(path)
    for target in LINK.findall(line)
    if not re.match(r"^[a-z]+:", target)  # http:, https:, mailto:
]


@pytest.mark.parametrize(("file", "line", "target"), LINKS, ids=[f"{f}:{n}:{t}" for f, n, t in LINKS])
def test_relative_link_points_at_an_existing_file(file: str, line: int, target: str) -> None:
    source = ROOT / file
    path, _, anchor = target.partition("#")
    linked = (source.parent / path).resolve() if path else source
    assert linked.exists(), f"{file}:{line}: {target} -> no such file {linked}"
    if anchor and linked.suffix == ".md":
        assert anchor in anchors(linked), f"{file}:{line}: {target} -> no heading #{anchor} in {linked.name}"


def test_readme_is_a_first_day_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") < README_MAX_LINES, f"README.md has {text.count(chr(10))} lines (wc -l)"
    lines = text.splitlines()
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md lost the set-up command, verbatim: {command}"


def test_the_extractor_reads_console_blocks_and_continuations(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```console\n$ python -m orchestrator --help\noutput line\n```\n"
        "```bash\n# a comment\npython -m orchestrator -m a=1 \\\n  b=2   # why\n```\n"
        "```yaml\nnot: a command\n```\n"
    )
    assert fenced_shell_lines(page) == [
        (2, "python -m orchestrator --help"),
        (7, "python -m orchestrator -m a=1 b=2   # why"),
    ]
