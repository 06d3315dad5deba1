"""Checks of the command line itself, before Hydra composes anything (pure, given the factors known).

Mistakes Hydra cannot explain well, or would make worse:
- `factor/nosuch=on` fails inside Hydra's composition ("Key 'factor/nosuch' is not in struct"), before
  any of our code runs, without saying which factors exist;
- an option no config group has (`factor/capture=nosuch`, `+experiment=nosuch`, `cluster=nosuch`) gets
  Hydra's error with its search path dump and exit 1, mid-way through a sweep's launch for a swept value;
- a literal secret in an env value (`'++deployment.roles.decode.env={HF_TOKEN: hf_...}'`) is kept as typed
  in Hydra's own snapshots (`.hydra/overrides.yaml`, `multirun.yaml`) and printed on its launch line,
  where no redaction reaches it. `${oc.env:NAME}` resolves it at run time instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from orchestrator.config.redact import is_secret_name

FACTOR_GROUP = "factor/"
# Hydra's flags that choose another primary config or add a config dir: its groups are not the ones we list
OTHER_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def command_line_searchpath(overrides: Sequence[Any]) -> list[str] | None:
    """`hydra.searchpath=[...]` entries given on the command line (parsed overrides); None when not given."""
    for override in overrides:
        if override.get_key_element().lstrip("+~") == "hydra.searchpath" and not override.is_sweep_override():
            value = override.value()
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return None


def command_line_overrides(args: Sequence[str]) -> list[Any]:
    """The command line's overrides as Hydra parses them (its own flags, `-m` and the like, left out);
    Hydra's HydraException when one does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-") and "=" in a])


def group_of(override: Any) -> str | None:
    """The config group an override picks an option of (`factor/capture`, `experiment`, `cluster`), or None
    for a value (`workload.sessions=2`), a deletion, a package (`group@pkg`) or one of Hydra's own groups
    (`hydra/launcher`: Hydra's message lists those, and plugins add their options)."""
    key = override.key_or_group
    if override.is_delete() or override.package is not None or "." in key or key.split("/")[0] == "hydra":
        return None
    return key


def chosen_options(override: Any) -> list[str]:
    """The options an override picks: its value, or each value of a choice sweep (`a,b`). `null` (no
    option) and other sweeps (`glob(*)`, expanded by Hydra itself) are not checked."""
    from hydra.core.override_parser.types import ChoiceSweep

    value = override.value()
    values = value.list if isinstance(value, ChoiceSweep) else [value]
    return [v for v in values if isinstance(v, str)]


def _what(group: str) -> tuple[str, str]:
    """What one option of the group is called, and where its options come from (for messages)."""
    if group.startswith(FACTOR_GROUP):
        return "level", f"the level files in {group}/ on the search path"
    if group == "experiment":
        return "experiment", "experiments/ and experiment/ in each hydra.searchpath folder"
    return "option", f"conf/{group}/ and {group}/ in each hydra.searchpath folder"


def unknown_option_problems(
    overrides: Sequence[Any], options: Mapping[str, Sequence[str]], searchpath_hint: str = ""
) -> list[str]:
    """An option that its config group does not have (`options`: {group: its options}, for the groups the
    overrides name that exist; `searchpath_hint`: added to an unknown experiment's message)."""
    problems = []
    for override in overrides:
        group = group_of(override)
        if group not in options:
            continue  # no such group anywhere: unknown_factor_problems or Hydra says so
        accepted = options[group]
        noun, source = _what(group)
        for value in chosen_options(override):
            if value not in accepted:
                hint = searchpath_hint if group == "experiment" else ""
                problems.append(
                    f"{group}: unknown {noun} {value!r}; accepted {noun}s: [{', '.join(accepted)}] "
                    f"(from {source}){hint}"
                )
    return problems


def unknown_factor_problems(overrides: Sequence[Any], known: Mapping[str, Sequence[str]]) -> list[str]:
    """`factor/<name>=...` (no `+`) for a factor that exists nowhere on the search path."""
    problems = []
    for override in overrides:
        key = override.get_key_element()
        if not key.startswith(FACTOR_GROUP):
            continue  # `+factor/...` adds a group; config.load_job names what is accepted then
        name = key[len(FACTOR_GROUP) :]
        if name not in known:
            problems.append(
                f"{key}: unknown factor {name!r}; accepted factor names: {sorted(known)}. A factor of your "
                f"own is a folder factor/{name}/ with one YAML per level, on hydra.searchpath=[file:///dir]"
            )
    return problems


def _leaves(key: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, Mapping):
        for sub, inner in value.items():
            yield from _leaves(f"{key}.{sub}", inner)
    else:
        yield key, value


def literal_secret_problems(overrides: Sequence[Any]) -> list[str]:
    """Env values with a secret-looking name given literally (not as an `${...}` interpolation)."""
    problems = []
    for override in overrides:
        if override.is_sweep_override():
            continue
        for key, value in _leaves(override.get_key_element().lstrip("+~"), override.value()):
            parts = key.split(".")
            name = parts[-1]
            if "env" in parts[:-1] and is_secret_name(name) and isinstance(value, str) and "${" not in value:
                problems.append(
                    f"{key}: a literal secret on the command line is kept as typed in Hydra's snapshots "
                    f"(.hydra/, multirun.yaml) and its launch log; give it as '${{oc.env:{name}}}' with "
                    f"{name} set in the environment (or in your deployment file)"
                )
    return problems


def command_line_problems(args: Sequence[str]) -> list[str]:
    """Every problem of the command line's overrides (Hydra's own flags, `-m` and the like, are skipped)."""
    from hydra.errors import HydraException

    from orchestrator.config import catalog

    try:
        overrides = command_line_overrides(args)
    except HydraException:
        return []  # Hydra's own parse error, with its grammar link, says it best
    given = command_line_searchpath(overrides)
    searchpath = catalog.effective_searchpath(given)
    known = catalog.discover_factor_levels(searchpath)
    problems = unknown_factor_problems(overrides, known)
    if not any(a.split("=")[0] in OTHER_CONFIG_FLAGS for a in args):
        # `experiment` always: where no experiment/ folder is on the search path, Hydra reads
        # `+experiment=NAME` as a new plain key and runs the default study instead, saying nothing
        groups = {
            g
            for g in map(group_of, overrides)
            if g and (g == "experiment" or catalog.group_exists(g, searchpath))
        }
        options = {g: list(catalog.option_files(g, searchpath)) for g in groups}
        problems += unknown_option_problems(overrides, options, replaced_searchpath_hint(given))
    return problems + literal_secret_problems(overrides)


def replaced_searchpath_hint(given: Sequence[str] | None) -> str:
    """What a `hydra.searchpath` on the command line left out of the primary config's (the shipped
    experiments' pkg://orchestrator.studies): Hydra replaces the list, it does not add to it."""
    from orchestrator.config.catalog import primary_searchpath

    dropped = [e for e in primary_searchpath() if given is not None and e not in given]
    if not dropped:
        return ""
    return (
        f". A hydra.searchpath on the command line replaces the config's {dropped}; to keep the shipped "
        f"experiments give both: hydra.searchpath=[{','.join(dropped + list(given or []))}]"
    )
