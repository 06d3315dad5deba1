"""Rehearse a study design before spending GPU hours: run it thousands of times against a fault model, at
the level of session outcomes, through the same analysis that judges real runs (`analysis.analyse`).

    python -m orchestrator.study.rehearse +experiment=<study> [fault_model=PATH] [rehearse.studies=N]
        [rehearse.seed=S] [rehearse.json=OUT] [rehearse.restart_icc=RHO] [rehearse.kill_rate=Q]
        [hydra.sweeper.design=sequential] [other Hydra overrides]

e.g. `... repetition=0,1,2,3` rehearses four runs per arm, as the same override would run them.

The study, its design and its workload come from the composed config, as `python -m orchestrator`
sees them: the design is built as the sweeper builds it (`designs.choose`, `designs.build`, from
`hydra.sweeper.params` and the command line), and every study runs through `rehearsed_study`, the one
loop that asks the design's `next_round` for jobs, as the sweeper does, and draws each job's run. Each
job's truth comes from the fault model (the built-in one, or `fault_model=PATH`): the job is composed
with its exact overrides and planned as a real job would be (`plan.plan_arm`), its two roles'
effective configs (parsed by the sim's own parsers) pick the model's rule, and the rule gives
- the session rate q = 1 - (1 - p)^rounds, p the rule's per-turn probability at the workload's
  concurrency (every session concurrent unless `workload.concurrency` says otherwise: the decode's load
  is about that; `tests/sim/test_calibration.py` checks it against real sim runs), and
- the rule's `restart_icc` rho: each run (server start) draws its rate from Beta(mean q, ICC rho), as
  the sim does (docs/fault-model.md); `rehearse.restart_icc` replaces every rule's value.

A hypothesis is causal when its treatment arm's modelled rate differs from the baseline's. A verdict is
wrong when it implicates (or partially implicates) a non-causal hypothesis, exonerates a causal one,
claims a reduction where the change raised the rate, or says "implicated" (corruption under the
ceiling) where the treatment's true rate is not under it. "Inconclusive" is never wrong; `expected`
names the verdict a study large enough would reach, and `all_expected` how often every hypothesis
reached it. Output (stdout, and `rehearse.json=OUT`): `family_false_implication` (fraction of studies
in which at least one non-causal hypothesis was implicated or partial), `hypotheses[]` (`id`,
`causal`, `verdicts`: fraction per verdict, `wrong`, `expected`), `all_right` (fraction of studies
with no wrong verdict), `all_expected`, `sessions_per_study` (mean), and the estimated ICC.

With `hydra.sweeper.design=sequential` (or an experiment that sets it, e.g. dsv4_sequential) each study
runs in rounds until it stops; `rehearse.kill_rate=Q` kills each run part-way with probability Q (never
pooled, as a real killed run). The output adds `rounds_per_study`, `sessions_per_arm` and
`fixed_design_sessions` (every arm for `study.stopping.max_runs_per_arm` starts). Every rehearsed study
is judged by `analysis.analyse`, as a real study's report is.

The cores, `rehearse`, `rehearse_sequential` and `rehearse_ddmin`, are pure: (study, design, arm truths,
studies, seed) -> tallies.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchestrator import analysis
from orchestrator.analysis import VERDICTS, RunRecord, StudySpec, cost, ddmin, stats
from orchestrator.analysis.result import DdminSearch, StudyResult, to_json
from orchestrator.study import designs

DEFAULT_STUDIES = 2000
DEFAULT_SEED = 0
OPTIONS = ("studies", "seed", "json", "restart_icc", "kill_rate")


@dataclass(frozen=True)
class ArmTruth:
    """What the fault model says of one arm: its mean session rate and its between-run ICC."""

    label: str
    levels: dict[str, str]
    rate: float
    icc: float = 0.0
    rule: str | None = None
    signature: str | None = None  # the planned arm's (composed from a config); else rehearsal[label]

    @property
    def run_signature(self) -> str:
        return self.signature or f"rehearsal[{self.label}]"


# --- the pure core ---------------------------------------------------------------------------------


def study_arms(spec: StudySpec) -> list[tuple[str, dict[str, str]]]:
    """(label, factor levels) of the arms the study's verdicts compare: baseline, then each treatment."""
    arms = {analysis.BASELINE_LABEL: dict(spec.baseline)}
    for h in spec.hypotheses:
        levels = {**spec.baseline, h.factor: h.treatment}
        arms.setdefault(analysis.arm_label(levels, spec.baseline), levels)
    return list(arms.items())


