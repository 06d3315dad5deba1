"""The study designs, one registry. A design says which jobs run next, from the runs recorded so far
(`next_round`), which jobs a study may run before any evidence narrows them (`jobs`: what a dry run lists
and a preflight checks), and what its report adds (`report_block`).

Two drivers run every design with the same loop, and neither knows one design from another:
- the study sweeper (hydra_plugins/heisenhunt_sweeper) launches a round's jobs through Hydra's launcher
  and reads their runs back from the tracking store;
- the rehearsal (orchestrator/study/rehearse.py) draws each job's run from a fault model.
So what is rehearsed is what runs.

| design     | rounds                                                                                |
| ---------- | ------------------------------------------------------------------------------------- |
| factorial  | the cartesian product of the swept values (Hydra's basic sweep), in launcher batches   |
| ofat       | the baseline arm and one arm per non-baseline level of each swept factor (every other   |
|            | factor at its baseline), times the product of the other swept keys, in batches         |
| sequential | the ofat arms in rounds (round r: repetition r) until the anytime-valid evidence        |
|            | decides or `study.stopping` is spent (analysis/sequential.py)                          |
| ddmin      | the subsets of `study.ddmin.differences` the search needs runs of next: its steering,  |
|            | then the answer's checks on fresh runs (analysis/ddmin.py)                             |

A job is the list of `key=value` overrides Hydra's launcher takes, with what the rehearsal and the logs
read beside it: its arm's label and factor levels and its repetition. Which design a sweep runs is
decided once, by `choose`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from hydra.errors import HydraException

from orchestrator.config.plan import BASELINE_LABEL, arm_label

# orchestrator.analysis (numpy, scipy) is imported where a round is chosen: Hydra imports the sweeper
# plugin, and with it this module, at every start, a single run's too
if TYPE_CHECKING:
    from orchestrator.analysis.result import DdminSearch, Stopping

FACTOR_PREFIX = "factor/"
# the overrides by which a design sizes a run (Sequential.run_size)
SIZE_KEYS = ("workload.sessions", "workload.concurrency")


class DesignError(HydraException, ValueError):
    """A sweep the design cannot run (a missing baseline level, an arm the sweep does not cover, ...)."""


@dataclass(frozen=True)
class Job:
    """One job: the overrides it runs with, and its arm's label, factor levels and repetition."""

    overrides: tuple[str, ...]
    label: str
    levels: Mapping[str, str]
    repetition: int
    # the run's sessions where the design sized it (None: the workload's)
    sessions: int | None = None


@dataclass(frozen=True)
class Round:
    """The jobs to launch next (none: the study is over), where the study stands (`notes`, for the
    terminal), the sequential evidence so far (`look`, for the parent run's metrics) and why it stops."""

    index: int
    jobs: tuple[Job, ...]
    notes: tuple[str, ...] = ()
    look: Any = None
    stop_reason: str = ""


class Design(Protocol):
    name: ClassVar[str]
    # whether a round depends on the evidence of the ones before it (a dry run shows only the first)
    adaptive: ClassVar[bool]

    def jobs(self) -> list[Job]: ...

    def next_round(self, records: Sequence[Any], launched: int) -> Round: ...

    # a sequential study's stopping trace, a ddmin study's search, or nothing (a fixed design)
    def report_block(self, records: Sequence[Any]) -> Stopping | DdminSearch | None: ...


# --- override strings ---------------------------------------------------------------------------------


def key_of(assignment: str) -> str:
    return assignment.split("=", 1)[0].lstrip("+~")


def value_of(assignment: str) -> str:
    return assignment.split("=", 1)[1]


def job_levels(overrides: Sequence[str]) -> dict[str, str]:
    """The factor levels a job's overrides choose (`factor/<name>=<level>`)."""
    return {
        key_of(a)[len(FACTOR_PREFIX) :]: value_of(a) for a in overrides if key_of(a).startswith(FACTOR_PREFIX)
    }


def job_repetition(overrides: Sequence[str], default: int = 0) -> int:
    """The repetition a job runs (its `repetition=` override, else `default`)."""
    values = [value_of(a) for a in overrides if key_of(a) == "repetition" and value_of(a).isdigit()]
    return int(values[-1]) if values else default


def _job(overrides: Sequence[str], baseline: Mapping[str, str], default_repetition: int = 0) -> Job:
    levels = job_levels(overrides)
    return Job(
        tuple(overrides), arm_label(levels, baseline), levels, job_repetition(overrides, default_repetition)
    )


