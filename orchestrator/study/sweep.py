"""The study a multirun records and the design it runs, read from the composed config and the command
line: a study's own sweep, or an ad-hoc study for a command-line sweep of factors outside any study
(`config.adhoc`); the design from `study.designs.choose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrator.config.load import study_of
from orchestrator.config.schema import StudyConf


def choices_of(overrides: Sequence[Any]) -> dict[str, list[str]]:
    """key -> its values as `key=value` override strings, in command-line order (last one wins), from
    Hydra's parsed overrides."""
    from hydra.errors import HydraException

    found: dict[str, list[str]] = {}
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise HydraException(f"the study sweeper does not support sweep type {override.value_type}")
            found[key] = [f"{key}={v}" for v in override.sweep_string_iterator()]
        else:
            found[key] = [f"{key}={override.get_value_element_as_str()}"]
    return found


def sweep_study(config: DictConfig, arguments: Sequence[str] | None = None) -> tuple[StudyConf, bool]:
    """The study a multirun records and reports: an ad-hoc one for a command-line sweep of factors outside
    any study (no `hydra.sweeper.params`), else the composed one. Returns (study, ad hoc or not)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from orchestrator.config.adhoc import adhoc_study, swept_factors

    composed = study_of(config)
    sweeper = config.hydra.get("sweeper") or {}
    task = list(arguments if arguments is not None else config.hydra.overrides.get("task") or [])
    # a study's own sweep, or a command line that defines the study itself, is not ad hoc
    keys = [o.lstrip("+~").split("=", 1)[0] for o in task]
    if sweeper.get("params") or any(k.startswith("study.") and k != "study.name" for k in keys):
        return composed, False
    choices = choices_of(OverridesParser.create().parse_overrides(task))
    swept = swept_factors({name: [a.split("=", 1)[1] for a in values] for name, values in choices.items()})
    # a sweep of factors the study already asks about (the default study and multi_stream) is that
    # study's own; one that sweeps a factor it has no hypothesis for is a question of its own
    if all(factor in {h.factor for h in composed.hypotheses} for factor in swept):
        return composed, False
    named = any(o.lstrip("+~").startswith("study.name=") for o in task)
    levels = {str(k): str(v.get("level")) for k, v in (config.get("factor") or {}).items()}
    study = adhoc_study(swept, levels, composed.name if named else None, " ".join(task))
    return (study, True) if study is not None else (composed, False)


def sweep_design(config: DictConfig, adhoc: bool) -> str:
    """The design the sweeper runs (`designs.choose`, from the composed config's sweeper and the
    command line's overrides)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from orchestrator.study.designs import choose

    sweeper = OmegaConf.to_container(config.hydra.get("sweeper") or OmegaConf.create({}), resolve=True)
    task = list(OmegaConf.select(config, "hydra.overrides.task") or [])
    cli_sweeps = any(o.is_sweep_override() for o in OverridesParser.create().parse_overrides(task))
    return choose(sweeper, cli_sweeps, adhoc)[0]