def truth(spec: StudySpec, arms: Sequence[ArmTruth]) -> list[dict[str, Any]]:
    """Per hypothesis: its arms' true rates, whether it is causal, and the verdict it should reach."""
    by_label = {a.label: a for a in arms}
    base = by_label[analysis.BASELINE_LABEL]
    rows = []
    for h in spec.hypotheses:
        treat = by_label[analysis.arm_label({**spec.baseline, h.factor: h.treatment}, spec.baseline)]
        causal = treat.rate != base.rate
        if not causal:
            expected = "exonerated"
        elif treat.rate > base.rate:
            expected = "inconclusive"  # the change makes it worse: no verdict claims that
        else:
            expected = "implicated" if treat.rate < spec.ceiling else "partial"
        rows.append(
            {
                "id": h.id,
                "causal": causal,
                "baseline_rate": base.rate,
                "treatment_rate": treat.rate,
                "expected": expected,
            }
        )
    return rows


def wrong(verdict: str, row: Mapping[str, Any], ceiling: float) -> bool:
    """Whether a verdict contradicts the truth (see the module doc); inconclusive never does."""
    if verdict == "inconclusive":
        return False
    if not row["causal"]:
        return verdict != "exonerated"
    if verdict == "exonerated":
        return True
    if row["treatment_rate"] > row["baseline_rate"]:
        return True  # implicated/partial claim a reduction
    return verdict == "implicated" and row["treatment_rate"] >= ceiling


def draw_counts(
    arms: Sequence[ArmTruth], runs: int, sessions: int, studies: int, rng: np.random.Generator
) -> np.ndarray:
    """Corrupted sessions per (study, arm, run): each run's rate from Beta(mean rate, ICC icc)."""
    counts = np.zeros((studies, len(arms), runs), dtype=np.int64)
    for i, arm in enumerate(arms):
        rate = np.full((studies, runs), arm.rate)
        if arm.icc > 0 and 0 < arm.rate < 1:
            if arm.icc >= 1:
                rate = (rng.random((studies, runs)) < arm.rate).astype(float)
            else:
                rate = rng.beta(*stats.beta_shape(arm.rate, arm.icc), size=(studies, runs))
        counts[:, i, :] = rng.binomial(sessions, rate)
    return counts


def study_runs(arms: Sequence[ArmTruth], counts: np.ndarray, sessions: int) -> list[RunRecord]:
    """One rehearsed study's runs, as `tracking.load_study` would give them for real ones."""
    return [
        RunRecord(
            run_id=f"{arm.label}-{rep}",
            status="FINISHED",
            signature=arm.run_signature,
            repetition=rep,
            factors=dict(arm.levels),
            outcomes="complete",
            clean=sessions - int(k),
            corrupted=int(k),
            planned=sessions,
        )
        for arm, per_run in zip(arms, counts, strict=True)
        for rep, k in enumerate(per_run)
    ]


def by_label(arms: Sequence[ArmTruth]) -> Callable[[designs.Job], ArmTruth]:
    """truth_of(job) for arms given as truths: the job's arm, by its label."""
    table = {a.label: a for a in arms}
    return lambda job: table[job.label]


def _factor_overrides(levels: Mapping[str, str]) -> tuple[str, ...]:
    return tuple(f"factor/{k}={v}" for k, v in levels.items())


def fixed_design(arms: Sequence[ArmTruth], runs: int) -> designs.Fixed:
    """The ofat design over these arms: each arm `runs` times, arm by arm, as the sweeper orders them."""
    jobs = tuple(
        designs.Job((*_factor_overrides(a.levels), f"repetition={rep}"), a.label, dict(a.levels), rep)
        for a in arms
        for rep in range(runs)
    )
    return designs.Fixed("ofat", jobs)


def sequential_design(
    spec: StudySpec,
    arms: Sequence[ArmTruth],
    sessions: int,
    load: int = 0,
    deployment_cost: Mapping[str, Any] | None = None,
) -> designs.Sequential:
    """The sequential design over these arms (the rehearsal draws no throughput: no bench)."""
    return designs.Sequential(
        spec,
        {a.label: _factor_overrides(a.levels) for a in arms},
        sessions,
        bench_on=False,
        load=load or sessions,
        deployment_cost=dict(deployment_cost or {}),
    )


def rehearsed_study(
    design: designs.Design,
    truth_of: Callable[[designs.Job], ArmTruth],
    sessions: int,
    rng: np.random.Generator,
    kill_rate: float = 0.0,
    earlier: Sequence[RunRecord] = (),
) -> list[RunRecord]:
    """One rehearsed study of any design, round by round through its `next_round` (what the sweeper
    calls), each job's run drawn from its arm's truth. `earlier`: the runs of the same study before it
    was extended (a larger budget) or resumed. With `kill_rate`, each run is killed part-way with that
    probability: a KILLED run whose outcomes are never pooled."""
    runs: list[RunRecord] = list(earlier)
    launched = -1
    while True:
        nxt = design.next_round(runs, launched)
        if not nxt.jobs:
            return runs
        runs += [
            drawn_run(truth_of(job), job.repetition, job.sessions or sessions, rng, kill_rate)
            for job in nxt.jobs
        ]
        launched = nxt.index


