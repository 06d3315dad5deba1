"""The package's shape, read from its source: no import cycles (lazy imports inside functions count), and
the modules past the Hydra edge never see Hydra's config objects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "hydra_plugins")
# these take typed values (schema, plan.ArmPlan) only
PAST_THE_EDGE = ("deploy", "preflight", "tracking", "report", "plan", "schema", "analysis", "arm")


def module_files() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if p != ROOT):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The package modules `module` imports, anywhere in its file (top level or inside functions)."""
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = ".".join(base[: len(base) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (parent, node.module or "") if p)
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {module: imports_of(path, module, known) for module, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_it_is_shown():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_imports_inside_functions():
    graph = import_graph()
    # orchestrator.callbacks imports the analysis inside build_report
    assert "orchestrator.analysis" in graph["orchestrator.callbacks"]
    assert "orchestrator.plan" in graph["orchestrator.config"]


def test_no_import_cycles_in_the_package():
    assert find_cycle(import_graph()) is None


@pytest.mark.parametrize("name", PAST_THE_EDGE)
def test_modules_past_the_edge_take_no_hydra_config(name):
    files = module_files()
    module = f"orchestrator.{name}"
    source = files[module].read_text()
    tree = ast.parse(source)
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("omegaconf", "hydra")}, module
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "DictConfig" not in names, module
