#!/usr/bin/env python
"""The package's shape, measured: rooms, arrows between them, arrows running back up, and the longest walk
of the Hydra config.

    python scripts/import_graph.py           # the static table (rooms, arrows, arrows back up)
    python scripts/import_graph.py --walk    # also the config's walks, traced through the main job

Definitions (the same before and after a reorganisation, so the two tables compare):
- a *module* is a .py file of `orchestrator/` or `hydra_plugins/`; its imports count wherever they sit
  (top level or inside a function);
- a *room* is what a newcomer sees at the top of a package: a sub-package (`orchestrator/analysis/`) or a
  flat module (`orchestrator/run/deploy.py`); each Hydra plugin package is one room;
- an *arrow* is a pair of rooms where a module of the first imports one of the second;
- an arrow *runs back up* when it lies on a cycle of rooms (the two rooms reach each other), i.e. no
  layering of the rooms puts every arrow in one direction;
- the *walk of the Hydra config* is traced through the main job on the embedded default (`python -m
  orchestrator`, shortened: 6 arms of 4 sessions): every call of a project function that receives the
  config is a step. Two walks: the *whole config* (Hydra's `DictConfig` or the typed `JobConf`), and *any
  node* of it (also a `StudyConf`, a `HostConf`, a `StressConf`...). *Files entered* counts the distinct
  files of a walk's steps; a *climb back up* is a step whose caller holding the config is in another file
  than the step just before it (the reader returned up the stack, out of that file, and went down again
  into a third); each pair of files counts once, so the figure does not grow with the number of arms.

This file is the one definition of the import graph: tests/test_architecture.py loads it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PACKAGES = ("orchestrator", "hydra_plugins")


def module_files(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if p != root):
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
    known = set(files)
    return {module: imports_of(path, module, known) for module, path in files.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
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


def room_of(module: str) -> str:
    """`orchestrator.analysis.stats` -> `orchestrator.analysis`; a flat module is its own room."""
    parts = module.split(".")
    if parts[0] == "hydra_plugins":
        return ".".join(parts[:2])
    return ".".join(parts[:2])


def room_graph(graph: Mapping[str, Iterable[str]]) -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module in PACKAGES:
            continue
        here = room_of(module)
        rooms.setdefault(here, set())
        for target in targets:
            if target in PACKAGES:
                continue
            there = room_of(target)
            if there != here:
                rooms[here].add(there)
    return rooms


def reachable(graph: Mapping[str, Iterable[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def arrows_back_up(rooms: Mapping[str, Iterable[str]]) -> list[tuple[str, str]]:
    """The arrows on a cycle of rooms: a -> b where b also reaches a."""
    return sorted((a, b) for a, targets in rooms.items() for b in targets if a in reachable(rooms, b))


def shape(root: Path = ROOT) -> dict[str, object]:
    graph = import_graph(root)
    rooms = room_graph(graph)
    return {
        "modules": len([m for m in graph if m not in PACKAGES]),
        "flat modules in orchestrator/": sum(
            1 for m, p in module_files(root).items() if m.count(".") == 1 and p.parent.name == "orchestrator"
        ),
        "rooms": len(rooms),
        "arrows": sum(len(t) for t in rooms.values()),
        "arrows back up": len(arrows_back_up(rooms)),
    }


# --- the walk of the config, traced through one real arm ------------------------------------------------


class Walk:
    """The steps of one walk: project calls whose arguments hold what `holds` accepts."""

    def __init__(self, holds) -> None:
        self.holds = holds
        self.steps: list[tuple[int | None, str]] = []  # (the caller step's index, file)
        self.holding: dict[int, tuple[object, int]] = {}  # id(frame) -> (frame, step index)

    def called(self, frame, values: list[object]) -> None:
        if not any(self.holds(v) for v in values):
            return
        caller = frame.f_back
        while caller is not None and self.holding.get(id(caller), (None,))[0] is not caller:
            caller = caller.f_back
        parent = self.holding[id(caller)][1] if caller is not None else None
        self.holding[id(frame)] = (frame, len(self.steps))
        self.steps.append((parent, frame.f_code.co_filename))

    def figures(self) -> dict[str, object]:
        steps = self.steps
        climbs = {
            (steps[i - 1][1], file)
            for i, (parent, file) in enumerate(steps)
            if i and parent is not None and parent != i - 1 and steps[parent][1] != steps[i - 1][1] != file
        }
        files = sorted({Path(file).resolve() for _parent, file in steps})
        return {
            "steps": len(steps),
            "files entered": len(files),
            "climbs back up": len(climbs),
            "files": files,
        }


def trace_config_walk(argv: list[str]) -> dict[str, dict[str, object]]:
    """Run `python -m orchestrator <argv>` in this process and record every project call that receives the
    job's config (see the module docstring): `any node` counts every typed node of it (a StudyConf, a
    HostConf...), `whole config` only Hydra's DictConfig and the typed JobConf."""
    import runpy
    import threading

    from omegaconf import DictConfig

    import orchestrator

    project = (
        str(ROOT / "orchestrator"),
        str(ROOT / "hydra_plugins"),
        str(Path(orchestrator.__file__).parent),
    )
    schema_modules = ("orchestrator.config.schema", "orchestrator.schema")  # after and before the wings

    def any_node(value: object) -> bool:
        return isinstance(value, DictConfig) or type(value).__module__ in schema_modules

    def whole(value: object) -> bool:
        return isinstance(value, DictConfig) or (
            type(value).__name__ == "JobConf" and type(value).__module__ in schema_modules
        )

    walks = {"any node": Walk(any_node), "whole config": Walk(whole)}

    def profile(frame, event, _arg):
        if event != "call" or not frame.f_code.co_filename.startswith(project):
            return
        code = frame.f_code
        values = [
            frame.f_locals.get(n) for n in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        ]
        for walk in walks.values():
            walk.called(frame, values)

    sys.argv = ["orchestrator", *argv]
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return {name: walk.figures() for name, walk in walks.items()}


def main(args: list[str]) -> None:
    for key, value in shape().items():
        print(f"{key:32s} {value}")
    if "--verbose" in args:
        for a, b in arrows_back_up(room_graph(import_graph())):
            print(f"  back up: {a} -> {b}")
    if "--walk" in args:
        walks = trace_config_walk(
            [
                "workload.sessions=4",
                "workload.concurrency=4",
                "bench.concurrency=[1]",
                "tracking.uri=sqlite:////tmp/walk.db",
                "report.dir=/tmp/walk-report",
                "hydra.run.dir=/tmp/walk-run",
                "hydra.sweep.dir=/tmp/walk-sweep",
            ]
        )
        for name, walk in walks.items():
            print(f"{'config walk (' + name + '): files entered':32s} {walk['files entered']}")
            print(f"{'config walk (' + name + '): climbs back up':32s} {walk['climbs back up']}")
            if "--verbose" in args:
                for file in walk["files"]:
                    print(f"  {Path(file).relative_to(ROOT) if Path(file).is_relative_to(ROOT) else file}")


if __name__ == "__main__":
    main(sys.argv[1:])