def judged(spec: StudySpec, design: designs.Design, runs: Sequence[RunRecord]) -> StudyResult:
    """A rehearsed study's report, by the analysis that judges real runs."""
    return designs.analyse_study(spec, runs, context={"design": design.name})


def rehearse_design(
    spec: StudySpec,
    design: designs.Design,
    truth_of: Callable[[designs.Job], ArmTruth],
    arms: Sequence[ArmTruth],
    sessions: int,
    studies: int,
    seed: int,
    kill_rate: float = 0.0,
    cost_model: cost.CostModel | None = None,
) -> tuple[dict[str, Any], list[StudyResult]]:
    """`studies` studies of `design`, each judged as a real one (`judged`); the tally (see the module doc)
    and the reports. `arms`: the truths of the arms the hypotheses compare. With `cost_model`, the tally
    has the GPU hours per study too (each run's by the model: a rehearsed run has no wall time)."""
    if sessions < 1 or studies < 1:
        raise ValueError(f"sessions={sessions}, studies={studies} must both be >= 1")
    rng = np.random.default_rng(seed)
    reports, hours, starts = [], 0.0, 0
    for _ in range(studies):
        runs = rehearsed_study(design, truth_of, sessions, rng, kill_rate)
        reports.append(judged(spec, design, runs))
        if cost_model is not None:
            hours += cost.spent(runs, cost_model).gpu_hours
        starts += len(runs)
    result = tally(spec, truth(spec, arms), reports, studies, seed)
    result["starts_per_study"] = starts / studies
    if cost_model is not None:
        result["cost"] = to_json(cost_model.figures())
        result["gpu_hours_per_study"] = hours / studies
    return result, reports


def _arms_info(arms: Sequence[ArmTruth]) -> list[dict[str, Any]]:
    return [{"label": a.label, "rate": a.rate, "restart_icc": a.icc, "rule": a.rule} for a in arms]


def rehearse(
    spec: StudySpec,
    arms: Sequence[ArmTruth],
    runs: int,
    sessions: int,
    studies: int,
    seed: int,
    design: designs.Design | None = None,
    truth_of: Callable[[designs.Job], ArmTruth] | None = None,
    cost_model: cost.CostModel | None = None,
) -> dict[str, Any]:
    """Simulate `studies` studies of a fixed design (default: ofat over `arms`, `runs` each) and judge each
    with `analysis.analyse`; tally verdicts."""
    if runs < 1:
        raise ValueError(f"runs={runs} must be >= 1")
    design = design or fixed_design(arms, runs)
    result, _ = rehearse_design(
        spec, design, truth_of or by_label(arms), arms, sessions, studies, seed, cost_model=cost_model
    )
    if cost_model is not None:
        result["fixed_design_gpu_hours"] = cost.fixed_design_hours(cost_model, len(arms), runs, sessions)
    result["design"] = {
        "design": design.name,
        "runs_per_arm": runs,
        "sessions_per_run": sessions,
        "arms": _arms_info(arms),
    }
    return result


def tally(
    spec: StudySpec,
    rows: Sequence[Mapping[str, Any]],
    reports: Sequence[StudyResult],
    studies: int,
    seed: int,
) -> dict[str, Any]:
    """The rehearsal's figures over the judged studies' reports (see the module doc)."""
    tally = {r["id"]: dict.fromkeys(VERDICTS, 0) for r in rows}
    wrong_n = dict.fromkeys(tally, 0)
    family_false = all_right = all_expected = 0
    sessions_total = 0
    icc_sum = 0.0
    for report in reports:
        verdicts = {h.id: h.verdict for h in report.hypotheses}
        bad = {r["id"] for r in rows if wrong(verdicts[r["id"]], r, spec.ceiling)}
        for r in rows:
            tally[r["id"]][verdicts[r["id"]]] += 1
            wrong_n[r["id"]] += r["id"] in bad
        family_false += any(not r["causal"] and verdicts[r["id"]] in ("implicated", "partial") for r in rows)
        all_right += not bad
        all_expected += all(verdicts[r["id"]] == r["expected"] for r in rows)
        sessions_total += sum(a.n for a in report.arms)
        icc_sum += report.between_runs.icc
    return {
        "study": spec.name,
        "studies": studies,
        "seed": seed,
        "family_false_implication": family_false / studies,
        "all_right": all_right / studies,
        "all_expected": all_expected / studies,
        "sessions_per_study": sessions_total / studies,
        "mean_icc_estimate": icc_sum / studies,
        "hypotheses": [
            {
                **r,
                "verdicts": {v: tally[r["id"]][v] / studies for v in VERDICTS},
                "wrong": wrong_n[r["id"]] / studies,
            }
            for r in rows
        ],
    }


