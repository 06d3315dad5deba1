"""`heisenhunt --help`: what the command does, its studies, factors and levels, and the options people set.

Hydra's own page (`--hydra-help`, or Hydra's `--help` with its default template) lists every option of
every config group, the `schema_*` nodes included, and no study. This page is built from the same files
Hydra composes (experiments/ and conf/ plus the command line's `hydra.searchpath`), so a study or a level
of your own shows up as soon as Hydra would find it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

WIDTH = 100
# the config groups whose options the page lists on one line each (factors and experiments have their own)
OPTION_GROUPS = ("cluster", "cluster_pool", "deployment", "workload", "tracking")

ABOUT = """\
heisenhunt (python -m orchestrator): which configuration knob does an LLM-serving heisenbug need?
A study co-restarts the servers once per arm (one level per factor), drives a multi-turn stress
workload and a throughput sweep, records each run in MLflow and writes a report naming the cause."""

USAGE = """\
Usage: heisenhunt -m [+experiment=NAME] [factor/NAME=LEVEL[,LEVEL...]] [KEY=VALUE ...]
  With no experiment: the quick study on the embedded default (simulated SGLang PD on this machine)."""

OPTIONS = """\
Options:
  -m                              run the study's sweep (a multirun; also the config's default mode)
  +experiment=NAME                run a study listed above (or one on your hydra.searchpath)
  dry_run=true                    print every arm with its exact launch commands; start nothing
  preflight_only=true             check every arm on its server hosts; start nothing, record nothing
  resume=true                     skip the arms and repetitions already FINISHED in this study
  tracking.uri=URI                the MLflow store (default sqlite:///mlruns.db, in this directory)
  report.dir=DIR                  where the report goes (default reports/)
  cluster=NAME                    where the roles run (conf/cluster/)
  cluster_pool=NAME               a pool of clusters, each arm on a free one (conf/cluster_pool/)
  hydra/launcher=heisenhunt_ray   arms in parallel over the pool (pip install 'heisenhunt[ray]')
  hydra.sweeper.design=sequential|ddmin   rounds until the evidence decides | delta debugging
  hydra.searchpath=[file:///dir]  folders with your own factor/, experiment/, cluster/; replaces the
                                  config's pkg://orchestrator.studies (the studies above): give both"""

FOOTER = """\
Docs: README.md and docs/ in the repository. Every key of the composed config: --cfg job.
Hydra's own flags and help: --hydra-help."""

_SENTENCE_END = re.compile(r"(?<=[.?!])\s+(?=[A-Z\"(`])")


def first_sentence(text: str) -> str:
    """The first sentence of a paragraph, its line breaks and runs of spaces folded."""
    folded = " ".join(text.split())
    return _SENTENCE_END.split(folded, maxsplit=1)[0]


def _clause_ends(text: str, marks: str) -> list[int]:
    """Where a clause ends with one of `marks` and a space, outside brackets: the places to cut."""
    ends, depth = [], 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0 and ch in marks and text[i + 1 : i + 2] == " ":
            ends.append(i)
    return ends


def one_line(text: str, width: int) -> str:
    """A description's first sentence in at most `width` characters: cut at the end of a clause that fits
    (long enough to say something), else at a word, with an ellipsis."""
    sentence = first_sentence(text).rstrip(".")
    if len(sentence) <= width:
        return sentence
    for marks in (":;", ","):  # the strongest break first: "X: details" reads as X alone, "X, and" less so
        fitting = [end for end in _clause_ends(sentence, marks) if width // 3 <= end <= width]
        if fitting:
            return sentence[: fitting[-1]]
    return sentence[: width - 1].rsplit(" ", 1)[0] + "…"


def leading_comment(yaml_text: str) -> str:
    """The file's first comment paragraph (after `# @package`), up to its `Run:` line."""
    lines = []
    for line in yaml_text.splitlines():
        if not line.startswith("#"):
            break
        body = line.lstrip("#").strip()
        if body.startswith("@package"):
            continue
        if body.startswith("Run") or not body:
            break
        lines.append(body)
    return " ".join(lines)


def experiment_summary(yaml_text: str, width: int) -> str:
    """One line on a study: its file's leading comment, else its `study.description`."""
    import yaml

    text = leading_comment(yaml_text)
    if not text:
        try:
            data = yaml.safe_load(yaml_text) or {}
        except yaml.YAMLError:
            data = {}
        study = data.get("study") if isinstance(data, dict) else None
        text = str(study.get("description") or "") if isinstance(study, dict) else ""
    return one_line(text, width) if text else "(no description)"


def column_width(names: Sequence[str]) -> int:
    """The width of the name column: the longest name and two spaces."""
    return max([len(n) for n in names] + [10]) + 2


def help_text(
    experiments: Mapping[str, str],
    factors: Mapping[str, Sequence[str]],
    baseline: Mapping[str, str],
    groups: Mapping[str, Sequence[str]],
) -> str:
    """The page, from what exists: {experiment: one line}, {factor: levels}, the default's baseline
    {factor: level} and {config group: options}."""
    name_width = column_width([*experiments, *factors, *groups])
    studies = [f"  {name:<{name_width}}{line}" for name, line in experiments.items()]
    factor_lines = [
        f"  {name:<{name_width}}{', '.join(levels)}"
        + ("" if name in baseline else f"   (not in the default: +factor/{name}=LEVEL)")
        for name, levels in factors.items()
    ]
    base = " ".join(f"{factor}={level}" for factor, level in baseline.items())
    group_lines = [f"  {group:<{name_width}}{', '.join(options)}" for group, options in groups.items()]
    return "\n".join(
        [
            ABOUT,
            "",
            USAGE,
            "",
            "Studies (+experiment=NAME; experiments/ and experiment/ on your hydra.searchpath):",
            *(studies or ["  (none on this search path)"]),
            "",
            "Factors and their levels (factor/NAME=LEVEL; a sweep: factor/NAME=LEVEL,LEVEL):",
            *factor_lines,
            f"  The default's baseline: {base}",
            "  Your own factor: a folder factor/NAME/ with one LEVEL.yaml per level, on hydra.searchpath.",
            "",
            "Config groups (GROUP=OPTION):",
            *group_lines,
            "",
            OPTIONS,
            "",
            FOOTER,
        ]
    )


def command_help(args: Sequence[str]) -> str:
    """The page for this command line (its `hydra.searchpath`, if any, adds studies and levels)."""
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from orchestrator.config import catalog
    from orchestrator.config.argv import command_line_overrides, command_line_searchpath

    try:
        given = command_line_searchpath(command_line_overrides(args))
    except HydraException:
        given = None  # a help page still, from the config's own search path
    searchpath = catalog.effective_searchpath(given)
    files = catalog.option_files("experiment", searchpath)
    factors = catalog.discover_factor_levels(searchpath)
    groups = {g: list(catalog.option_files(g, searchpath)) for g in OPTION_GROUPS}
    width = WIDTH - 2 - column_width([*files, *factors, *groups])
    experiments = {name: experiment_summary(_read(path), width) for name, path in files.items()}
    study = OmegaConf.load(catalog.PRIMARY_CONFIG).study
    baseline = {str(k): str(v) for k, v in OmegaConf.to_container(study.baseline).items()}
    return help_text(experiments, factors, baseline, groups)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
