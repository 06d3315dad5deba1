"""What a verdict costs in GPU time, and the run size that buys the most evidence for it (pure).

On a real cluster a session is the cheap part: a DeepSeek-V4 PD restart is minutes of model load on every
GPU of both roles, and a 60-session stress run at full load about a minute. So a study's GPU time is
mostly restarts, and a design that saves sessions by adding starts can cost more.

The model: a run of n sessions holds the deployment's GPUs for

    restart_s + n * session_s (+ bench_s when it carries the throughput sweep)

and GPU time is GPUs x that wall time. Each figure comes from, first to last:
- the study (`study.cost.<figure>`): what the user knows of the cluster the study will run on;
- the study's own finished runs, once there are any: the median over runs of (wall time - stress time)
  is the restart (start-up, health gate, teardown), the median stress time per session the session, and
  the median extra wall time of the runs with a throughput sweep the sweep;
- the deployment's estimate (`deployment.cost`).
The report states which, per figure.

Run size. A start of n sessions at ICC rho is worth n / (1 + (n - 1) rho) independent sessions (the
design effect, `stats.design_effect`): past about 1 / rho sessions a start adds little, however long it
runs. Per GPU-second that is n / ((1 + (n - 1) rho) (restart_s + n session_s)), largest near
n* = sqrt(restart_s (1 - rho) / (session_s rho)): more sessions on one start while a start is dear next
to them, more starts once the restart variation makes another session on the same start worth little.
`run_size` picks the best whole number of waves at the workload's load (each wave a full load, so every
session of a run is measured at the load the arm's identity names).

Why choosing the size keeps the verdicts honest: a run's size is fixed before it starts, from the runs
before it, so the anytime-valid evidence (analysis/sequential.py: a likelihood ratio over runs) is still
a test martingale, as for any stopping rule that looks only at the past. A run is pooled only when every
session it planned has an outcome (`runs.run_used`): a run cut short (killed, its server dead) is never
pooled, so no outcome-dependent cut, such as a server that dies of the corruption it measures, enters the
rate. The pooled rate of runs of different sizes weighs each by its sessions; the design effect of an
arm is computed from the size-weighted mean run size (`stats.design_effect`), exact for the variance of
the pooled rate under the beta-binomial model.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.analysis import result
from orchestrator.analysis.stats import design_effect

FIGURES = ("restart_s", "session_s", "bench_s", "gpus")
# the sizing never assumes starts vary less than this: the ICC is noisy early (none at the first round),
# and sizing by an ICC of 0 would put every session on one start. Only efficiency rests on it: the
# evidence uses the study's own ICC
SIZING_ICC_FLOOR = 0.02


@dataclass(frozen=True)
class CostModel:
    """What a run costs: seconds per restart, per session and per throughput sweep, GPUs held; `sources`
    says where each figure came from (study.cost, the runs, the deployment)."""

    restart_s: float
    session_s: float
    bench_s: float
    gpus: int
    sources: Mapping[str, str] = field(default_factory=dict)

    def run_s(self, sessions: int, bench: bool = False) -> float:
        """Wall seconds of one run of `sessions` sessions."""
        return self.restart_s + sessions * self.session_s + (self.bench_s if bench else 0.0)

    def gpu_hours(self, seconds: float) -> float:
        return self.gpus * seconds / 3600

    def figures(self) -> result.CostFigures:
        """The model as report.json states it (rounded as a report shows it)."""
        return result.CostFigures(
            restart_s=round(self.restart_s, 3),
            session_s=round(self.session_s, 4),
            bench_s=round(self.bench_s, 3),
            gpus=self.gpus,
            sources=dict(self.sources),
        )


def measured(records: Iterable[Any]) -> dict[str, tuple[float, int]]:
    """figure -> (median, runs it rests on), from the finished runs with a wall time and a stress time
    (`RunRecord.wall_s`, `.stress_s`); a figure no run shows is absent."""
    plain, swept, per_session = [], [], []
    for r in records:
        if r.status != "FINISHED" or r.wall_s is None or r.stress_s is None:
            continue
        n = r.clean + r.corrupted + r.errored
        if n > 0:
            per_session.append(r.stress_s / n)
        (swept if r.bench else plain).append(max(0.0, r.wall_s - r.stress_s))
    out: dict[str, tuple[float, int]] = {}
    if per_session:
        out["session_s"] = (statistics.median(per_session), len(per_session))
    if plain:
        out["restart_s"] = (statistics.median(plain), len(plain))
    if swept and plain:
        out["bench_s"] = (max(0.0, statistics.median(swept) - statistics.median(plain)), len(swept))
    return out


def cost_model(study: Any, deployment: Mapping[str, Any] | None, records: Iterable[Any] = ()) -> CostModel:
    """The cost model of a study (module doc): `study` its `study.cost` (None values: not set),
    `deployment` the deployment's `cost` block, `records` the study's runs so far."""
    found = measured(records)
    deployment = dict(deployment or {})
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for figure in FIGURES:
        given = getattr(study, figure, None) if study is not None else None
        if given is not None:
            values[figure], sources[figure] = float(given), "study.cost"
        elif figure in found:
            value, runs = found[figure]
            values[figure], sources[figure] = value, f"measured: median of {runs} run(s)"
        elif deployment.get(figure) is not None:
            values[figure], sources[figure] = float(deployment[figure]), "deployment.cost"
        else:
            values[figure], sources[figure] = (1.0 if figure == "gpus" else 0.0), "unknown"
    return CostModel(
        values["restart_s"], values["session_s"], values["bench_s"], max(0, int(values["gpus"])), sources
    )


def effective_sessions(sessions: int, icc: float) -> float:
    """What a start of `sessions` sessions is worth in independent sessions at ICC `icc`."""
    return sessions / design_effect(icc, sessions)


def run_size(cost: CostModel, icc: float, load: int, smallest: int, largest: int) -> int:
    """The sessions of the next start that buy the most evidence per GPU-second (module doc): a whole
    number of waves of `load` sessions, between `smallest` and `largest` (a bound that is no whole
    number of waves is kept as it is)."""
    smallest, largest = max(1, int(smallest)), max(1, int(largest))
    if largest <= smallest:
        return smallest
    rho = max(float(icc), SIZING_ICC_FLOOR)
    load = max(1, int(load))
    sizes = {smallest, largest, *range(math.ceil(smallest / load) * load, largest + 1, load)}

    def per_second(n: int) -> float:
        return effective_sessions(n, rho) / max(cost.run_s(n), 1e-9)

    # the smallest of the best (ties: the shorter run, sooner evidence)
    return max(sorted(sizes), key=lambda n: (round(per_second(n), 12), -n))


@dataclass(frozen=True)
class Spent:
    """GPU time a set of runs took: measured where a run's wall time is known, else by the model."""

    gpu_hours: float
    wall_s: float
    starts: int
    sessions: int
    modelled_runs: int  # runs whose time is the model's, not measured
    # every run by the model alone: what compares with the fixed design's (`fixed_design_hours`), which
    # has no runs to measure
    model_hours: float = 0.0