def draw_run(arm: ArmTruth, sessions: int, rng: np.random.Generator) -> int:
    """Corrupted sessions of one run (server start) of an arm: its rate drawn from Beta(rate, ICC)."""
    return int(draw_counts([arm], 1, sessions, 1, rng)[0, 0, 0])


def drawn_run(
    arm: ArmTruth, repetition: int, sessions: int, rng: np.random.Generator, kill_rate: float = 0.0
) -> RunRecord:
    """One rehearsed run (server start) of an arm. With `kill_rate`, killed part-way with that
    probability: a KILLED run whose outcomes (mostly corrupted sessions: a corrupted session ends early)
    are never pooled."""
    k = draw_run(arm, sessions, rng)
    killed = kill_rate > 0 and rng.random() < kill_rate
    return RunRecord(
        run_id=f"{arm.label}-{repetition}",
        status="KILLED" if killed else "FINISHED",
        signature=arm.run_signature,
        repetition=repetition,
        factors=dict(arm.levels),
        outcomes="partial" if killed else "complete",
        clean=0 if killed else sessions - k,
        corrupted=k,
        planned=sessions,
    )


def sequential_study(
    spec: StudySpec,
    arms: Sequence[ArmTruth],
    sessions: int,
    rng: np.random.Generator,
    kill_rate: float = 0.0,
    earlier: Sequence[RunRecord] = (),
) -> list[RunRecord]:
    """One rehearsed sequential study over these arms (`rehearsed_study` of `sequential_design`)."""
    return rehearsed_study(
        sequential_design(spec, arms, sessions), by_label(arms), sessions, rng, kill_rate, earlier
    )


def rehearse_sequential(
    spec: StudySpec,
    arms: Sequence[ArmTruth],
    sessions: int,
    studies: int,
    seed: int,
    kill_rate: float = 0.0,
    design: designs.Design | None = None,
    truth_of: Callable[[designs.Job], ArmTruth] | None = None,
    cost_model: cost.CostModel | None = None,
) -> dict[str, Any]:
    """`rehearse` for `design: sequential`: each study runs in rounds until the evidence decides, and is
    judged as a sequential study's report is."""
    design = design or sequential_design(spec, arms, sessions)
    result, reports = rehearse_design(
        spec, design, truth_of or by_label(arms), arms, sessions, studies, seed, kill_rate, cost_model
    )
    result["design"] = {
        "design": "sequential",
        "sessions_per_run": sessions,
        "max_runs_per_arm": spec.stopping.max_runs_per_arm,
        "min_runs_per_arm": spec.stopping.min_runs_per_arm,
        "max_sessions": spec.stopping.max_sessions,
        "futility": spec.stopping.futility,
        "kill_rate": kill_rate,
        "arms": _arms_info(arms),
    }
    result["rounds_per_study"] = sum(r.stopping.rounds for r in reports) / studies
    result["fixed_design_sessions"] = len(arms) * spec.stopping.max_runs_per_arm * sessions
    if cost_model is not None:
        result["fixed_design_gpu_hours"] = cost.fixed_design_hours(
            cost_model, len(arms), spec.stopping.max_runs_per_arm, sessions
        )
    result["sessions_per_arm"] = {
        a.label: sum(r.stopping.sessions_per_arm.get(a.label, 0) for r in reports) / studies for a in arms
    }
    return result


def ddmin_study(
    spec: StudySpec,
    truth_of: Callable[[frozenset[str]], ArmTruth],
    sessions: int,
    rng: np.random.Generator,
    kill_rate: float = 0.0,
) -> list[RunRecord]:
    """One rehearsed ddmin study (`rehearsed_study` of the ddmin design), on runs drawn from each
    subset's truth (`truth_of`)."""
    ids = [d.id for d in spec.ddmin.differences]
    return rehearsed_study(
        designs.Ddmin(spec, bench_on=False),
        lambda job: truth_of(ddmin.subset_of(job.levels, ids)),
        sessions,
        rng,
        kill_rate,
    )


def true_minimal(ids: Sequence[str], truth_of: Callable[[frozenset[str]], ArmTruth]) -> frozenset[str] | None:
    """The minimal set of differences the fault model needs, when the corruption needs one conjunction
    of them: the differences whose removal from the bad configuration removes it (None: the bad
    configuration is clean, or those differences alone do not corrupt)."""
    everything = frozenset(ids)
    if truth_of(everything).rate <= 0:
        return None
    needed = frozenset(d for d in ids if truth_of(everything - {d}).rate <= 0)
    return needed if truth_of(needed).rate > 0 else None