def factorial_overrides(choices: Mapping[str, list[str]]) -> list[list[str]]:
    """Every combination of the swept values, in Hydra's basic sweeper's order."""
    return [list(combo) for combo in itertools.product(*choices.values())]


def _is_swept_factor(key: str, values: Sequence[str]) -> bool:
    # a factor pinned to one level (e.g. on the command line) is a constant of the sweep, not an arm
    return key.lstrip("+~").startswith(FACTOR_PREFIX) and len(values) > 1


def ofat_overrides(choices: Mapping[str, list[str]], baseline: Mapping[str, str]) -> list[list[str]]:
    """Baseline plus one-factor-at-a-time deviations, times the product of the non-factor keys.
    `choices`: key -> its values as `key=value` strings, in command-line order."""
    factor_keys = [k for k in choices if _is_swept_factor(k, choices[k])]
    other_keys = [k for k in choices if k not in factor_keys]
    base: dict[str, str] = {}
    for key in factor_keys:
        name = key.lstrip("+~")[len(FACTOR_PREFIX) :]
        levels = [value_of(a) for a in choices[key]]
        wanted = baseline.get(name)
        if wanted is None:
            raise DesignError(
                f"design=ofat sweeps {key} over {levels} but study.baseline.{name} is not set; "
                f"set it to one of {levels}"
            )
        wanted = str(wanted)
        if wanted not in levels:
            raise DesignError(
                f"study.baseline.{name}={wanted!r} is not among the swept levels {levels} of {key}"
            )
        base[key] = f"{key}={wanted}"
    arms = [dict(base)]
    for key in factor_keys:
        for assignment in choices[key]:
            if assignment != base[key]:
                arms.append({**base, key: assignment})
    return [
        list(arm.values()) + list(rest)
        for arm in arms
        for rest in itertools.product(*(choices[k] for k in other_keys))
    ]


def _bench_overrides(bench: bool) -> list[str]:
    # `bench.repetitions=null` lets `bench.enabled` alone decide whether the job sweeps throughput
    return [f"bench.enabled={str(bench).lower()}", "bench.repetitions=null"]


# --- the designs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fixed:
    """factorial and ofat: every job is known up front; round i is launcher batch i."""

    name: str
    planned: tuple[Job, ...]
    batch_size: int | None = None
    adaptive: ClassVar[bool] = False

    def jobs(self) -> list[Job]:
        return list(self.planned)

    def batches(self) -> list[tuple[Job, ...]]:
        size = self.batch_size or len(self.planned) or 1
        return [self.planned[i : i + size] for i in range(0, len(self.planned), size)]

    def next_round(self, records: Sequence[Any], launched: int) -> Round:
        batches = self.batches()
        index = launched + 1
        return Round(index, batches[index] if index < len(batches) else (), stop_reason="every job launched")

    def report_block(self, records: Sequence[Any]) -> None:
        return None


