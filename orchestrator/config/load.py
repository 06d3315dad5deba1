"""The Hydra side of the config: schemas in Hydra's ConfigStore, and `load_job`, the one place where a
composed `DictConfig` becomes typed values (`schema.JobConf`), checked before anything is started.

Hydra checks types and misspelled keys against the schemas when it composes. What a schema cannot say
(env names, flag spelling, a factor level's roles and name, hypotheses that name real factors and
levels, two servers on one port) is checked by `config.checks.check_job`, a pure function on the typed
job that returns every problem at once, each naming the key and what is accepted.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import CompactHydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from orchestrator.config import schema, slurm
from orchestrator.config.checks import DIFFERENCE_LEVELS, check_job, difference_levels, typed_level
from orchestrator.config.schema import JobConf, SelectedLevel, StudyConf

# conf/ ships inside the package (a symlink in the repo, real files in a wheel)
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


class ConfigError(CompactHydraException, ValueError):
    """Bad configuration, found before anything was started. Holds every problem found.
    (A CompactHydraException: Hydra prints the message alone, without a stack trace.)"""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(problems))


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(group="cluster", name="schema_cluster", node=schema.ClusterConf)
    cs.store(group="cluster_pool", name="schema_cluster_pool", node=schema.ClusterPoolConf)
    cs.store(group="deployment", name="schema_deployment", node=schema.DeploymentConf)
    cs.store(group="workload", name="schema_stress", node=schema.StressConf)
    cs.store(group="bench", name="schema_bench", node=schema.BenchConf)
    cs.store(group="tracking", name="schema_tracking", node=schema.TrackingConf)
    cs.store(name="schema_study", node=StudyConf, package="study")
    cs.store(name="schema_report", node=schema.ReportConf, package="report")


# `${python:}` in a host's `python`: the interpreter running the orchestrator (for local hosts)
OmegaConf.register_new_resolver("python", lambda: sys.executable, replace=True)
# `${package_file:sim/x.yaml}`: the absolute path of a file shipped in this package, wherever it is
# installed and whatever the working directory (e.g. a fault model for the embedded default)
OmegaConf.register_new_resolver(
    "package_file", lambda relative: str(Path(__file__).resolve().parents[1] / relative), replace=True
)
# `${slurm_node:0}`, `${slurm_transport:0}`: the roles placed on a SLURM job's allocation (config/slurm.py)
OmegaConf.register_new_resolver("slurm_node", slurm.node, replace=True)
OmegaConf.register_new_resolver("slurm_transport", slurm.transport, replace=True)
register_configs()


# --- DictConfig -> typed values, once ------------------------------------------------------------------


@dataclass(frozen=True)
class HydraRuntime:
    """What a job's config needs from Hydra itself: the selected options and the search path."""

    choices: dict[str, str]
    searchpath: list[str]
    sweep_dir: str | None = None


def hydra_runtime(cfg: DictConfig) -> HydraRuntime:
    """From the config's own `hydra` node (a composed sweep job) or, inside a running job, HydraConfig."""
    node = cfg.get("hydra") if isinstance(cfg, DictConfig) and "hydra" in cfg else None
    if node is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return HydraRuntime(choices={}, searchpath=[])
        node = HydraConfig.get()
    choices = OmegaConf.to_container(node.runtime.choices) if "runtime" in node else {}
    sweep = OmegaConf.select(node, "sweep.dir", default=None)
    return HydraRuntime(
        choices={str(k): str(v) for k, v in (choices or {}).items() if v is not None},
        searchpath=[str(p) for p in (node.get("searchpath") or [])],
        sweep_dir=str(sweep) if sweep else None,
    )


def load_job(cfg: DictConfig, runtime: HydraRuntime | None = None) -> JobConf:
    """The typed, checked job of a composed config. Raises ConfigError listing every problem."""
    from orchestrator.config.catalog import discover_factor_levels, level_source

    runtime = runtime or hydra_runtime(cfg)
    known = discover_factor_levels(runtime.searchpath)
    problems = unknown_groups(cfg, known)
    factors: dict[str, SelectedLevel] = {}
    for name, node in (cfg.get("factor") or {}).items():
        option = runtime.choices.get(f"factor/{name}", str(node.get("level")))
        source = level_source(str(name), option, runtime.searchpath)
        selected, found = typed_level(str(name), option, source, node)
        problems += found
        if selected is not None:
            factors[str(name)] = selected
    typed: dict[str, Any] = {}
    keys = ("cluster", "deployment", "study", "workload", "bench", "tracking", "report", "cluster_pool")
    for key in keys:
        if key == "cluster_pool" and cfg.get(key) is None:
            continue
        try:
            typed[key] = OmegaConf.to_object(cfg[key])
        except OmegaConfBaseException as e:
            problems.append(f"{getattr(e, 'full_key', '') or key}: {getattr(e, 'msg', e)}")
    if problems:
        raise ConfigError(problems)
    study: StudyConf = with_good_baseline(typed["study"], cfg)
    if study.ddmin.differences or cfg.get("ddmin_subset") is not None:
        applied = cfg.get("ddmin_subset")
        found, problems = difference_levels(study, None if applied is None else list(applied), factors)
        if problems:
            raise ConfigError(problems)
        factors |= found
        known = {**known, **{d.id: list(DIFFERENCE_LEVELS) for d in study.ddmin.differences}}
    job = JobConf(
        factors=factors,
        repetition=int(cfg.get("repetition", 0)),
        resume=bool(cfg.get("resume", False)),
        parent_run_id=str(cfg.parent_run_id) if cfg.get("parent_run_id") else None,
        sweep_dir=runtime.sweep_dir,
        **typed,
    )
    problems = check_job(job, known)
    if problems:
        raise ConfigError(problems)
    return job


def study_of(cfg: DictConfig) -> StudyConf:
    """The typed study of a composed config (for the sweep's parent run, before any job is planned)."""
    study = OmegaConf.to_object(cfg.study)
    assert isinstance(study, StudyConf)
    return with_good_baseline(study, cfg)


def with_good_baseline(study: StudyConf, cfg: DictConfig) -> StudyConf:
    """A ddmin study's baseline is its good configuration: the factor levels this config composes (every
    difference at `good`), whatever `study.baseline` says of factors, so the good arm is the baseline of
    the report and of the throughput ratios."""
    if study.ddmin.differences:
        for name, node in (cfg.get("factor") or {}).items():
            study.baseline[str(name)] = str(node.get("level"))
    return study


def unknown_groups(cfg: DictConfig, known: Mapping[str, list[str]]) -> list[str]:
    """`+factor/<name>=<level>` with no such group is taken by Hydra as a plain key, not a factor."""
    problems = []
    for key in cfg:
        if "/" in str(key):
            group = str(key).partition("/")[0]
            accepted = sorted(known) if group == "factor" else "an existing config group"
            problems.append(
                f"{key}: unknown config group {key!r} (option {cfg[key]!r}); accepted "
                f"{group} names: {accepted}"
            )
    return problems