def rehearse_ddmin(
    spec: StudySpec,
    truth_of: Callable[[frozenset[str]], ArmTruth],
    sessions: int,
    studies: int,
    seed: int,
    kill_rate: float = 0.0,
) -> dict[str, Any]:
    """`rehearse` for `design: ddmin`: each study searches until done, and is judged as the report
    judges it (`designs.Ddmin.report_block`): how often the minimal set found is the true one, and the
    sessions spent against a one-at-a-time sweep over every difference."""
    if sessions < 1 or studies < 1:
        raise ValueError(f"sessions={sessions}, studies={studies} must both be >= 1")
    ids = [d.id for d in spec.ddmin.differences]
    truth = true_minimal(ids, truth_of)
    rng = np.random.default_rng(seed)
    design = designs.Ddmin(spec, bench_on=False)
    blocks = [
        design.report_block(ddmin_study(spec, truth_of, sessions, rng, kill_rate)) for _ in range(studies)
    ]
    found: dict[str, int] = {}
    for b in blocks:
        key = ",".join(b.minimal) if b.minimal is not None else f"none ({b.outcome})"
        found[key] = found.get(key, 0) + 1
    exact = sum(1 for b in blocks if truth is not None and b.minimal is not None and set(b.minimal) == truth)
    bad = truth_of(frozenset(ids))
    return {
        "study": spec.name,
        "studies": studies,
        "seed": seed,
        "design": {
            "design": "ddmin",
            "differences": len(ids),
            "sessions_per_run": sessions,
            "min_runs_per_arm": spec.stopping.min_runs_per_arm,
            "max_runs_per_arm": spec.stopping.max_runs_per_arm,
            "ceiling": spec.ceiling,
            "alpha": spec.alpha,
            "kill_rate": kill_rate,
            "bad_rate": bad.rate,
            "restart_icc": bad.icc,
        },
        "true_minimal": None if truth is None else sorted(truth),
        "exact": exact / studies,
        "found": dict(sorted(found.items(), key=lambda kv: -kv[1])[:5]),
        "sessions_per_study": sum(b.sessions for b in blocks) / studies,
        "runs_per_study": sum(b.runs_started for b in blocks) / studies,
        "trials_per_study": sum(len(b.trials) for b in blocks) / studies,
        "by_role": trials_by_role(blocks),
        "covered": sum(1 for b in blocks if b.error_bound_covers == "covers the answer") / studies,
        "mean_error_bound": sum(b.error_bound for b in blocks) / studies,
        "one_at_a_time_sessions": ddmin.one_at_a_time_sessions(len(ids), sessions),
        "one_at_a_time": one_at_a_time_rehearsal(spec, truth_of, truth, sessions, studies, seed, kill_rate),
    }


def trials_by_role(blocks: Sequence[DdminSearch]) -> dict[str, dict[str, float]]:
    """Per role of a ddmin trial (steer, good, bad, candidate, without, deploy): how many trials a study
    has and the starts each pooled, on average."""
    count: dict[str, int] = {}
    starts: dict[str, int] = {}
    for b in blocks:
        for t in b.trials:
            role = t.role.split()[0]  # "without <id>": one role
            count[role] = count.get(role, 0) + 1
            starts[role] = starts.get(role, 0) + len(t.runs)
    return {
        role: {"per_study": n / len(blocks), "starts_each": starts[role] / n} for role, n in count.items()
    }


def describe_by_role(by_role: Mapping[str, Mapping[str, float]]) -> str:
    """`trials_by_role` in a line: "good 1.0 x 3.99, steer 12.0 x 1.13, ..." (trials x starts each)."""
    return ", ".join(f"{role} {r['per_study']:.1f} x {r['starts_each']:.2f}" for role, r in by_role.items())


def one_at_a_time_rehearsal(
    spec: StudySpec,
    truth_of: Callable[[frozenset[str]], ArmTruth],
    truth: frozenset[str] | None,
    sessions: int,
    studies: int,
    seed: int,
    kill_rate: float,
) -> dict[str, Any]:
    """The same question asked one difference at a time (`one_at_a_time`), sequential design, on the
    same truths: how often its implicated set is exactly the true minimal set, and its sessions."""
    ofat, arms = one_at_a_time(spec, truth_of)
    design = sequential_design(ofat, arms, sessions)
    rng = np.random.default_rng(seed)
    exact, spent = 0, 0
    for _ in range(studies):
        block = design.report_block(rehearsed_study(design, by_label(arms), sessions, rng, kill_rate))
        implicated = {h for h, d in block.decisions.items() if d.verdict in ("implicated", "partial")}
        exact += truth is not None and implicated == truth
        spent += block.sessions
    return {"exact": exact / studies, "sessions_per_study": spent / studies, "arms": len(arms)}


