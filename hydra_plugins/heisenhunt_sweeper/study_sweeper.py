"""The study sweeper: Hydra's basic sweeper, plus one-factor-at-a-time designs and up-front validation.

`design: factorial` is the basic sweeper unchanged (a cartesian product). `design: ofat` is what a
hypothesis-elimination study needs: the baseline arm plus, for each swept `factor/<name>`, one arm per
non-baseline level with every other factor at its baseline level (`study.baseline`); other swept keys
(e.g. `repetition`) still multiply. 4 two-level factors give 5 arms instead of 16.

Before the first job starts, every job's config is composed, typed and planned, and every distinct arm
is checked by its hosts: bad input anywhere in the sweep stops it before any server is restarted.

When neither the study nor the command line sweeps anything, `default_params` runs: that is what makes
`python -m orchestrator` with no arguments a small study.

The design logic is in `_core.py` (pure); this class only wires it into Hydra.
"""

# No `from __future__ import annotations`: Hydra loads plugins outside sys.modules, where dataclasses
# cannot resolve string annotations.
import logging
from collections import OrderedDict

# The one dependence on Hydra's internals: the basic sweeper has no public base class, and subclassing
# it keeps its batching, job numbering and launcher hand-off exactly as Hydra's own.
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException

from hydra_plugins.heisenhunt_sweeper import config as _config  # noqa: F401 - registers the sweeper node
from hydra_plugins.heisenhunt_sweeper._core import DESIGNS, JOB_SEP, batches, collapse, ofat_jobs

log = logging.getLogger(__name__)


def choices_of(overrides: "list[Override]") -> "OrderedDict[str, list[str]]":
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


class StudySweeper(BasicSweeper):
    def __init__(
        self,
        max_batch_size: "int | None" = None,
        params: "dict[str, str] | None" = None,
        design: str = "factorial",
        default_params: "dict[str, str] | None" = None,
        default_design: str = "ofat",
    ):
        super().__init__(max_batch_size=max_batch_size, params=params)
        for name, value in (("design", design), ("default_design", default_design)):
            if value not in DESIGNS:
                raise HydraException(f"hydra.sweeper.{name}={value!r} is not one of {list(DESIGNS)}")
        self.design = design
        self.default_params = default_params or {}
        self.default_design = default_design
        self._ofat_batches: list | None = None

    def sweep(self, arguments: "list[str]"):
        from orchestrator.config import study_of

        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        cli = parser.parse_overrides(arguments)
        design = self.design
        if not self.params and not any(o.is_sweep_override() for o in cli) and self.default_params:
            log.info("no sweep given: running the default study sweep %s", dict(self.default_params))
            self.params, design = dict(self.default_params), self.default_design
        if design == "ofat":
            params_conf = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
            choices = choices_of(parser.parse_overrides(params_conf))
            jobs = ofat_jobs(choices, study_of(self.config).baseline)
            self._ofat_batches = batches(jobs, self.max_batch_size)
        return super().sweep(arguments)

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        if self._ofat_batches is not None:
            return self._ofat_batches
        return BasicSweeper.split_arguments(overrides, max_batch_size)

    def validate_batch_is_legal(self, batch) -> None:
        """Compose, type and plan every job of the batch, and have the hosts check each distinct arm,
        before any job runs. A refused sweep ends its parent run FAILED with the reason."""
        super().validate_batch_is_legal(batch)
        assert self.hydra_context is not None and self.config is not None
        from orchestrator.checks import check_local_side
        from orchestrator.config import ConfigError, load_job
        from orchestrator.plan import plan_arm
        from orchestrator.preflight import check_sweep_on_hosts

        problems: list[str] = []
        try:
            check_local_side(str(self.config.tracking.uri), str(self.config.report.dir))
        except ConfigError as e:
            problems += e.problems
        planned = []
        for overrides in batch:
            job_name = " ".join(overrides)
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            try:
                planned.append((job_name, plan_arm(load_job(cfg))))
            except ConfigError as e:
                problems += [f"{p}{JOB_SEP}{job_name}" for p in e.problems]
        if not problems:
            problems += [f"{p}{JOB_SEP}{job}" for p, job in check_sweep_on_hosts(planned)]
        if problems:
            error = ConfigError(collapse(problems, len(batch)))
            self._end_parent_refused(planned, str(error))
            raise error

    def _end_parent_refused(self, planned, reason: str) -> None:
        """The sweep's parent run (if the study callback opened one) ends FAILED with the reason."""
        import os

        from orchestrator.redact import redact_text
        from orchestrator.tracking import PARENT_ENV, end_run_refused

        run_id = os.environ.get(PARENT_ENV)
        if not run_id:
            return
        secrets = {name: value for _, plan in planned for name, value in plan.secrets.items()}
        assert self.config is not None
        end_run_refused(str(self.config.tracking.uri), run_id, redact_text(reason, secrets))
