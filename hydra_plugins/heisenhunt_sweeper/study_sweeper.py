"""The study sweeper: Hydra's basic sweeper, plus one-factor-at-a-time designs and up-front validation.

`design: factorial` is the basic sweeper unchanged (a cartesian product). `design: ofat` is what a
hypothesis-elimination study needs: the baseline arm plus, for each swept `factor/<name>`, one arm per
non-baseline level with every other factor at its baseline level (`study.baseline`); other swept keys
(e.g. `repetition`) still multiply. 4 two-level factors give 5 arms instead of 16.

Before the first job starts, every job's config is composed and planned, and the orchestrator's
validation runs on each: bad input anywhere in the sweep stops it before any server is restarted.

When neither the study nor the command line sweeps anything, `default_params` runs: that is what makes
`python -m orchestrator` with no arguments a small study.
"""

# No `from __future__ import annotations`: Hydra loads plugins outside sys.modules, where dataclasses
# cannot resolve string annotations.
import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

FACTOR_PREFIX = "factor/"
JOB_SEP = "\x00"  # between a problem and the overrides of the job it was found in
DESIGNS = ("factorial", "ofat")


@dataclass
class StudySweeperConf:
    _target_: str = "hydra_plugins.heisenhunt_sweeper.study_sweeper.StudySweeper"
    max_batch_size: Optional[int] = None  # noqa: UP045 - OmegaConf needs typing.Optional here
    # key -> comma-separated values, as hydra.sweeper.params of the basic sweeper
    params: Optional[dict[str, str]] = None  # noqa: UP045
    # factorial: every combination. ofat: baseline + one factor changed at a time (see study.baseline)
    design: str = "factorial"
    # swept when neither params nor the command line sweep anything
    default_params: Optional[dict[str, str]] = field(default=None)  # noqa: UP045
    default_design: str = "ofat"


ConfigStore.instance().store(
    group="hydra/sweeper", name="heisenhunt", node=StudySweeperConf, provider="heisenhunt"
)


def _choices(overrides: list[Override]) -> OrderedDict[str, list[str]]:
    """key -> its values as `key=value` override strings, in command-line order (last one wins)."""
    found: OrderedDict[str, list[str]] = OrderedDict()
    for override in overrides:
        key = override.get_key_element()
        if override.is_sweep_override():
            if not override.is_discrete_sweep():
                raise HydraException(f"the study sweeper does not support sweep type {override.value_type}")
            found[key] = [f"{key}={v}" for v in override.sweep_string_iterator()]
        else:
            found[key] = [f"{key}={override.get_value_element_as_str()}"]
    return found


def _value(assignment: str) -> str:
    return assignment.split("=", 1)[1]


def ofat_jobs(choices: OrderedDict[str, list[str]], baseline: dict[str, str]) -> list[list[str]]:
    """Baseline plus one-factor-at-a-time deviations, times the product of the non-factor keys."""
    # a factor pinned to one level (e.g. on the command line) is a constant of the sweep, not an arm
    factor_keys = [k for k in choices if k.lstrip("+~").startswith(FACTOR_PREFIX) and len(choices[k]) > 1]
    other_keys = [k for k in choices if k not in factor_keys]
    base: dict[str, str] = {}
    for key in factor_keys:
        name = key.lstrip("+~")[len(FACTOR_PREFIX) :]
        levels = [_value(a) for a in choices[key]]
        wanted = baseline.get(name)
        if wanted is None:
            raise HydraException(
                f"design=ofat sweeps {key} over {levels} but study.baseline.{name} is not set; "
                f"set it to one of {levels}"
            )
        wanted = str(wanted)
        if wanted not in levels:
            raise HydraException(
                f"study.baseline.{name}={wanted!r} is not among the swept levels {levels} of {key}"
            )
        base[key] = f"{key}={wanted}"
    arms = [dict(base)]
    for key in factor_keys:
        for assignment in choices[key]:
            if assignment != base[key]:
                arms.append({**base, key: assignment})
    jobs = []
    for arm in arms:
        for rest in itertools.product(*(choices[k] for k in other_keys)):
            jobs.append(list(arm.values()) + list(rest))
    return jobs