def one_at_a_time(
    spec: StudySpec, truth_of: Callable[[frozenset[str]], ArmTruth]
) -> tuple[StudySpec, list[ArmTruth]]:
    """The one-at-a-time study over the same differences, for comparison: from the bad configuration,
    one arm per difference removed (hypothesis: the corruption needs it), judged by the sequential
    design at the study's alpha, ceiling and budget."""
    ids = [d.id for d in spec.ddmin.differences]
    everything = frozenset(ids)
    bad = {d: ddmin.BAD for d in ids}
    ofat = StudySpec.from_dict(
        {
            **{k: v for k, v in spec.to_dict().items() if k not in ("ddmin", "baseline", "hypotheses")},
            "name": f"{spec.name} (one at a time)",
            "baseline": bad,
            "hypotheses": [
                {
                    "id": d,
                    "factor": d,
                    "statement": f"needs {d}",
                    "baseline": ddmin.BAD,
                    "treatment": ddmin.GOOD,
                }
                for d in ids
            ],
        }
    )
    arms = []
    for removed in [None, *ids]:
        subset = everything - {removed} if removed else everything
        t = truth_of(subset)
        levels = {**bad, **({removed: ddmin.GOOD} if removed else {})}
        arms.append(ArmTruth(analysis.arm_label(levels, bad), levels, t.rate, t.icc, t.rule))
    return ofat, arms


def render_ddmin(result: Mapping[str, Any]) -> str:
    d = result["design"]
    lines = [
        f"{result['study']}: {result['studies']} rehearsed ddmin studies over {d['differences']} "
        f"differences, "
        f"{d['sessions_per_run']} sessions per run, bad configuration at {d['bad_rate']:.1%} "
        f"(ICC {d['restart_icc']:g}), ceiling {d['ceiling']:.0%}, alpha {d['alpha']}, "
        f"{d['min_runs_per_arm']}-{d['max_runs_per_arm']} runs per subset, kill rate {d['kill_rate']:g}",
        f"true minimal set: {result['true_minimal']}",
        f"found exactly the true minimal set: {result['exact']:.1%}",
        "found: " + "; ".join(f"{k} {v / result['studies']:.1%}" for k, v in result["found"].items()),
        f"sessions per study: {result['sessions_per_study']:.0f} (runs {result['runs_per_study']:.1f}, "
        f"subsets tried {result['trials_per_study']:.1f}); a one-at-a-time sweep over every difference "
        f"({d['differences'] + 1} arms x {ddmin.ONE_AT_A_TIME_STARTS} starts): "
        f"{result['one_at_a_time_sessions']} sessions, ratio "
        f"{result['sessions_per_study'] / result['one_at_a_time_sessions']:.2f}",
        f"trials per study x the starts each pooled: {describe_by_role(result['by_role'])}",
        f"error bound covers the answer in {result['covered']:.1%} of studies "
        f"(mean bound {result['mean_error_bound']:.3f})",
        f"one at a time (sequential design, {result['one_at_a_time']['arms']} arms, the same truths): "
        f"exact {result['one_at_a_time']['exact']:.1%}, sessions per study "
        f"{result['one_at_a_time']['sessions_per_study']:.0f}; ddmin / one at a time: "
        f"{result['sessions_per_study'] / result['one_at_a_time']['sessions_per_study']:.2f}",
    ]
    return "\n".join(lines)


# --- arm truths from a fault model (reads the composed config) ------------------------------------


def job_truths(model, icc_override: float | None = None) -> Callable[[designs.Job], ArmTruth]:
    """truth_of(job) for a study composed from the config: the job composed and planned with its exact
    overrides, as the sweeper's launcher runs it (`plan.plan_arm`); its two roles' effective configs pick
    the fault model's rule, at the job's own workload (rounds, concurrency). Memoised per arm (the
    repetition and the throughput sweep change no rate). Call it inside Hydra's `initialize_config_dir`."""
    from hydra import compose

    from orchestrator.config.load import load_job
    from orchestrator.config.plan import plan_arm

    memo: dict[tuple[str, ...], ArmTruth] = {}

    def truth_of(job: designs.Job) -> ArmTruth:
        # a sized run is composed at its own size: its load is pinned (`workload.concurrency`), so its
        # rate is its arm's
        key = tuple(a for a in job.overrides if designs.key_of(a) not in RUN_ONLY_KEYS)
        if key not in memo:
            cfg = compose("config", overrides=list(key), return_hydra_config=True)
            plan = plan_arm(load_job(cfg))
            sessions, rounds = int(cfg.workload.sessions), int(cfg.workload.rounds)
            load = min(sessions, int(cfg.workload.concurrency or sessions))
            prefill, decode = _role_configs({r: (plan.roles[r].env, plan.roles[r].flags) for r in ROLE_PAIR})
            rule = model.rule_for(prefill, decode)
            kinds = turn_kinds(cfg.workload.prompts, int(cfg.workload.seed), sessions)
            oracle = str(cfg.workload.oracle)
            variance = model.batch_variance if kinds is not None else None  # free text alone flips
            p_fault = rule.probability(load) if rule else 0.0
            p_benign = variance.probability(load) if variance else 0.0
            rate = oracle_rate(oracle, rounds, kinds, p_fault, p_benign)
            # the between-start variation: the rule's, else (benign variance alone) the variance's
            source_icc = (
                rule.restart_icc if rule else (variance.restart_icc if variance and p_benign else 0.0)
            )
            icc = (source_icc if icc_override is None else icc_override) if rate > 0 else 0.0
            memo[key] = ArmTruth(
                job.label, dict(plan.factors), rate, icc, rule.name if rule else None, plan.signature
            )
        return memo[key]

    return truth_of


