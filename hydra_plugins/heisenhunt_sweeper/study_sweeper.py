"""The study sweeper: Hydra's basic sweeper, driving the study designs of orchestrator/study/designs.py, with
up-front validation.

`design: factorial` is the basic sweeper's cartesian product. `design: ofat` is what a
hypothesis-elimination study needs: the baseline arm plus, for each swept `factor/<name>`, one arm per
non-baseline level with every other factor at its baseline level (`study.baseline`); other swept keys
(e.g. `repetition`) still multiply. 4 two-level factors give 5 arms instead of 16. `design: sequential`
runs the ofat arms in rounds until the evidence decides, the way Hydra's Ax and Optuna sweepers do;
`design: ddmin` searches `study.ddmin.differences` for a 1-minimal subset that still corrupts.

Every design runs through one loop: the design's `next_round(records, launched)` gives the jobs to launch
(through the configured launcher); an adaptive design's evidence is read back from the tracking store
(the same runs the report reads, so a resumed study sees what it skipped) before the next round.

Before a round starts, every job's config is composed, typed and planned, and every distinct arm is
checked by its hosts: bad input anywhere in the sweep stops it before any server is restarted.

When neither the study nor the command line sweeps anything, `default_params` runs: that is what makes
`python -m orchestrator` with no arguments a small study (`designs.choose`).
"""

# No `from __future__ import annotations`: Hydra loads plugins outside sys.modules, where dataclasses
# cannot resolve string annotations.
import logging
import time

# The one dependence on Hydra's internals: the basic sweeper has no public base class, and subclassing
# it keeps its batching, job numbering and launcher hand-off exactly as Hydra's own.
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from hydra_plugins.heisenhunt_sweeper import config as _config  # noqa: F401 - registers the sweeper node
from hydra_plugins.heisenhunt_sweeper._core import (
    JOB_SEP,
    arm_overrides,
    collapse,
    repetition_problems,
)
from orchestrator.config.plan import run_load
from orchestrator.run.progress import TERMINAL
from orchestrator.study import designs
from orchestrator.study.designs import job_repetition

log = logging.getLogger(__name__)


