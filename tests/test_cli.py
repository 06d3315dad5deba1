"""The command itself, as a new user meets it: `--help` says what it does and lists what exists, and a
wrong option of any config group is refused before Hydra composes, naming what is accepted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.help import experiment_summary, one_line
from tests import warm
from tests.conftest import orchestrator_argv

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = sorted(p.stem for p in (REPO / "experiments").glob("*.yaml"))
FACTORS = {
    d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted((REPO / "conf" / "factor").iterdir())
}


def heisenhunt(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m orchestrator ARGS` in `cwd`, its MLflow store and sweep folder there too (flags first:
    Hydra's parser takes no flag after the overrides)."""
    argv = orchestrator_argv(cwd, *args, tracking_uri=f"sqlite:///{cwd}/m.db", local_cluster=False)
    return warm.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)


def user_conf(root: Path) -> str:
    """A folder of the user's own: a level `turbo` of factor capture and a study `mine`; its override."""
    (root / "factor" / "capture").mkdir(parents=True)
    (root / "factor" / "capture" / "turbo.yaml").write_text(
        'level: turbo\nroles:\n  decode: {env: {SGLANG_HH_TURBO: "1"}}\n'
    )
    (root / "experiment").mkdir()
    (root / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n# My own study of the turbo capture.\nstudy:\n  name: mine\n"
    )
    return f"hydra.searchpath=[pkg://orchestrator.studies,file://{root}]"