def turn_kinds(prompts: str | None, seed: int, sessions: int) -> list[tuple[str, ...]] | None:
    """Per session, the kinds of its turns as the embedded default answers them: `call` (a planned tool
    call: its recorded answer made one), `text` (free text), `answer` (the last turn of a conversation
    with an expected answer, free text judged by it too); None: the built-in tasks (every turn a call)."""
    if prompts is None:
        return None
    from orchestrator.workload.prompts import load_prompts, replay_turns, session_conversation

    conversations = load_prompts(prompts)
    kinds = []
    for index in range(sessions):
        conversation = session_conversation(conversations, seed, index)
        kinds.append(
            tuple(
                "call"
                if turn.expected_call is not None
                else ("answer" if turn.last and conversation.expected is not None else "text")
                for turn in replay_turns(conversation)
            )
        )
    return kinds


def oracle_rate(
    oracle: str, rounds: int, kinds: Sequence[tuple[str, ...]] | None, p_fault: float, p_benign: float
) -> float:
    """The session rate an oracle sees (pure): a turn is changed by the fault with `p_fault` and, free
    text only, by benign batch variance with `p_benign`; the tool-call oracle sees a changed call, and a
    changed free text only where an expected answer judges it; the divergence oracle sees every change.
    `kinds` None: the built-in tasks, `rounds` planned calls."""
    if kinds is None:
        return 1.0 - (1.0 - p_fault) ** rounds
    rates = []
    for turns in kinds:
        clean = 1.0
        for kind in turns:
            if kind == "call":
                clean *= 1.0 - p_fault
            elif oracle == "divergence" or kind == "answer":
                clean *= (1.0 - p_fault) * (1.0 - p_benign)
        rates.append(1.0 - clean)
    return sum(rates) / len(rates) if rates else 0.0


# overrides that change a run, not its arm's truth
RUN_ONLY_KEYS = ("repetition", "bench.enabled", "bench.repetitions")


ROLE_PAIR = ("prefill", "decode")


def _role_configs(roles: Mapping[str, tuple[Mapping[str, str], Mapping[str, Any]]]):
    """The sim's view of a role: its env as parsed, its flags resolved by the sim's own argparse."""
    from orchestrator.config.plan import flag_words
    from orchestrator.sim.args import parse_args
    from orchestrator.sim.envs import effective_env
    from orchestrator.sim.faults import RoleConfig

    configs = []
    for role in ("prefill", "decode"):
        env, flags = roles[role]
        args = parse_args(["--model-path", "m", "--disaggregation-mode", role, *flag_words(flags)])
        configs.append(RoleConfig(role, effective_env(dict(env))[0], vars(args)))
    return configs


def sweep_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, int]]:
    """(the overrides compose accepts, {key: number of values} of the sweep overrides such as
    `repetition=0,1,2,3`, which only a multirun could take)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    plain, sweeps = [], {}
    for text, parsed in zip(
        overrides, OverridesParser.create().parse_overrides(list(overrides)), strict=True
    ):
        if parsed.is_sweep_override():
            sweeps[parsed.get_key_element()] = len(list(parsed.sweep_string_iterator()))
        else:
            plain.append(text)
    return plain, sweeps


def split_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(rehearse options incl. fault_model, the remaining Hydra overrides)."""
    options: dict[str, str] = {}
    overrides = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key == "fault_model":
            options["fault_model"] = value
        elif sep and key.startswith("rehearse."):
            name = key.removeprefix("rehearse.")
            if name not in OPTIONS:
                raise SystemExit(
                    f"unknown option {key}; accepted: {', '.join('rehearse.' + o for o in OPTIONS)}"
                )
            options[name] = value
        else:
            overrides.append(arg)
    return options, overrides


