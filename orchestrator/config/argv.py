"""Checks of the command line itself, before Hydra composes anything (pure, given the factors known).

Two mistakes Hydra cannot explain well, or would make worse:
- `factor/nosuch=on` fails inside Hydra's composition ("Key 'factor/nosuch' is not in struct"), before
  any of our code runs, without saying which factors exist;
- a literal secret in an env value (`'++deployment.roles.decode.env={HF_TOKEN: hf_...}'`) is kept as typed
  in Hydra's own snapshots (`.hydra/overrides.yaml`, `multirun.yaml`) and printed on its launch line,
  where no redaction reaches it. `${oc.env:NAME}` resolves it at run time instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from orchestrator.config.redact import is_secret_name

FACTOR_GROUP = "factor/"


def searchpath_of(overrides: Sequence[Any]) -> list[str]:
    """`hydra.searchpath=[...]` entries given on the command line (parsed overrides)."""
    for override in overrides:
        if override.get_key_element().lstrip("+~") == "hydra.searchpath" and not override.is_sweep_override():
            value = override.value()
            return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return []


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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from orchestrator.config.catalog import discover_factor_levels

    words = [a for a in args if not a.startswith("-") and "=" in a]
    try:
        overrides = OverridesParser.create().parse_overrides(words)
    except HydraException:
        return []  # Hydra's own parse error, with its grammar link, says it best
    known = discover_factor_levels(searchpath_of(overrides))
    return unknown_factor_problems(overrides, known) + literal_secret_problems(overrides)