@dataclass(frozen=True)
class Sequential:
    """The ofat arms in rounds, until the evidence decides (analysis/sequential.py)."""

    spec: Any
    arms: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # label -> the arm's overrides
    sessions: int = 0
    bench_on: bool = True
    # the sessions in flight at once (the workload's concurrency, else `sessions`): what a larger run
    # keeps, wave after wave, so that its sessions measure what the arm's identity names
    load: int = 0
    # the deployment's cost estimate (`deployment.cost`), until the study's runs measure their own
    deployment_cost: Mapping[str, Any] = field(default_factory=dict)
    name: ClassVar[str] = "sequential"
    adaptive: ClassVar[bool] = True

    def _job(self, label: str, repetition: int, bench: bool, size: int | None = None) -> Job:
        base = self.arms[label]
        if size is not None:  # the run's own size, at the arm's load (analysis/cost.py)
            base = tuple(a for a in base if key_of(a) not in SIZE_KEYS)
            base = (*base, f"workload.sessions={size}", f"workload.concurrency={self.load or self.sessions}")
        overrides = (*base, f"repetition={repetition}", *_bench_overrides(bench))
        return Job(overrides, label, job_levels(overrides), repetition, size)

    def jobs(self) -> list[Job]:
        return [self._job(label, 0, self.bench_on) for label in self.arms]

    def run_size(self, records: Sequence[Any], icc: float) -> int | None:
        """The sessions of the next round's starts, by what a GPU-second buys (analysis/cost.py); None:
        runs keep the workload's size (`study.stopping.max_run_sessions` unset or no larger)."""
        from orchestrator.analysis import cost

        largest = self.spec.stopping.max_run_sessions
        if not largest or largest <= self.sessions:
            return None
        model = cost.cost_model(self.spec.cost, self.deployment_cost, records)
        return cost.run_size(model, icc, self.load or self.sessions, self.sessions, int(largest))

    def next_round(self, records: Sequence[Any], launched: int) -> Round:
        from orchestrator.analysis import sequential
        from orchestrator.analysis.runs import run_used

        hyps = sequential.study_hypotheses(self.spec)
        arms = sequential.arm_runs(records, self.spec, run_used)
        done = [r for a in arms.values() for r in a.started]
        assumed = float(self.spec.assumed_icc)
        size = self.run_size(records, sequential.icc_at(arms, max(done), assumed) if done else assumed)
        looks, nxt = sequential.next_round(self.spec, hyps, arms, BASELINE_LABEL, size or self.sessions)
        look = looks[-1] if looks else None
        notes = (sequential.describe(look, sequential.Thresholds.of(self.spec.alpha)),) if look else ()
        if not nxt.arms:
            return Round(nxt.round, (), notes, look, nxt.stop_reason)
        missing = [label for label in nxt.arms if label not in self.arms]
        if missing:
            raise DesignError(
                f"design=sequential needs the arms {missing}, which the sweep does not cover; sweep "
                f"every hypothesis' factor (hydra.sweeper.params) over its baseline and treatment levels"
            )
        jobs = tuple(
            self._job(label, nxt.round, self.bench_on and label in nxt.bench, size) for label in nxt.arms
        )
        sized = f" ({size} sessions each)" if size else ""
        return Round(nxt.round, jobs, (*notes, f"round {nxt.round}: {', '.join(nxt.arms)}{sized}"), look)

    def report_block(self, records: Sequence[Any]) -> Stopping:
        """The study's `result.Stopping` (analysis/sequential.py)."""
        from orchestrator.analysis import sequential
        from orchestrator.analysis.runs import run_used

        return sequential.stopping_block(self.spec, records, run_used)


@dataclass(frozen=True)
class Ddmin:
    """The subsets of the differences the search needs next (analysis/ddmin.py). `base`: the overrides
    every job shares (the good configuration's)."""

    spec: Any
    base: tuple[str, ...] = ()
    bench_on: bool = True
    name: ClassVar[str] = "ddmin"
    adaptive: ClassVar[bool] = True

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.spec.ddmin.differences]

    def job(self, subset: frozenset[str], repetition: int, bench: bool) -> Job:
        from orchestrator.analysis import ddmin

        applied = [d for d in self.ids if d in subset]
        overrides = (*self.base, f"ddmin_subset=[{','.join(sorted(applied))}]", f"repetition={repetition}")
        return Job(
            (*overrides, *_bench_overrides(bench)),
            ddmin.describe_subset(subset, self.ids),
            ddmin.levels_of(subset, self.ids),
            repetition,
        )

    def jobs(self) -> list[Job]:
        """The first round, and the bad configuration (every difference applied): each difference's env
        vars and flags meet the hosts before any start."""
        first = list(self.next_round([], -1).jobs)
        bad = self.job(frozenset(self.ids), 0, False)
        return first + ([bad] if bad.overrides not in {j.overrides for j in first} else [])

    def next_round(self, records: Sequence[Any], launched: int) -> Round:
        from orchestrator.analysis import ddmin
        from orchestrator.analysis.runs import run_used

        runs, started = ddmin.runs_from_records(records, self.ids, run_used)
        nxt = ddmin.next_round(self.ids, runs, started, ddmin.Settings.of(self.spec))
        notes = tuple(
            f"ddmin {t.role} {t.index} ({ddmin.describe_subset(t.subset, self.ids)}): "
            f"{t.verdict or 'running'}, {len(t.runs)} runs, over {t.evidence.over:.2f} / under "
            f"{t.evidence.under:.2f} of {t.log_threshold:.2f}"
            for t in nxt.result.trials
        )
        if not nxt.jobs:
            return Round(launched + 1, (), notes, stop_reason=f"ddmin done: {nxt.result.outcome}")
        jobs = tuple(self.job(s, rep, bench and self.bench_on) for s, rep, bench in nxt.jobs)
        step = "; ".join(f"{j.label} repetition={j.repetition}" for j in jobs)
        return Round(launched + 1, jobs, (*notes, f"ddmin round {launched + 1}: {step}"))

    def report_block(self, records: Sequence[Any]) -> DdminSearch:
        """The study's `result.DdminSearch` (analysis/ddmin.py)."""
        from orchestrator.analysis import ddmin
        from orchestrator.analysis.runs import run_used

        return ddmin.search_block(self.spec, records, run_used)


