"""The package's shape, read from its source (scripts/import_graph.py, the one definition of the import
graph): the wings import each other only in the directions stated here, no import cycles (lazy imports
inside functions count), and the modules past the Hydra edge never see Hydra's config objects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import script_module

ROOT = Path(__file__).resolve().parents[1]
graph_script = script_module("scripts/import_graph.py", "import_graph")
find_cycle, import_graph, module_files = (
    graph_script.find_cycle,
    graph_script.import_graph,
    graph_script.module_files,
)
room_graph, arrows_back_up = graph_script.room_graph, graph_script.arrows_back_up

# Which wing may import which (bottom first). Anything not listed is refused, so a new arrow is a decision
# written here, not an accident.
ALLOWED = {
    "workload": set(),  # the load and what it measures: imports nothing else of ours
    "config": {"workload"},  # an arm typed, checked and planned (knows the workload's oracle and tools)
    "remote": {"config"},  # transports: shell quoting from config
    "sim": {"workload"},  # the embedded default's servers
    "analysis": {"config", "workload"},  # pure statistics over runs
    "tracking": {"analysis", "config", "workload"},  # MLflow: the analysis' types only (below)
    "study": {"analysis", "config", "sim", "workload"},  # designs, sweep, rehearsal
    "run": {"config", "remote", "tracking", "workload"},  # one arm's side effects
    "report": {"analysis", "config", "run", "study", "tracking", "workload"},
    "gpu": {"analysis", "run", "sim", "workload"},
    "studies": set(),
    "arm": {"analysis", "config", "remote", "run", "tracking", "workload"},  # the lifecycle
}
TOP = {"__main__"}  # the edge: may import any wing
PLUGINS_MAY_NOT = {"__main__"}
# tracking reads and writes the analysis' records; it never runs the analysis' logic
TRACKING_MAY_IMPORT_FROM_ANALYSIS = {
    "orchestrator.analysis.runs",
    "orchestrator.analysis.result",
    "orchestrator.analysis.stats",
}
# these take typed values (config.schema, config.plan.ArmPlan) only
PAST_THE_EDGE = (
    "orchestrator.run.deploy",
    "orchestrator.run.preflight",
    "orchestrator.tracking",
    "orchestrator.report.render",
    "orchestrator.report.plots",
    "orchestrator.config.plan",
    "orchestrator.config.schema",
    "orchestrator.analysis",
    "orchestrator.arm",
)


def wing(room: str) -> str:
    return room.split(".", 1)[1] if room.startswith("orchestrator.") else room


def test_every_wing_imports_only_the_wings_it_may():
    wrong = []
    for room, targets in room_graph(import_graph()).items():
        if room.startswith("hydra_plugins."):
            wrong += [f"{room} -> {t}" for t in targets if wing(t) in PLUGINS_MAY_NOT]
            continue
        here = wing(room)
        if here in TOP:
            continue
        assert here in ALLOWED, f"{room}: a new wing; say in ALLOWED which wings it may import"
        wrong += [f"{room} -> {t}" for t in targets if wing(t) not in ALLOWED[here]]
    assert not wrong, wrong


def test_the_rule_is_checked_against_a_graph_that_breaks_it():
    # an arrow back up (the analysis importing the report) is seen as one, and named
    rooms = {
        "orchestrator.analysis": {"orchestrator.report"},
        "orchestrator.report": {"orchestrator.analysis"},
    }
    assert arrows_back_up(rooms) == [
        ("orchestrator.analysis", "orchestrator.report"),
        ("orchestrator.report", "orchestrator.analysis"),
    ]
    assert "report" not in ALLOWED["analysis"]


def test_no_arrow_runs_back_up():
    assert arrows_back_up(room_graph(import_graph())) == []


def test_tracking_takes_the_analysis_types_not_its_logic():
    graph = import_graph()
    used = {t for m, ts in graph.items() if m.startswith("orchestrator.tracking") for t in ts}
    from_analysis = {t for t in used if t.startswith("orchestrator.analysis")}
    assert from_analysis <= TRACKING_MAY_IMPORT_FROM_ANALYSIS, from_analysis


def test_the_two_first_files_to_read_sit_at_the_top():
    flat = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py")
    assert flat == ["__main__.py", "arm.py"]


def test_the_cycle_finder_finds_a_cycle_it_is_shown():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_imports_inside_functions():
    graph = import_graph()
    # the report's pipeline imports the tracking reader inside study_result
    assert "orchestrator.tracking.read" in graph["orchestrator.report.pipeline"]
    assert "orchestrator.config.checks" in graph["orchestrator.config.load"]


def test_no_import_cycles_in_the_package():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize(
    "module",
    [m for m in sorted(module_files()) if any(m == e or m.startswith(e + ".") for e in PAST_THE_EDGE)],
)
def test_modules_past_the_edge_take_no_hydra_config(module):
    source = module_files()[module].read_text()
    tree = ast.parse(source)
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("omegaconf", "hydra")}, module
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "DictConfig" not in names, module
