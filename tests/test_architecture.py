"""The package's shape, read from its source (scripts/import_graph.py, the one definition of the import
graph): the wings import each other only in the directions docs/architecture.md states, no import cycles
(lazy imports inside functions count), the modules past the Hydra edge never see Hydra's config objects,
and the doc's table of the wings lists every module of the package and none that does not exist."""

from __future__ import annotations

import ast
import re
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

DOC = ROOT / "docs" / "architecture.md"


def doc_rules(text: str) -> dict[str, set[str]]:
    """Which wing may import which, from the doc's lines `- `a -> b, c`: why` (`a -> (nothing)`: none)."""
    rules = {}
    for wing_name, targets in re.findall(r"^- `(\w+) -> ([^`]*)`", text, flags=re.MULTILINE):
        rules[wing_name] = set() if targets == "(nothing)" else {t.strip() for t in targets.split(",")}
    return rules


def doc_modules(text: str) -> set[str]:
    """The modules the doc's table of the wings lists: `| `orchestrator/run/` | deploy.py, ... | what |`."""
    table = text[text.index("## The wings") : text.index("### Which wing may import which")]
    listed = set()
    for folder, files in re.findall(r"^\| `([\w/]+)/` \| ([^|]+) \|", table, flags=re.MULTILINE):
        for name in (f.strip().strip("`") for f in files.split(",")):
            if not re.fullmatch(r"\w+\.py", name):
                raise ValueError(
                    f"{folder}/: {name!r} in docs/architecture.md's table is not a module's file name"
                )
            parts = [*folder.split("/"), name.removesuffix(".py")]
            listed.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return listed


def needs_a_row(path: Path) -> bool:
    """Every module but a package's `__init__.py` that holds only a docstring, imports and `__all__`."""
    if path.name != "__init__.py":
        return True
    for node in ast.parse(path.read_text()).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        all_names = isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]
        if not (docstring or all_names or isinstance(node, (ast.Import, ast.ImportFrom))):
            return True
    return False


# Which wing may import which: the doc's rule, read from it, so a new arrow is a decision written there,
# not an accident. Anything not listed is refused.
ALLOWED = doc_rules(DOC.read_text())
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


def test_the_doc_lists_every_module_of_the_package():
    listed = doc_modules(DOC.read_text())
    missing = sorted(m for m, path in module_files().items() if needs_a_row(path) and m not in listed)
    assert not missing, (
        f"docs/architecture.md's table of the wings does not list {missing}: add each to its wing's row, "
        f"with a few words on what it does"
    )


def test_the_doc_lists_no_module_that_does_not_exist():
    invented = sorted(doc_modules(DOC.read_text()) - set(module_files()))
    assert not invented, f"docs/architecture.md's table lists modules that do not exist: {invented}"


def test_the_doc_counts_the_modules_the_import_graph_counts():
    stated = re.search(r"The package has (\d+) modules", DOC.read_text())
    assert stated is not None, "docs/architecture.md no longer says how many modules the package has"
    counted = graph_script.shape()["modules"]  # what `python scripts/import_graph.py` prints
    assert int(stated.group(1)) == counted, (
        f"the package has {counted} modules: say so in docs/architecture.md"
    )


def test_the_doc_readers_read_what_they_are_shown():
    text = """## The wings
| wing | modules | what it is |
|---|---|---|
| `orchestrator/` | `__main__.py`, arm.py | the edge |
| `orchestrator/remote/` | `__init__.py`, ssh.py | hosts |
### Which wing may import which
- `remote -> config, workload`: transports
- `workload -> (nothing)`: the bottom
- `__main__.py` -> anything
"""
    assert doc_modules(text) == {
        "orchestrator.__main__",
        "orchestrator.arm",
        "orchestrator.remote",
        "orchestrator.remote.ssh",
    }
    assert doc_rules(text) == {"remote": {"config", "workload"}, "workload": set()}
    with pytest.raises(ValueError, match=r"'\.\.\.'"):
        doc_modules(text.replace("ssh.py |", "ssh.py, ... |"))


def test_the_doc_states_a_rule_for_every_wing_of_the_package():
    wings = {wing(room) for room in room_graph(import_graph()) if room.startswith("orchestrator.")}
    assert wings - TOP == set(ALLOWED), (
        "docs/architecture.md: a rule line for each wing, none for a wing gone"
    )


def test_a_package_init_with_code_of_its_own_needs_a_row(tmp_path):
    bare = tmp_path / "__init__.py"
    bare.write_text('"""Doc."""\nfrom x import y\n__all__ = ["y"]\n')
    assert not needs_a_row(bare)
    bare.write_text('"""Doc."""\ndef make():\n    pass\n')
    assert needs_a_row(bare)
    assert needs_a_row(tmp_path / "plain.py")


# The analysis returns typed results (orchestrator/analysis/result.py) from the start: a function that
# returns a dict of anything is JSON, and only these sit at that boundary (the schema's writer, an
# artifact's JSON read in, a ProblemRun's keyword arguments), beside the one free-key field of a typed row
# (a DifferenceRow's `sets`: role -> "flag --x" -> the flag's value, whatever YAML scalar it is)
JSON_BOUNDARY = {
    "ddmin.difference_settings",
    "result.json_schema",
    "result._schema",
    "result._object_schema",
    "result.report_schema",
    "divergence._output",
    "study._run_fields",
}


def untyped_dict_returns(source: str, module: str) -> set[str]:
    """`module.function` for each function of `source` whose return annotation holds a dict of `Any`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            returns = ast.unparse(node.returns)
            if re.search(r"\b[dD]ict\[[^\]]*\bAny\b", returns):
                found.add(f"{module}.{node.name}")
    return found


def test_the_analysis_returns_no_untyped_dict_but_at_the_json_boundary():
    found = set()
    for path in sorted((ROOT / "orchestrator" / "analysis").glob("*.py")):
        found |= untyped_dict_returns(path.read_text(), path.stem)
    assert found == JSON_BOUNDARY, (sorted(found - JSON_BOUNDARY), sorted(JSON_BOUNDARY - found))


def test_the_untyped_dict_finder_sees_one_in_a_nested_function_and_a_union():
    source = (
        "def f() -> int:\n"
        "    def g() -> dict[str, Any] | None: ...\n"
        "def h() -> list[Dict[str, Any]]: ...\n"
        "def k() -> dict[str, int]: ...\n"
    )
    assert untyped_dict_returns(source, "m") == {"m.g", "m.h"}
