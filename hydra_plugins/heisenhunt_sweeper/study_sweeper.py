"""The study sweeper: Hydra's basic sweeper, plus one-factor-at-a-time designs and up-front validation.

`design: factorial` is the basic sweeper unchanged (a cartesian product). `design: ofat` is what a
hypothesis-elimination study needs: the baseline arm plus, for each swept `factor/<name>`, one arm per
non-baseline level with every other factor at its baseline level (`study.baseline`); other swept keys
(e.g. `repetition`) still multiply. 4 two-level factors give 5 arms instead of 16.

`design: ddmin` searches `study.ddmin.differences` (what the bad configuration adds to the good one) for a
1-minimal subset that still corrupts, in rounds as the sequential design (orchestrator/analysis/ddmin.py):
each round runs the subset the search needs a verdict for next, and the search is replayed from the runs
in the tracking store.

`design: sequential` runs the ofat arms in rounds, the way Hydra's Ax and Optuna sweepers do: round r
launches, through the configured launcher, one job per arm still needed at `repetition=r`; then the
evidence is read back from the tracking store (the same runs the report reads, so a resumed study sees
what it skipped) and `orchestrator.analysis.sequential.next_round` says which arms the next round needs, until
every hypothesis is decided or `study.stopping` is spent. A swept `repetition` is ignored: rounds set it.

Before the first job starts, every job's config is composed, typed and planned, and every distinct arm
is checked by its hosts: bad input anywhere in the sweep stops it before any server is restarted.

When neither the study nor the command line sweeps anything, `default_params` runs: that is what makes
`python -m orchestrator` with no arguments a small study.

The design logic is in `_core.py` (pure); this class only wires it into Hydra.
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

from hydra_plugins.heisenhunt_sweeper import config as _config  # noqa: F401 - registers the sweeper node
from hydra_plugins.heisenhunt_sweeper._core import (
    DESIGNS,
    JOB_SEP,
    arm_overrides,
    batches,
    collapse,
    ddmin_base,
    ddmin_job,
    job_levels,
    job_repetition,
    ofat_jobs,
    repetition_problems,
    round_jobs,
)

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
        for name, value in (("design", design), ("default_design", default_design)):
            if value not in DESIGNS:
                raise HydraException(f"hydra.sweeper.{name}={value!r} is not one of {list(DESIGNS)}")
        self.design = design
        self.default_params = default_params or {}
        self.default_design = default_design
        self._ofat_batches: list | None = None
        self.study = None
        self.design_run = design
        self._planned: list[tuple[str, int]] = []
        # sequential: arm label -> its overrides, and the round about to be launched
        self._arms: dict[str, list[str]] | None = None
        self._round: list[list[str]] = []
        self._launched = -1  # the last round launched
        # ddmin: the overrides every job shares, and the jobs launched so far (to see a round recorded)
        self._ddmin_base: list[str] | None = None
        self._ddmin_launched: set[tuple[str, ...]] = set()

    def sweep(self, arguments: "list[str]"):
        from orchestrator.adhoc import study_overrides
        from orchestrator.config import choices_of, sweep_design, sweep_study

        assert self.hydra_context is not None and self.config is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        cli = parser.parse_overrides(arguments)
        # a command-line sweep of factors outside any study is a study of its own (see orchestrator.adhoc)
        self.study, adhoc = sweep_study(self.config, arguments)
        extra = study_overrides(self.study) if adhoc else []
        design = self.design
        searching = design == "ddmin"
        if (
            not searching
            and not self.params
            and not any(o.is_sweep_override() for o in cli)
            and self.default_params
        ):
            log.info("no sweep given: running the default study sweep %s", dict(self.default_params))
            self.params, design = dict(self.default_params), self.default_design
        self.design_run = sweep_design(self.config, adhoc) if design == self.design else design
        params_conf = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        if searching:
            if not self.study.ddmin.differences:
                raise HydraException(
                    "design=ddmin needs study.ddmin.differences (see orchestrator/analysis/ddmin.py)"
                )
            self._ddmin_base = ddmin_base(choices_of(parser.parse_overrides(params_conf))) + extra
        if design in ("ofat", "sequential"):
            choices = choices_of(parser.parse_overrides(params_conf))
            if design == "sequential":
                from orchestrator.plan import arm_label

                choices.pop("repetition", None)  # the rounds number the repetitions
                arms = ofat_jobs(choices, self.study.baseline)
                self._arms = {arm_label(job_levels(job), self.study.baseline): job + extra for job in arms}
            else:
                jobs = ofat_jobs(choices, self.study.baseline)
                self._ofat_batches = batches([job + extra for job in jobs], self.max_batch_size)
        if self._launches_nothing():
            self.launcher = _DryRunLauncher()
        return super().sweep(list(arguments) + extra)

    def _launches_nothing(self) -> bool:
        """dry_run (print the arms) or preflight_only (check them on their hosts): no job runs."""
        assert self.config is not None
        return bool(self.config.get("dry_run") or self.config.get("preflight_only"))

    def is_done(self) -> bool:
        if self._ddmin_base is not None:
            self._round = self._next_ddmin_round()
            return not self._round
        if self._arms is None:
            return BasicSweeper.is_done(self)
        self._round = self._next_round()
        return not self._round

    def get_job_batch(self):
        if self._arms is None and self._ddmin_base is None:
            return BasicSweeper.get_job_batch(self)
        return self._round

    def _next_ddmin_round(self) -> "list[list[str]]":
        """The next ddmin round's jobs from the runs so far (none: the search is over); logs where the
        search stands."""
        import math
        import os

        from orchestrator.analysis import ddmin, run_used
        from orchestrator.tracking import PARENT_ENV, load_study

        assert self.config is not None and self._ddmin_base is not None
        uri, run_id = str(self.config.tracking.uri), os.environ.get(PARENT_ENV)
        ids = [d.id for d in self.study.ddmin.differences]
        records = load_study(uri, self.study.name)[2] if run_id and self._planned else []
        runs, started = ddmin.runs_from_records(records, ids, run_used)
        nxt = ddmin.next_round(ids, runs, started, ddmin.Settings.of(self.study))
        for trial in nxt.result.trials:
            log.info(
                "ddmin trial %d (%s): %s, %d runs, over %.2f / under %.2f of %.2f",
                trial.index,
                ddmin.describe_subset(trial.subset, ids),
                trial.verdict or "running",
                len(trial.runs),
                trial.evidence.over,
                trial.evidence.under,
                math.log(1 / trial.alpha),
            )
        if not nxt.jobs:
            log.info("ddmin done: %s", nxt.result.outcome)
            return []
        if self._launches_nothing() and self._launched >= 0:
            log.info("the first round shown and checked; the later rounds depend on its evidence")
            return []
        bench_on = bool(self.config.bench.get("enabled", True))
        jobs = [ddmin_job(self._ddmin_base, sorted(s), rep, bench and bench_on) for s, rep, bench in nxt.jobs]
        if self._launches_nothing():
            # shown and checked beside the first round: the bad configuration, every difference applied,
            # so each difference's env vars and flags meet the hosts before any start
            bad = ddmin_job(self._ddmin_base, sorted(ids), 0, False)
            jobs += [bad] if bad not in jobs else []
        again = [j for j in jobs if tuple(j) in self._ddmin_launched]
        if again:
            raise HydraException(
                f"design=ddmin: the runs of {again[0]} are not in the tracking store {uri} (the study "
                f"callback records them: hydra.callbacks.study), so the search cannot go on"
            )
        self._ddmin_launched |= {tuple(j) for j in jobs}
        self._launched += 1
        log.info("ddmin round %d: %s", self._launched, "; ".join(" ".join(j[-4:-2]) for j in jobs))
        return jobs

    def _next_round(self) -> "list[list[str]]":
        """The next sequential round's jobs from the evidence so far (none: the study is over); logs
        the round's evidence to the terminal and to the parent run (a metric per claim, step = round)."""
        import os

        from orchestrator.analysis import run_used, sequential
        from orchestrator.plan import BASELINE_LABEL
        from orchestrator.tracking import PARENT_ENV, load_study, log_look

        assert self.config is not None and self._arms is not None
        uri, run_id = str(self.config.tracking.uri), os.environ.get(PARENT_ENV)
        records = load_study(uri, self.study.name)[2] if run_id and self._planned else []
        hyps = sequential.study_hypotheses(self.study)
        looks, nxt = sequential.next_round(
            self.study,
            hyps,
            sequential.arm_runs(records, self.study, run_used),
            BASELINE_LABEL,
            int(self.config.workload.sessions),
        )
        if looks:
            log.info("%s", sequential.describe(looks[-1], sequential.Thresholds.of(self.study.alpha)))
            if run_id:
                log_look(uri, run_id, looks[-1])
        if not nxt.arms:
            log.info("sequential study done after %d round(s): %s", len(looks), nxt.stop_reason)
            return []
        if self._launches_nothing() and self._launched >= 0:
            log.info("round 0 shown and checked; the later rounds depend on its evidence")
            return []
        if nxt.round <= self._launched:
            raise HydraException(
                f"design=sequential: the runs of round {self._launched} are not in the tracking store "
                f"{uri} (the study callback records them: hydra.callbacks.study), so the next round "
                f"cannot be chosen"
            )
        self._launched = nxt.round
        missing = [label for label in nxt.arms if label not in self._arms]
        if missing:
            raise HydraException(
                f"design=sequential needs the arms {missing}, which the sweep does not cover; sweep "
                f"every hypothesis' factor (hydra.sweeper.params) over its baseline and treatment levels"
            )
        log.info("round %d: %s", nxt.round, ", ".join(nxt.arms))
        bench_on = bool(self.config.bench.get("enabled", True))
        return round_jobs(self._arms, nxt.arms, nxt.round, nxt.bench, bench_on)

    def split_arguments(self, overrides, max_batch_size):  # type: ignore[override]
        if self._ofat_batches is not None:
            return self._ofat_batches
        return BasicSweeper.split_arguments(overrides, max_batch_size)

    def validate_batch_is_legal(self, batch) -> None:
        """Compose, type and plan every job of the batch, and have the hosts check each distinct arm,
        before any job runs. A refused sweep ends its parent run FAILED with the reason."""
        # (Hydra's own check composes every job too: this one does that and more, so it replaces it)
        assert self.hydra_context is not None and self.config is not None
        from orchestrator.checks import check_local_side
        from orchestrator.config import ConfigError, jobs_on_pool, load_job
        from orchestrator.plan import plan_arm
        from orchestrator.preflight import check_sweep_on_hosts

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
        # arm is composed and planned once (a dsv4 study: 5 compositions instead of 15)
        arms: dict[tuple, object] = {}
        for overrides in batch:
            job_name = " ".join(overrides)
            key = arm_overrides(overrides)
            if key not in arms:
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(key))
                try:
                    arms[key] = [plan_arm(job) for job in jobs_on_pool(load_job(cfg))]
                except ConfigError as e:
                    arms[key] = e
            found = arms[key]
            if isinstance(found, ConfigError):
                problems += [f"{p}{JOB_SEP}{job_name}" for p in found.problems]
            else:
                planned.append((job_name, found[0]))
                on_members += [(job_name, plan) for plan in found]
            problems += [f"{p}{JOB_SEP}{job_name}" for p in repetition_problems(overrides)]
        if not problems and dry_run:
            from orchestrator.dryrun import arm_listing

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
        from orchestrator.callbacks import open_parent_run

        open_parent_run()
        self._record_planned(planned, batch)

    def _record_planned(self, planned, batch) -> None:
        """The parent run keeps every (signature, repetition) the sweep plans: a resumed sweep's report
        counts the earlier FINISHED runs of exactly these jobs."""
        import os

        from orchestrator.tracking import PARENT_ENV, record_planned

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
        from orchestrator.callbacks import opened_parent_run

        run_id = opened_parent_run()
        if not run_id:
            return
        from orchestrator.redact import redact_text
        from orchestrator.tracking import end_run_refused  # MLflow: only where a run is to be ended

        secrets = {name: value for _, plan in planned for name, value in plan.secrets.items()}
        assert self.config is not None
        end_run_refused(str(self.config.tracking.uri), run_id, redact_text(reason, secrets))