class _DryRunLauncher:
    """Stands in for the launcher in a dry run or a preflight-only sweep: the jobs were composed, planned
    and printed (or checked on their hosts); none runs."""

    def launch(self, job_overrides, initial_job_idx):
        return []


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
        designs.check_name(design, "hydra.sweeper.design")
        designs.check_name(default_design, "hydra.sweeper.default_design")
        self.design = design
        self.default_params = default_params or {}
        self.default_design = default_design
        self.study = None
        self.design_run = design
        self._design: designs.Design | None = None
        self._planned: list[tuple[str, int]] = []
        self._round: list[list[str]] = []
        self._launched = -1  # the last round launched
        self._launched_jobs: set[tuple[str, ...]] = set()
        # each arm's plans (one per pool member), or the ConfigError refusing it, by its overrides without
        # `repetition`: an arm is composed and planned once a sweep, however many repetitions and rounds
        # it comes back in (its hosts still check it every round)
        self._arm_plans: dict[tuple, object] = {}

    def sweep(self, arguments: "list[str]"):
        from orchestrator.config.adhoc import study_overrides
        from orchestrator.study.sweep import choices_of, sweep_study

        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        cli_sweeps = any(o.is_sweep_override() for o in parser.parse_overrides(arguments))
        # a command-line sweep of factors outside any study is a study of its own (config/adhoc.py)
        self.study, adhoc = sweep_study(self.config, arguments)
        extra = study_overrides(self.study) if adhoc else []
        sweeper = {
            "design": self.design,
            "params": self.params,
            "default_design": self.default_design,
            "default_params": self.default_params,
        }
        self.design_run, params = designs.choose(sweeper, cli_sweeps, adhoc)
        if params and not self.params:
            log.info("no sweep given: running the default study sweep %s", params)
        self.params = params
        choices = choices_of(
            parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(arguments))
        )
        self._design = designs.build(
            self.design_run,
            self.study,
            choices,
            extra,
            sessions=int(self.config.workload.sessions),
            bench_on=bool(self.config.bench.get("enabled", True)),
            batch_size=self.max_batch_size,
            load=run_load(self.config.workload.sessions, self.config.workload.concurrency),
            deployment_cost=OmegaConf.to_container(self.config.deployment.get("cost") or {}, resolve=True),
        )
        if self._launches_nothing():
            self.launcher = _DryRunLauncher()
        return super().sweep(list(arguments) + extra)

    def _launches_nothing(self) -> bool:
        """dry_run (print the arms) or preflight_only (check them on their hosts): no job runs."""
        assert self.config is not None
        return bool(self.config.get("dry_run") or self.config.get("preflight_only"))

    def is_done(self) -> bool:
        self._round = self._next_round()
        return not self._round

    def get_job_batch(self):
        return self._round

    def _records(self) -> list:
        """The study's runs so far, from the tracking store (an adaptive design's evidence)."""
        import os

        assert self.config is not None and self._design is not None
        if not (self._design.adaptive and self._planned):
            return []  # (MLflow not imported yet: a refused sweep says so a second or two sooner)
        from orchestrator.tracking.layout import PARENT_ENV
        from orchestrator.tracking.read import load_study

        if not os.environ.get(PARENT_ENV):
            return []
        return load_study(str(self.config.tracking.uri), self.study.name)[2]

    def _next_round(self) -> "list[list[str]]":
        """The next round's jobs from the evidence so far (none: the study is over); logs where the study
        stands to the terminal, and a sequential look to the parent run (a metric per claim, step =
        round)."""
        import os

        assert self.config is not None and self._design is not None
        design, uri = self._design, str(self.config.tracking.uri)
        if self._launches_nothing() and design.adaptive:
            # the later rounds depend on the first one's evidence: show and check what may run first
            if self._launched >= 0:
                log.info("round 0 shown and checked; the later rounds depend on its evidence", extra=TERMINAL)
                return []
            self._launched = 0
            first = design.jobs()
            log.info("round 0: %s", ", ".join(dict.fromkeys(job.label for job in first)), extra=TERMINAL)
            return [list(job.overrides) for job in first]
        try:
            nxt = design.next_round(self._records(), self._launched)
        except designs.DesignError as e:
            self._end_parent_refused([], str(e))
            raise
        for note in nxt.notes:
            log.info("%s", note, extra=TERMINAL)  # where the study stands: the terminal follows it
        if nxt.look is not None:
            from orchestrator.tracking.layout import PARENT_ENV
            from orchestrator.tracking.write import log_look

            if os.environ.get(PARENT_ENV):
                log_look(uri, os.environ[PARENT_ENV], nxt.look)
        if not nxt.jobs:
            if design.adaptive:
                log.info(
                    "%s study done after %d round(s): %s",
                    design.name,
                    nxt.index,
                    nxt.stop_reason,
                    extra=TERMINAL,
                )
            return []
        jobs = [list(job.overrides) for job in nxt.jobs]
        again = [j for j in jobs if tuple(j) in self._launched_jobs]
        if design.adaptive and again:
            raise HydraException(
                f"design={design.name}: the runs of {again[0]} are not in the tracking store {uri} (the "
                f"study callback records them: hydra.callbacks.study), so the next round cannot be chosen"
            )
        self._launched_jobs |= {tuple(j) for j in jobs}
        self._launched = nxt.index
        return jobs

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        return []  # the design's rounds are the batches (is_done / get_job_batch)

    def validate_batch_is_legal(self, batch) -> None:
        """Compose, type and plan every job of the batch, and have the hosts check each distinct arm,
        before any job runs. A refused sweep ends its parent run FAILED with the reason."""
        # (Hydra's own check composes every job too: this one does that and more, so it replaces it)
        assert self.hydra_context is not None and self.config is not None
        from orchestrator.config.load import ConfigError, load_job
        from orchestrator.config.plan import jobs_on_pool, plan_arm
        from orchestrator.run.local_checks import check_local_side
        from orchestrator.run.preflight import check_sweep_on_hosts

        problems: list[str] = []
        dry_run = bool(self.config.get("dry_run"))
        preflight_only = bool(self.config.get("preflight_only"))
        try:
            if not self._launches_nothing():  # nothing is written, not even the reports folder
                check_local_side(str(self.config.tracking.uri), str(self.config.report.dir))
        except ConfigError as e:
            problems += e.problems
        planned = []
        # with a cluster pool, every arm on every member (an arm may run on any): the hosts check each
        on_members = []
        # repetitions of one arm differ only in `repetition`, which nothing in the arm's plan reads: each
        # arm is composed and planned once (a dsv4 study: 5 compositions instead of 15 in its first round,
        # none in the later ones; a refused arm ends the sweep, so its error is never read again)
        for overrides in batch:
            job_name = " ".join(overrides)
            key = arm_overrides(overrides)
            if key not in self._arm_plans:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(key))
                try:
                    self._arm_plans[key] = [plan_arm(job) for job in jobs_on_pool(load_job(cfg))]
                except ConfigError as e:
                    self._arm_plans[key] = e
            found = self._arm_plans[key]
            if isinstance(found, ConfigError):
                problems += [f"{p}{JOB_SEP}{job_name}" for p in found.problems]
            else:
                planned.append((job_name, found[0]))
                on_members += [(job_name, plan) for plan in found]
            problems += [f"{p}{JOB_SEP}{job_name}" for p in repetition_problems(overrides)]
        if not problems and dry_run:
            from orchestrator.config.dryrun import arm_listing

            print(arm_listing(planned, self.study.baseline, self.study.name, self.design_run), flush=True)
            return
        if not problems:
            started = time.monotonic()
            problems += [f"{p}{JOB_SEP}{job}" for p, job in check_sweep_on_hosts(on_members)]
            checked = time.monotonic() - started
        if not problems and preflight_only:
            arms = len({plan.signature for _, plan in on_members})
            print(
                f"preflight of study {self.study.name} ({self.design_run}): {arms} arm(s) of {len(batch)} "
                f"job(s) accepted by their hosts in {checked:.1f} s; nothing was started or stopped",
                flush=True,
            )
            return
        if problems:
            error = ConfigError(collapse(problems, len(batch)))
            self._end_parent_refused(planned, str(error))
            raise error
        # accepted: the study callback's parent run opens now (a refused sweep opens none), and keeps
        # what this batch plans
        from orchestrator.report.pipeline import open_parent_run

        open_parent_run()
        self._record_planned(planned, batch)
        self._show_progress(len(batch))

    def _show_progress(self, jobs: int) -> None:
        """The terminal follows the accepted round (report/console.py)."""
        from orchestrator.report.console import sweep_accepted

        assert self.config is not None and self._design is not None
        sweep_accepted(
            self.study.name,
            str(self.config.hydra.sweep.dir),
            jobs,
            more_rounds=self._design.adaptive,
            tracking_uri=str(self.config.tracking.uri),
            report_dir=str(self.config.report.dir),
            gpus=int(self.study.cost.gpus or (self.config.deployment.get("cost") or {}).get("gpus") or 0),
        )

    def _record_planned(self, planned, batch) -> None:
        """The parent run keeps every (signature, repetition) the sweep plans: a resumed sweep's report
        counts the earlier FINISHED runs of exactly these jobs."""
        import os

        from orchestrator.tracking.layout import PARENT_ENV
        from orchestrator.tracking.write import record_planned

        run_id = os.environ.get(PARENT_ENV)
        if not run_id:
            return
        assert self.config is not None
        default = int(self.config.get("repetition", 0))
        repetitions = {" ".join(job): job_repetition(job, default) for job in batch}
        self._planned += [(plan.signature, repetitions[name]) for name, plan in planned]
        record_planned(str(self.config.tracking.uri), run_id, self._planned)

    def _end_parent_refused(self, planned, reason: str) -> None:
        """The sweep's parent run, if an earlier batch opened it (a later round of a sequential or ddmin
        study), ends FAILED with the reason; a sweep refused at its first batch opened none."""
        from orchestrator.report.pipeline import opened_parent_run

        run_id = opened_parent_run()
        if not run_id:
            return
        from orchestrator.config.redact import redact_text
        from orchestrator.tracking.write import end_run_failed  # MLflow: only where a run is to be ended

        secrets = {name: value for _, plan in planned for name, value in plan.secrets.items()}
        assert self.config is not None
        end_run_failed(str(self.config.tracking.uri), run_id, redact_text(reason, secrets))
