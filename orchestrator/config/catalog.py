"""The factors that exist: every `factor/<name>/<level>` on the config search path, and the options of
the other config groups (`experiment`, `cluster`, ...) (reads Hydra's state and the disk; used for the
help page, messages and validation, never by the planner).

The shipped conf/ is always on the path; a job adds user folders with `hydra.searchpath=[file:///dir]`
or `pkg://package`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

SHIPPED_CONF = Path(__file__).resolve().parents[1] / "conf"
PRIMARY_CONFIG = SHIPPED_CONF / "config.yaml"
_HYDRA_LEVELS: dict[tuple[int, tuple[str, ...]], dict[str, list[str]]] = {}


def discover_factor_levels(searchpath: Sequence[str] = ()) -> dict[str, list[str]]:
    """{factor: [levels]} from Hydra's config search path (plus a job's `hydra.searchpath`) when Hydra is
    initialised, else from the shipped conf/factor and the given search path folders."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if GlobalHydra.instance().is_initialized():
        loader = GlobalHydra.instance().config_loader()
        # a sweep asks once per job: the answer only changes with the loader and the search path
        key = (id(loader), tuple(str(p) for p in searchpath))
        if key not in _HYDRA_LEVELS:
            # the job's own search path entries (user factor folders) are not in the loader's base path
            overrides = (
                ["hydra.searchpath=[" + ",".join(repr(str(p)) for p in searchpath) + "]"]
                if searchpath
                else []
            )
            groups = loader.get_group_options("factor", results_filter=ObjectType.GROUP, overrides=overrides)
            _HYDRA_LEVELS[key] = {
                g: sorted(loader.get_group_options(f"factor/{g}", overrides=overrides))
                for g in sorted(groups)
            }
        return {name: list(levels) for name, levels in _HYDRA_LEVELS[key].items()}
    found: dict[str, set[str]] = {}
    for root in search_roots(searchpath):
        for folder in sorted((root / "factor").glob("*")):
            if folder.is_dir():
                found.setdefault(folder.name, set()).update(p.stem for p in folder.glob("*.yaml"))
    return {name: sorted(levels) for name, levels in sorted(found.items())}


def search_roots(searchpath: Sequence[str] = ()) -> list[Path]:
    """The folders of the shipped conf/ and of each `file://` or `pkg://` search path entry that exists."""
    roots = [SHIPPED_CONF]
    for entry in searchpath:
        entry = str(entry)
        if entry.startswith("file://"):
            roots.append(Path(entry.removeprefix("file://")))
        elif entry.startswith("pkg://"):
            spec = importlib.util.find_spec(entry.removeprefix("pkg://"))
            if spec is not None and spec.submodule_search_locations:
                roots += [Path(p) for p in spec.submodule_search_locations]
    return [root for root in roots if root.is_dir()]


def primary_searchpath() -> list[str]:
    """The primary config's own `hydra.searchpath` (pkg://orchestrator.studies: the shipped experiments)."""
    from omegaconf import OmegaConf

    return [str(p) for p in OmegaConf.select(OmegaConf.load(PRIMARY_CONFIG), "hydra.searchpath") or []]


def effective_searchpath(command_line: Sequence[str] | None) -> list[str]:
    """The search path entries a job composes with: as in Hydra, a `hydra.searchpath` given on the command
    line replaces the primary config's (it is not appended to it)."""
    return list(command_line) if command_line is not None else primary_searchpath()


def group_exists(group: str, searchpath: Sequence[str] = ()) -> bool:
    """Whether a config group (`cluster`, `factor/capture`, `experiment`) is a folder on the search path."""
    return any((root / group).is_dir() for root in search_roots(searchpath))


def option_files(group: str, searchpath: Sequence[str] = ()) -> dict[str, Path]:
    """{option: its YAML file} of a config group over the search path, sorted; the first match wins, as
    in Hydra. (Files only: the schemas Hydra also lists, `schema_*`, are not options to pick.)"""
    found: dict[str, Path] = {}
    for root in search_roots(searchpath):
        folder = root / group
        for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            found.setdefault(path.stem, path)
    return dict(sorted(found.items()))


def level_source(factor: str, option: str, searchpath: Sequence[str] = ()) -> str:
    """The file a factor level comes from (the first match on the path, as in Hydra), for messages."""
    matches = [
        root / "factor" / factor / f"{option}.yaml"
        for root in search_roots(searchpath)
        if (root / "factor" / factor / f"{option}.yaml").is_file()
    ]
    return str(matches[0]) if matches else f"factor/{factor}={option}"