def spent(records: Iterable[Any], cost: CostModel) -> Spent:
    """What the runs so far held, every run counted (a failed or killed run held the GPUs too)."""
    wall, by_model, starts, sessions, modelled = 0.0, 0.0, 0, 0, 0
    for r in records:
        n = r.clean + r.corrupted + r.errored
        starts += 1
        sessions += n
        model_s = cost.run_s(max(n, r.planned), bool(r.bench))
        by_model += model_s
        if r.wall_s is not None:
            wall += r.wall_s
        else:
            wall += model_s
            modelled += 1
    return Spent(cost.gpu_hours(wall), wall, starts, sessions, modelled, cost.gpu_hours(by_model))


def fixed_design_hours(
    cost: CostModel, arms: int, starts_per_arm: int, sessions: int, benched: int = 0
) -> float:
    """GPU hours of the fixed design: every arm `starts_per_arm` starts of `sessions`, `benched` of them
    with the throughput sweep."""
    runs = arms * starts_per_arm
    return cost.gpu_hours(runs * cost.run_s(sessions) + benched * cost.bench_s)


def cost_block(
    cost: CostModel,
    records: Sequence[Any],
    arm_of: Callable[[Any], str],
    fixed_hours: float | None = None,
    remaining_hours: float | None = None,
) -> result.Cost:
    """report.json's `cost` block: the model and where each figure came from, GPU time spent in all and
    per arm (measured where recorded), the same runs by the model alone, and, where the design gives
    them, the fixed design's (by the model: compare it with `model_gpu_hours`) and what is left."""
    total = spent(records, cost)
    by_arm: dict[str, list[Any]] = {}
    for r in records:
        by_arm.setdefault(arm_of(r), []).append(r)
    per_arm = {}
    for label, runs in sorted(by_arm.items()):
        s = spent(runs, cost)
        per_arm[label] = result.ArmCost(round(s.gpu_hours, 4), s.starts, s.sessions)
    return result.Cost(
        model=cost.figures(),
        gpu_hours=round(total.gpu_hours, 4),
        wall_s=round(total.wall_s, 1),
        starts=total.starts,
        sessions=total.sessions,
        modelled_runs=total.modelled_runs,
        model_gpu_hours=round(total.model_hours, 4),
        per_arm=per_arm,
        fixed_design_gpu_hours=None if fixed_hours is None else round(fixed_hours, 4),
        remaining_gpu_hours=None if remaining_hours is None else round(remaining_hours, 4),
    )