def from_config(argv: Sequence[str]) -> dict[str, Any]:
    """Compose the study as `python -m orchestrator` would, build its design as the sweeper does
    (`designs.choose`, `designs.build`), and rehearse that design: each job's truth from its own
    composed config (`job_truths`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from orchestrator.config.load import CONF_DIR, with_good_baseline
    from orchestrator.sim.faults import load_fault_model
    from orchestrator.study.sweep import choices_of

    options, given = split_args(argv)
    overrides, sweeps = sweep_overrides(given)
    model = load_fault_model(options.get("fault_model") or None)
    icc = float(options["restart_icc"]) if "restart_icc" in options else None
    studies = int(options.get("studies", DEFAULT_STUDIES))
    seed = int(options.get("seed", DEFAULT_SEED))
    kill_rate = float(options.get("kill_rate", 0.0))
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
        spec = with_good_baseline(StudySpec.from_dict(OmegaConf.to_container(cfg.study, resolve=True)), cfg)
        sessions, rounds = int(cfg.workload.sessions), int(cfg.workload.rounds)
        load = min(sessions, int(cfg.workload.concurrency or sessions))
        name, params = designs.choose(
            OmegaConf.to_container(cfg.hydra.sweeper, resolve=True), bool(sweeps), False
        )
        choices = choices_of(
            OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + list(given))
        )
        deployment_cost = OmegaConf.to_container(cfg.deployment.get("cost") or {}, resolve=True)
        design = designs.build(
            name, spec, choices, sessions=sessions, bench_on=False, load=load, deployment_cost=deployment_cost
        )
        costs = cost.cost_model(spec.cost, deployment_cost)
        truth_of = job_truths(model, icc)
        if isinstance(design, designs.Ddmin):  # the subsets are composed as the search asks for them
            result = rehearse_ddmin(
                spec,
                lambda subset: truth_of(design.job(subset, 0, False)),
                sessions,
                studies,
                seed,
                kill_rate,
            )
        else:
            arms = list({t.label: t for t in map(truth_of, design.jobs())}.values())
            if isinstance(design, designs.Sequential):
                result = rehearse_sequential(
                    spec, arms, sessions, studies, seed, kill_rate, design, truth_of, costs
                )
            else:
                runs = len({j.repetition for j in design.jobs()})
                result = rehearse(spec, arms, runs, sessions, studies, seed, design, truth_of, costs)
    result["fault_model"] = {"name": model.name, "source": model.source}
    result["workload"] = {"sessions": sessions, "rounds": rounds, "load": load}
    if "json" in options:
        Path(options["json"]).write_text(json.dumps(result, indent=2) + "\n")
    return result


def render(result: Mapping[str, Any]) -> str:
    """A short table for the terminal."""
    design = result["design"]
    runs = (
        f"up to {design['max_runs_per_arm']} runs (sequential)"
        if design.get("design") == "sequential"
        else f"{design['runs_per_arm']} runs"
    )
    lines = [
        f"{result['study']}: {result['studies']} rehearsed studies, {len(design['arms'])} arms x "
        f"{runs} x {design['sessions_per_run']} sessions, fault model "
        f"{result.get('fault_model', {}).get('name', '?')}",
        "arms: "
        + ", ".join(f"{a['label']} {a['rate']:.1%} (ICC {a['restart_icc']:g})" for a in design["arms"]),
        "",
        f"{'hypothesis':<16} {'causal':<6} {'expected':<12} "
        + " ".join(f"{v:>12}" for v in VERDICTS)
        + f" {'wrong':>7}",
    ]
    for h in result["hypotheses"]:
        lines.append(
            f"{h['id']:<16} {'yes' if h['causal'] else 'no':<6} {h['expected']:<12} "
            + " ".join(f"{h['verdicts'][v]:>12.1%}" for v in VERDICTS)
            + f" {h['wrong']:>7.1%}"
        )
    lines += [
        "",
        f"family-wise false implication: {result['family_false_implication']:.1%}",
        f"all verdicts right (none wrong): {result['all_right']:.1%}; "
        f"all as expected: {result['all_expected']:.1%}",
        f"sessions per study: {result['sessions_per_study']:.0f}; "
        f"mean estimated ICC: {result['mean_icc_estimate']:.4f}",
    ]
    if "gpu_hours_per_study" in result:
        model = result["cost"]
        fixed = result.get("fixed_design_gpu_hours")
        lines.append(
            f"GPU hours per study: {result['gpu_hours_per_study']:.2f} "
            f"({result['starts_per_study']:.1f} starts; "
            f"restart {model['restart_s']:g} s, session {model['session_s']:g} s, {model['gpus']} GPUs)"
            + (
                f"; the fixed design: {fixed:.2f}, ratio {result['gpu_hours_per_study'] / fixed:.2f}"
                if fixed
                else ""
            )
        )
    if "rounds_per_study" in result:
        lines.append(
            f"rounds per study: {result['rounds_per_study']:.2f}; the fixed design of as many runs per arm: "
            f"{result['fixed_design_sessions']} sessions; per arm: "
            + ", ".join(f"{k} {v:.0f}" for k, v in result["sessions_per_arm"].items())
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    result = from_config(sys.argv[1:] if argv is None else argv)
    print(render_ddmin(result) if result["design"].get("design") == "ddmin" else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