# --- --help ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def help_page(tmp_path_factory: pytest.TempPathFactory) -> str:
    proc = heisenhunt(tmp_path_factory.mktemp("help"), "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_help_is_short_and_says_what_the_command_does(help_page):
    lines = help_page.splitlines()
    assert len(lines) <= 60, len(lines)
    assert max(len(line) for line in lines) <= 100
    assert "LLM-serving heisenbug" in lines[0] and "MLflow" in help_page
    assert "schema_" not in help_page  # Hydra's page lists the schema nodes as options


def test_help_lists_every_shipped_study_with_a_description(help_page):
    assert len(EXPERIMENTS) >= 8
    rows = {
        line.split()[0]: line for line in help_page.splitlines() if line.startswith("  ") and line.split()
    }
    for name in EXPERIMENTS:
        assert name in rows, name
        assert len(rows[name].split()) > 2 and "(no description)" not in rows[name], rows[name]
    assert "The original DeepSeek-V4 PD corruption hunt" in rows["dsv4_corruption"]


def test_help_lists_every_factor_with_its_levels_and_the_default_baseline(help_page):
    lines = help_page.splitlines()
    for factor, levels in FACTORS.items():
        assert any(line.split()[:1] == [factor] and ", ".join(levels) in line for line in lines), factor
    assert "baseline: capture=graph index_k=bf16 multi_stream=on hicache=on" in help_page


@pytest.mark.parametrize(
    "option",
    ["-m", "+experiment=NAME", "dry_run=true", "preflight_only=true", "resume=true", "tracking.uri=",
     "report.dir=", "cluster=", "cluster_pool=", "hydra/launcher=heisenhunt_ray",
     "hydra.sweeper.design=sequential|ddmin", "docs/", "--hydra-help"],
)  # fmt: skip
def test_help_names_the_options_people_set(help_page, option):
    assert option in help_page


def test_h_follows_the_command_lines_searchpath(tmp_path):
    searchpath = user_conf(tmp_path / "mine")
    proc = heisenhunt(tmp_path, "-h", searchpath)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eager, graph, turbo" in proc.stdout
    assert any(line.split()[:2] == ["mine", "My"] for line in proc.stdout.splitlines()), proc.stdout
    assert "dsv4_corruption" in proc.stdout  # the shipped studies too: pkg://orchestrator.studies is listed


def test_hydra_help_is_still_hydras(tmp_path):
    # alone: Hydra's help composes Hydra's config only, where an app key (tracking.uri=) is unknown
    argv = [sys.executable, "-m", "orchestrator", "--hydra-help"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Hydra (1.3" in proc.stdout and "== Flags ==" in proc.stdout


# --- a wrong option of a config group ------------------------------------------------------------------


def _accepted(folder: Path) -> str:
    return "[" + ", ".join(sorted(p.stem for p in folder.glob("*.yaml"))) + "]"


CAPTURE = ("factor/capture: unknown level 'nosuch'", "accepted levels: [eager, graph]")
WRONG = {
    "level": ("factor/capture=nosuch", *CAPTURE),
    "level in a sweep": ("factor/capture=graph,nosuch", *CAPTURE),
    "experiment": (
        "+experiment=nosuch", "experiment: unknown experiment 'nosuch'",
        f"accepted experiments: {_accepted(REPO / 'experiments')}",
    ),
    **{
        group: (f"{group}=nosuch", f"{group}: unknown option 'nosuch'",
                f"accepted options: {_accepted(REPO / 'conf' / group)}")
        for group in ("cluster", "deployment", "tracking", "workload", "cluster_pool")
    },
}  # fmt: skip


@pytest.mark.parametrize("override,names,accepts", list(WRONG.values()), ids=list(WRONG))
def test_a_wrong_option_is_refused_naming_the_accepted_ones_and_starts_nothing(
    tmp_path, override, names, accepts
):
    proc = heisenhunt(tmp_path, "-m", override)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"{names}; {accepts}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Config search path" not in proc.stderr
    # refused before Hydra: no MLflow store, no sweep folder, no report, nothing at all in the directory
    assert list(tmp_path.iterdir()) == []


def test_a_level_and_a_study_on_the_users_searchpath_are_accepted(tmp_path):
    searchpath = user_conf(tmp_path / "mine")
    proc = heisenhunt(tmp_path, "-m", searchpath, "factor/capture=graph,turbo", "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "arm capture=turbo" in proc.stdout and "SGLANG_HH_TURBO=1" in proc.stdout
    proc = heisenhunt(tmp_path, "-m", searchpath, "+experiment=mine", "dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dry run of study mine" in proc.stdout
    # the control: without the searchpath, the same level is refused
    proc = heisenhunt(tmp_path, "-m", "factor/capture=graph,turbo", "dry_run=true")
    assert proc.returncode == 2 and "unknown level 'turbo'" in proc.stderr, proc.stderr[-3000:]


def test_a_searchpath_that_drops_the_shipped_studies_is_refused_saying_how_to_keep_them(tmp_path):
    """Hydra replaces the config's hydra.searchpath with the command line's; it then reads
    `+experiment=dsv4_corruption` as a plain new key and runs the default study instead, saying nothing."""
    (tmp_path / "mine").mkdir()
    proc = heisenhunt(
        tmp_path, "-m", f"hydra.searchpath=[file://{tmp_path}/mine]", "+experiment=dsv4_corruption"
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "experiment: unknown experiment 'dsv4_corruption'; accepted experiments: []" in proc.stderr
    assert f"hydra.searchpath=[pkg://orchestrator.studies,file://{tmp_path}/mine]" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# --- the one-line descriptions ---------------------------------------------------------------------------


def test_a_long_description_is_cut_at_a_clause_that_fits_else_at_a_word():
    text = "The dsv4 hunt as a sequential study: the same arms, run in rounds until the evidence decides."
    assert one_line(text, 200) == text.rstrip(".")
    assert one_line(text, 60) == "The dsv4 hunt as a sequential study"
    assert one_line("A (b: c, d) eeeeeeeeeeeeeeeeeeeeeeeeeeee", 20) == "A (b: c, d)…"
    assert one_line("First sentence. Second one.", 100) == "First sentence"


def test_a_study_without_a_leading_comment_is_described_by_its_study_description():
    text = "# @package _global_\nstudy:\n  description: >-\n    Does X need Y?\n    More.\n"
    assert experiment_summary(text, 80) == "Does X need Y?"
    commented = "# @package _global_\n# The hunt, in rounds.\n# Run: python -m orchestrator\n" + text[20:]
    assert experiment_summary(commented, 80) == "The hunt, in rounds"