def collapse(problems: list[str], jobs: int) -> list[str]:
    """One line per distinct problem, saying which jobs have it (most sweeps repeat one mistake)."""
    where: dict[str, list[str]] = {}
    for problem in problems:
        message, _, job = problem.partition(JOB_SEP)
        where.setdefault(message, [])
        if job and job not in where[message]:
            where[message].append(job)
    lines = []
    for message, found in where.items():
        if not found or len(found) == jobs:
            lines.append(message if not found or jobs == 1 else f"{message} (every job)")
        else:
            lines.append(f"{message} (in {len(found)} of {jobs} jobs, e.g. [{found[0]}])")
    return sorted(lines)


class StudySweeper(BasicSweeper):
    def __init__(
        self,
        max_batch_size: int | None = None,
        params: dict[str, str] | None = None,
        design: str = "factorial",
        default_params: dict[str, str] | None = None,
        default_design: str = "ofat",
    ):
        super().__init__(max_batch_size=max_batch_size, params=params)
        for name, value in (("design", design), ("default_design", default_design)):
            if value not in DESIGNS:
                raise HydraException(f"hydra.sweeper.{name}={value!r} is not one of {list(DESIGNS)}")
        self.design = design
        self.default_params = default_params or {}
        self.default_design = default_design

    def _baseline(self) -> dict[str, str]:
        assert self.config is not None
        study = self.config.get("study") or {}
        baseline = study.get("baseline") or {}
        return {
            str(k): str(v)
            for k, v in (
                OmegaConf.to_container(baseline) if isinstance(baseline, DictConfig) else baseline
            ).items()
        }

    def sweep(self, arguments: list[str]):
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        cli = parser.parse_overrides(arguments)
        design = self.design
        if not self.params and not any(o.is_sweep_override() for o in cli) and self.default_params:
            log.info("no sweep given: running the default study sweep %s", dict(self.default_params))
            self.params, design = dict(self.default_params), self.default_design
        if design == "ofat":
            params_conf = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
            choices = _choices(parser.parse_overrides(params_conf))
            jobs = ofat_jobs(choices, self._baseline())
            size = self.max_batch_size or len(jobs)
            self._ofat_batches = [jobs[i : i + size] for i in range(0, len(jobs), size)]
        else:
            self._ofat_batches = None
        return super().sweep(arguments)

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        if getattr(self, "_ofat_batches", None) is not None:
            return self._ofat_batches
        return BasicSweeper.split_arguments(overrides, max_batch_size)

    def validate_batch_is_legal(self, batch) -> None:
        """Compose and plan every job of the batch, and validate it, before any job runs."""
        super().validate_batch_is_legal(batch)
        assert self.hydra_context is not None and self.config is not None
        from orchestrator.checks import check_local_side
        from orchestrator.config import ConfigError, validate
        from orchestrator.factors import plan_arm

        problems: list[str] = []
        try:
            check_local_side(str(self.config.tracking.uri), str(self.config.report.dir))
        except ConfigError as e:
            problems += e.problems
        planned = []
        for overrides in batch:
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            try:
                validate(cfg)
                planned.append((overrides, cfg, plan_arm(cfg)))
            except ConfigError as e:
                problems += [f"{p}{JOB_SEP}{' '.join(overrides)}" for p in e.problems]
        if not problems:
            problems += self._check_on_hosts(planned)
        if problems:
            error = ConfigError(collapse(problems, len(batch)))
            from orchestrator.tracking import end_parent_refused

            end_parent_refused(self.config, str(error))
            raise error

    @staticmethod
    def _check_on_hosts(planned) -> list[str]:
        """Every distinct arm checked by its hosts (flags, preflight module) before the first job."""
        from orchestrator.preflight import PreflightError, check_arm_on_hosts
        from orchestrator.remote import close_all, make_transports
        from orchestrator.remote.base import TransportError

        problems: list[str] = []
        by_cluster: dict[str, list] = {}
        for overrides, cfg, plan in planned:
            by_cluster.setdefault(OmegaConf.to_yaml(cfg.cluster), []).append((overrides, cfg, plan))
        for jobs in by_cluster.values():
            cfg0 = jobs[0][1]
            try:
                transports = make_transports(
                    {role: cfg0.cluster.hosts[role] for role in ("prefill", "decode")}
                )
            except TransportError as e:
                problems.append(f"cluster {cfg0.cluster.name}: {e}")
                continue
            try:
                seen = set()
                for overrides, cfg, plan in jobs:
                    if plan.signature in seen:
                        continue
                    seen.add(plan.signature)
                    try:
                        check_arm_on_hosts(cfg, plan, transports)
                    except (PreflightError, TransportError) as e:
                        problems.append(f"{e}{JOB_SEP}{' '.join(overrides)}")
            finally:
                close_all(transports)
        return problems