DESIGNS: dict[str, type] = {"factorial": Fixed, "ofat": Fixed, "sequential": Sequential, "ddmin": Ddmin}


# --- which design, and building it from a sweep --------------------------------------------------------


def check_name(name: str, key: str) -> str:
    if name not in DESIGNS:
        raise DesignError(f"{key}={name!r} is not one of {list(DESIGNS)}")
    return name


def choose(sweeper: Mapping[str, Any], cli_sweeps: bool, adhoc: bool) -> tuple[str, dict[str, str]]:
    """(design, swept params) of a sweep: the study's (`hydra.sweeper.design`/`params`), unless neither
    the study nor the command line sweeps anything; then the default sweep (`default_design`/
    `default_params`), which makes `python -m orchestrator` with no arguments a small study."""
    design = check_name(str(sweeper.get("design") or "factorial"), "hydra.sweeper.design")
    params = {str(k): str(v) for k, v in (sweeper.get("params") or {}).items()}
    defaults = {str(k): str(v) for k, v in (sweeper.get("default_params") or {}).items()}
    if design == "ddmin" or params or cli_sweeps or adhoc or not defaults:
        return design, params
    return check_name(str(sweeper.get("default_design") or "ofat"), "hydra.sweeper.default_design"), defaults


def ddmin_base(choices: Mapping[str, list[str]]) -> list[str]:
    """The overrides every ddmin job shares: the command line's, each with one value. A ddmin study
    searches its differences; a swept key (a factor over several levels) is refused."""
    swept = [k for k, v in choices.items() if len(v) > 1 and k.lstrip("+~") != "repetition"]
    if swept:
        raise DesignError(
            f"design=ddmin searches study.ddmin.differences; it sweeps nothing else, but {swept} "
            f"have several values: give each one value (the good configuration's)"
        )
    return [v[-1] for k, v in choices.items() if k.lstrip("+~") not in ("repetition", "ddmin_subset")]


def build(
    name: str,
    spec: Any,
    choices: Mapping[str, list[str]],
    extra: Sequence[str] = (),
    sessions: int = 0,
    bench_on: bool = True,
    batch_size: int | None = None,
    load: int = 0,
    deployment_cost: Mapping[str, Any] | None = None,
) -> Design:
    """The design `name` over a sweep: `choices` (key -> its values as `key=value` strings, in
    command-line order), `extra` overrides every job gets, the sessions per run, whether the
    throughput sweep is on, and for a sequential design that sizes its runs, the load they keep and
    the deployment's cost estimate."""
    check_name(name, "hydra.sweeper.design")
    if name == "ddmin":
        if not spec.ddmin.differences:
            raise DesignError(
                "design=ddmin needs study.ddmin.differences (see orchestrator/analysis/ddmin.py)"
            )
        return Ddmin(spec, (*ddmin_base(choices), *extra), bench_on)
    if name == "sequential":
        arms_choices = {
            k: v for k, v in choices.items() if k.lstrip("+~") != "repetition"
        }  # rounds number them
        arms = {}
        for overrides in ofat_overrides(arms_choices, spec.baseline):
            arms[arm_label(job_levels(overrides), spec.baseline)] = (*overrides, *extra)
        return Sequential(spec, arms, sessions, bench_on, load or sessions, dict(deployment_cost or {}))
    expand = ofat_overrides(choices, spec.baseline) if name == "ofat" else factorial_overrides(choices)
    return Fixed(name, tuple(_job([*o, *extra], spec.baseline) for o in expand), batch_size)


def analyse_study(
    spec: Any, runs: Sequence[Any], context: Mapping[str, Any] | None = None, conditions: Any = None
) -> Any:
    """`analysis.analyse` under the design `context["design"]` names: with its own block in the report (a
    sequential study's stopping trace, a ddmin search)."""
    from orchestrator.analysis.study import analyse

    return analyse(spec, runs, context, conditions, design=for_report((context or {}).get("design"), spec))


def for_report(name: str | None, spec: Any) -> Design | None:
    """The design whose `report_block` a report of this study adds (None: a fixed design, none)."""
    if spec.ddmin.differences:
        return Ddmin(spec)
    if name == "sequential":
        return Sequential(spec)
    return None
