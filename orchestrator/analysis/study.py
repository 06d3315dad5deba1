"""Study analysis (pure): tracked runs -> arms -> verdicts per hypothesis -> the report's facts; `analyse`
asks each question in turn and assembles the answers into the typed `result.StudyResult`.

Input: the study (`StudySpec`) and one `RunRecord` per MLflow child run (built by
`tracking.load_study`). Output: the content of report.json as a typed `result.StudyResult` (`result.to_json`
gives the JSON), which `report` renders. Nothing here reads files or MLflow, and the same input always gives
the same output (bootstrap seeds derive from signatures and levels), so report.json can be rebuilt from
MLflow alone.

Arms. An arm's identity is everything that changes what a session measures: its signature (the hash of
the effective env and flags per role) and its `conditions` (the deployment and the workload settings:
sessions, rounds, concurrency, ...; `RunRecord.conditions`). Runs of another workload are another arm,
never pooled into this one; a hypothesis compares the baseline arm with the treatment arm of the same
conditions (the baseline is the one of `analyse(conditions=...)` when given, else the one with most
sessions).

Pooling. The replicate unit is the run (one server start): each arm keeps its per-run counts. An arm
pools the FINISHED runs whose stress outcomes are complete. A KILLED, FAILED, orphaned RUNNING run, or
one with partial outcomes, is listed with its counts but never pooled: its outcomes are biased (a
corrupted session ends at its first bad turn, a clean one needs every round, so an interrupted run
holds mostly corrupted sessions). When the same (arm, repetition) has a FINISHED run too (a resume)
the interrupted one is superseded; otherwise the arm is marked partial (a planned run is missing).
Errored sessions are never corruption and are not trials: n = clean + corrupted.
Throughput uses FINISHED runs only.

Between runs (see `stats` for the method and why): one intra-class correlation rho for the study,
estimated from the per-run counts of every arm (`stats.dispersion`), never below the study's
`assumed_icc` (default 0; what the deployment is known to vary by at least), and that value alone when
the runs cannot show it (one run per arm); the report says which. Each arm's design effect
D = 1 + (mean run size - 1) rho turns its counts into effective counts (k / D, n / D), on which every
test, bound and interval below is computed. Arms report per-run counts, D and the effective n.

Verdicts (hypothesis: baseline arm vs the arm that differs only in the hypothesis' factor):
- implicated: significant after Holm, corruption lower, and the treatment's upper bound < ceiling;
- partial: significant reduction, but the treatment's upper bound is not under the ceiling
  (corruption remains, or too few sessions to rule it out: the note says which);
- exonerated: not significant, and the Newcombe interval of the difference lies within
  (-margin, +margin), margin = min_effect x the baseline's rate (`min_effect_relative`, the default:
  the bug's own size sets what "no effect" means) or min_effect itself. A treatment with no corruption
  against a corrupted baseline is never exonerated, nor is anything against a baseline without any;
- inconclusive: anything else (missing arm, too few sessions, or a significant *increase*), with the
  sessions per arm that would find a difference of the margin with 80% power (`stats.sessions_needed`
  at alpha / number of hypotheses, the strictest step of Holm, times the design effect).

Clusters (`clusters`, from `clusters.clusters_report`, when runs carry a `cluster` tag): which clusters
each arm's used runs ran on, the leases of a cluster pool, runs lost with their lease, and per arm that
ran on two or more clusters whether its rate differs between them beyond restart variation (the verdicts
pool clusters: reported, never folded into a verdict).

Machines (`machines`, from `machines.machines_block`, when some run recorded a GPU, driver, torch, CUDA or
engine version): per server role, each machine and engine the runs ran on, with its runs; more than one
per role is said (`differs`), never folded into a verdict.

Minimal cause (`minimal_cause`, from `cause.minimal_cause` over every arm of the baseline's conditions,
not only the hypotheses' pairs): each arm corrupting, clean or undetermined against the same ceiling,
the smallest conjunctions of factor levels consistent with them, and what the design cannot tell.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar, get_args

from orchestrator.analysis import cause, clusters, cost, ddmin, stats
from orchestrator.analysis.divergence import arm_divergence
from orchestrator.analysis.machines import machines_block
from orchestrator.analysis.result import (
    ABSENT,
    Arm,
    ArmDecodeLoad,
    ArmFamilies,
    BetweenRuns,
    Clusters,
    Cost,
    DdminSearch,
    Deploy,
    Families,
    HypothesisRow,
    MoreSessions,
    ProblemRun,
    RatioLevel,
    RunLoad,
    RunRow,
    Stopping,
    StudyResult,
    ThroughputLevel,
    ThroughputRow,
    Verdict,
    from_json,
)
from orchestrator.analysis.runs import LevelSample, RunRecord, identity, oracle_of, run_used, symptom_of
from orchestrator.analysis.states import (
    ArmState,
    StatePolicy,
    arm_states,
    ddmin_states,
    sequential_states,
)
from orchestrator.config.plan import BASELINE_LABEL, arm_label

# the study as Hydra composes it and study.json stores it: one definition, in schema.py
from orchestrator.config.schema import Hypothesis as HypothesisSpec
from orchestrator.config.schema import StudyConf
from orchestrator.config.schema import StudyConf as StudySpec
from orchestrator.workload import decode_load
from orchestrator.workload.detect import DEFAULT_COUNTED, FAMILIES, ORACLES

# report.json's layout version (orchestrator/report/report.schema.json); 2: one state per arm (arm_states,
# policy), read by every section
SCHEMA_VERSION = 2

# a hypothesis' verdicts (the minimal cause's are `cause.CAUSE_SENTENCES`)
VERDICTS = get_args(Verdict)
POWER = 0.8
N_BOOT = 2000


# --- small helpers ---------------------------------------------------------------------------------


def clean_float(x: float | None) -> float | None:
    """JSON has no NaN: missing numbers are null."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return float(x)


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:4], "big")


# --- arms ------------------------------------------------------------------------------------------


def pool_arms(
    runs: Sequence[RunRecord], spec: StudySpec, between: stats.Dispersion | None = None
) -> list[Arm]:
    """One entry per arm identity: per-run counts, counts pooled over the runs that count, the design
    effect and effective counts, intervals, run list. `between` gives the study's ICC (default: the one
    these runs estimate, `between_runs`). Each arm's `state` is None here: `analyse` sets the study's."""
    by_id: dict[str, list[RunRecord]] = {}
    for run in runs:
        by_id.setdefault(identity(run), []).append(run)
    if between is None:
        between = between_runs(runs, spec)
    arms = [pooled_arm(arm_id, group, spec, between.icc) for arm_id, group in by_id.items()]
    arms.sort(key=lambda a: (a.label != BASELINE_LABEL, a.label, a.signature))
    return arms


def pooled_arm(arm_id: str, runs: Sequence[RunRecord], spec: StudySpec, icc: float) -> Arm:
    """One arm from its runs (`pool_arms`)."""
    group = sorted(runs, key=lambda r: (r.repetition, r.status != "FINISHED", r.run_id))
    factors = dict(sorted(group[0].factors.items()))
    conditions = dict(sorted(group[0].conditions.items()))
    used = [r for r in group if run_used(r)]
    run_counts = tuple((r.corrupted, r.corrupted + r.clean) for r in used)
    k = sum(c[0] for c in run_counts)
    n = sum(c[1] for c in run_counts)
    deff = stats.design_effect(icc, stats.pooled_run_size([c[1] for c in run_counts]))
    k_eff, n_eff = stats.effective_counts(k, n, deff)
    lo, hi = stats.runs_interval(run_counts, icc)
    used_reps = {r.repetition for r in used}
    used_ids = {id(r) for r in used}  # (not `r in used`: a dataclass __eq__ per pair, quadratic)
    missing = [r for r in group if not run_used(r) and r.repetition not in used_reps]
    finished = [r for r in group if r.status == "FINISHED"]
    config_run = finished[0] if finished else group[0]
    divergence = arm_divergence(conditions, group)
    return Arm(
        label=arm_label(factors, spec.baseline),
        signature=arm_id,
        deployment_signature=group[0].signature,
        conditions=conditions,
        factors=factors,
        n=n,
        corrupted=k,
        clean=n - k,
        errored=sum(r.errored for r in used),
        rate=(k / n) if n else None,
        run_counts=run_counts,
        mean_run_size=n / len(used) if used else 0.0,
        design_effect=deff,
        effective_n=n_eff,
        effective_corrupted=k_eff,
        ci=(lo, hi) if n else None,
        upper_bound=clean_float(hi) if n else None,
        partial=bool(missing),
        client_bound=any(r.client_bound for r in finished),
        missing_usage=sum(r.missing_usage for r in finished),
        families=_sum_maps(r.families for r in used),
        runs=tuple(run_row(r, id(r) in used_ids) for r in group),
        facts=_sum_maps(r.facts for r in used),
        config=config_run.config,
        throughput=_arm_throughput(finished),
        decode_load=arm_decode_load(used),
        state=None,
        # an arm judged by the differential oracle: where its sessions diverged, its reference pass
        divergence=ABSENT if divergence is None else divergence,
    )


def run_row(run: RunRecord, used: bool) -> RunRow:
    """One run of an arm as the report lists it; its times only where it recorded them."""
    reference_s = run.reference.get("duration_s")
    return RunRow(
        run_id=run.run_id,
        repetition=run.repetition,
        status=run.status,
        outcomes=run.outcomes,
        corrupted=run.corrupted,
        clean=run.clean,
        errored=run.errored,
        planned=run.planned,
        used=used,
        reason=run.reason,
        wall_s=ABSENT if run.wall_s is None else run.wall_s,
        stress_s=ABSENT if run.stress_s is None else run.stress_s,
        reference_s=ABSENT if reference_s is None else float(reference_s),
    )


Number = TypeVar("Number", int, float)


# an internal accumulator of counts (families) or sums (facts), not a result shape
def _sum_maps(maps: Iterable[Mapping[str, Number]]) -> dict[str, Number]:
    """Key-wise sums (keys no map has are left out), sorted by key."""
    total: dict[str, Number] = {}
    for values in maps:
        for key, value in values.items():
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def arm_decode_load(runs: Sequence[RunRecord]) -> ArmDecodeLoad | None:
    """The decode's load over an arm's pooled runs, against the planned concurrency (pure); None when no
    run recorded it (runs logged before it was). `mean`, `p50`: means over the measured runs of each
    run's; `max`: the largest; `short`: the mean is under `decode_load.SHORT_FRACTION` of the planned
    concurrency; `unknown`: why the runs without a load have none."""
    recorded = [r for r in runs if r.decode_load]
    if not recorded:
        return None
    measured = [r for r in recorded if r.decode_load.get("measured")]
    planned = max((r.decode_load["planned"] for r in recorded if r.decode_load.get("planned")), default=None)
    mean = _mean([r.decode_load["mean"] for r in measured])
    fraction = mean / planned if mean is not None and planned else None
    return ArmDecodeLoad(
        planned=planned,
        runs=len(recorded),
        runs_measured=len(measured),
        mean=clean_float(mean),
        p50=clean_float(_mean([r.decode_load["p50"] for r in measured])),
        max=clean_float(max((r.decode_load["max"] for r in measured), default=None)),
        fraction=clean_float(fraction),
        short=fraction is not None and fraction < decode_load.SHORT_FRACTION,
        unknown=tuple(sorted({_load_unknown(r) for r in recorded if _load_unknown(r)})),
        per_run=tuple(
            RunLoad(
                repetition=r.repetition,
                mean=clean_float(r.decode_load.get("mean")),
                p50=clean_float(r.decode_load.get("p50")),
                max=clean_float(r.decode_load.get("max")),
                unknown=_load_unknown(r),
            )
            for r in recorded
        ),
    )


def _load_unknown(run: RunRecord) -> str:
    """Why a run has no decode load ("" when it has one)."""
    if run.decode_load.get("measured"):
        return ""
    return run.decode_load.get("unknown") or "not measured"


def _mean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _arm_throughput(finished: Sequence[RunRecord]) -> tuple[ThroughputLevel, ...]:
    """Per concurrency level: means over FINISHED runs of tok/s, TTFT and ITL p50/p99, and errors."""
    levels: dict[int, list[LevelSample]] = {}
    for run in finished:
        for lv in run.bench:
            levels.setdefault(lv.concurrency, []).append(lv)
    return tuple(
        ThroughputLevel(
            concurrency=c,
            runs=len(samples),
            tok_s=clean_float(_mean([s.tok_s for s in samples])),
            ttft_p50_s=clean_float(_mean([s.ttft_p50_s for s in samples])),
            ttft_p99_s=clean_float(_mean([s.ttft_p99_s for s in samples])),
            itl_p50_s=clean_float(_mean([s.itl_p50_s for s in samples])),
            itl_p99_s=clean_float(_mean([s.itl_p99_s for s in samples])),
            errors=sum(s.errors for s in samples),
        )
        for c, samples in sorted(levels.items())
    )


def between_runs(runs: Sequence[RunRecord], spec: StudySpec) -> stats.Dispersion:
    """The study's between-run variation from the pooled runs' per-run counts (every arm), with the
    study's `assumed_icc` as a floor, and alone when no arm has two runs with corruption (module doc)."""
    by_id: dict[str, list[tuple[int, int]]] = {}
    for r in runs:
        if run_used(r):
            by_id.setdefault(identity(r), []).append((r.corrupted, r.corrupted + r.clean))
    return stats.study_icc(list(by_id.values()), float(getattr(spec, "assumed_icc", 0.0)))


def clusters_block(
    spec: StudySpec, runs: Sequence[RunRecord], between: stats.Dispersion | None = None
) -> Clusters | None:
    """report.json's `clusters` (`clusters.clusters_report`): where the arms ran, their leases, and whether an
    arm's rate differs between clusters beyond restart variation; None when no run carries a cluster tag.
    `between`: the study's ICC, the check's fallback (default: `between_runs`)."""
    if not any(r.placement.get("cluster") for r in runs):
        return None
    if between is None:
        between = between_runs(runs, spec)
    return clusters.clusters_report(spec, runs, run_used, identity, between)


def between_summary(between: stats.Dispersion) -> BetweenRuns:
    """report.json's account of the between-run variation and what was assumed."""
    estimate = max(0.0, (between.phi - 1) / (between.mean_run_size - 1)) if between.mean_run_size > 1 else 0.0
    if between.estimated and between.icc > estimate:
        note = (
            f"estimated from the runs: dispersion {between.phi:.2f} on {between.df} degrees of freedom, "
            f"ICC {estimate:.3f}, below the study's floor: assumed ICC {between.icc:g} (study.assumed_icc)"
        )
    elif between.estimated:
        note = (
            f"estimated from the runs: dispersion {between.phi:.2f} on {between.df} degrees of freedom, "
            f"ICC {between.icc:.3f}"
            + (
                ""
                if between.phi > 1
                else " (no more spread between runs than chance: sessions as independent)"
            )
        )
    else:
        note = (
            "between-run variation cannot be estimated (no arm has two runs with corruption); "
            f"assumed ICC {between.icc:g} (study.assumed_icc)"
            + (": sessions treated as independent" if between.icc == 0 else "")
        )
    return BetweenRuns(
        method="beta-binomial, one ICC per study; Rao-Scott effective counts into the exact tests",
        estimated=between.estimated,
        dispersion=clean_float(between.phi),
        df=between.df,
        icc=between.icc,
        mean_run_size=clean_float(between.mean_run_size),
        note=note,
    )


def find_arm(
    arms: Sequence[Arm],
    levels: Mapping[str, str],
    like: Mapping[str, str] | None = None,
    conditions: Mapping[str, str] | None = None,
) -> Arm | None:
    """The arm whose factors match `levels` (on levels' keys) and, for factors outside `levels`, equal
    `like`'s, run under `conditions` when given (the same deployment and workload); among several,
    the one with most sessions."""
    found = [
        a
        for a in arms
        if all(a.factors.get(k) == v for k, v in levels.items())
        and all(a.factors.get(k) == v for k, v in (like or {}).items() if k not in levels)
        and (conditions is None or a.conditions == dict(conditions))
    ]
    found.sort(key=lambda a: (-a.n, a.signature))
    return found[0] if found else None


# --- hypotheses ------------------------------------------------------------------------------------


def margin(spec: StudySpec, p_base: float) -> float:
    """The smallest difference worth acting on: min_effect x the baseline rate (relative, the default)
    or min_effect itself."""
    return spec.min_effect * p_base if getattr(spec, "min_effect_relative", True) else spec.min_effect


@dataclasses.dataclass(frozen=True)
class Judgement:
    """One comparison's verdict (`judge`): the fields of its `HypothesisRow` that say what it concluded."""

    verdict: str = "inconclusive"
    note: str = ""
    sessions_needed_per_arm: int | None = None
    more_sessions: MoreSessions | None = None


def judge(
    k_base: int,
    n_base: int,
    k_treat: int,
    n_treat: int,
    p_holm: float,
    spec: StudySpec,
    family_size: int,
    deff: tuple[float, float] = (1.0, 1.0),
    treat_state: ArmState | None = None,
) -> Judgement:
    """The verdict of one comparison, given its Holm-adjusted p (see the module doc). Counts are the
    arms' pooled sessions; `deff` their design effects (baseline, treatment), the interval of the
    difference is computed on the effective counts; `treat_state` is the treatment arm's one state
    (`analysis.states`): "corruption gone" is that state being clean (default: Clopper-Pearson of the
    effective counts under the ceiling)."""
    if n_base == 0 or n_treat == 0:
        return Judgement(
            note="no sessions with an outcome in the " + ("baseline" if n_base == 0 else "treatment") + " arm"
        )
    kb_e, nb_e = stats.effective_counts(k_base, n_base, deff[0])
    kt_e, nt_e = stats.effective_counts(k_treat, n_treat, deff[1])
    eff = "" if deff == (1.0, 1.0) else f" ({kt_e}/{nt_e} effective)"
    p_b, p_t = k_base / n_base, k_treat / n_treat
    lo, hi = stats.newcombe_diff(kt_e, nt_e, kb_e, nb_e)
    significant = p_holm < spec.alpha
    if significant and p_t < p_b:
        if treat_state is not None and treat_state.bounds:
            upper, gone = treat_state.bounds[1], treat_state.state == "clean"
        else:
            upper = stats.upper_bound(kt_e, nt_e)
            gone = upper < spec.ceiling
        if gone:
            return Judgement(
                "implicated",
                f"corruption gone: {k_treat}/{n_treat}{eff}, upper bound {upper:.2%} "
                f"< ceiling {spec.ceiling:.0%}",
            )
        if k_treat:
            note = f"significant reduction, but corruption remains: {k_treat}/{n_treat}"
            if treat_state is not None:
                note += f" (arm {treat_state.state}: upper bound {upper:.2%}, ceiling {spec.ceiling:.0%})"
            return Judgement("partial", note)
        need = math.ceil(stats.sessions_for_ceiling(spec.ceiling) * deff[1] - 1e-9)
        return Judgement(
            "partial",
            f"significant reduction, none seen{eff}, but the upper bound {upper:.2%} is not under "
            f"the ceiling {spec.ceiling:.0%}: {need} treatment sessions would settle it",
            need,
            MoreSessions(baseline=0, treatment=max(0, need - n_treat)),
        )
    if significant:
        return Judgement(note=f"corruption rose with the change ({k_base}/{n_base} -> {k_treat}/{n_treat})")
    if k_base == 0:
        return Judgement(
            note=f"the baseline arm shows no corruption (0/{n_base}): there is nothing to explain"
        )
    m = margin(spec, p_b)
    if k_treat == 0:
        why = f"no corruption with the change (0/{n_treat}) but not significant: never exonerated"
    elif -m < lo and hi < m:
        return Judgement("exonerated", f"difference within ±{m:.1%} ({lo:+.2%} to {hi:+.2%})")
    else:
        why = f"not decided: difference {lo:+.2%} to {hi:+.2%} includes ±{m:.1%}"
    need = stats.sessions_needed(p_b, m, spec.alpha / max(1, family_size), POWER, max(deff))
    return Judgement(
        note=f"{why}; {need} sessions per arm would find a difference of {m:.1%} "
        f"at the baseline rate {p_b:.1%}",
        sessions_needed_per_arm=need,
        more_sessions=MoreSessions(baseline=max(0, need - n_base), treatment=max(0, need - n_treat)),
    )


def hypotheses(
    arms: Sequence[Arm],
    spec: StudySpec,
    conditions: Mapping[str, str] | None = None,
    states: Mapping[str, ArmState] | None = None,
) -> list[HypothesisRow]:
    """One row per hypothesis: the two arms, their counts and effective counts, p, Holm, the verdict.
    `states`: the study's one state per arm (by signature), which "corruption gone" reads."""
    base_arm = find_arm(arms, spec.baseline, conditions=conditions)
    pairs = [(h, _treatment_arm(arms, spec, h, base_arm)) for h in spec.hypotheses]
    ps = [stats.compare(*_effective(base_arm), *_effective(treat), spec.test) for _, treat in pairs]
    return [
        hypothesis_row(h, base_arm, treat, p, p_holm, spec, len(pairs), (states or {}).get(_sig(treat)))
        for (h, treat), p, p_holm in zip(pairs, ps, stats.holm(ps), strict=True)
    ]


def _treatment_arm(
    arms: Sequence[Arm], spec: StudySpec, h: HypothesisSpec, base_arm: Arm | None
) -> Arm | None:
    """A hypothesis' treatment arm: its factor at the treatment level, every other as the baseline arm's."""
    if base_arm is None:
        return None
    levels = {**spec.baseline, h.factor: h.treatment}
    return find_arm(arms, levels, like=base_arm.factors, conditions=base_arm.conditions)


def _sig(arm: Arm | None) -> str:
    return arm.signature if arm else ""


def _counts(arm: Arm | None) -> tuple[int, int, float]:
    """(corrupted, sessions, design effect) of an arm; (0, 0, 1) for one not run."""
    return (arm.corrupted, arm.n, arm.design_effect) if arm else (0, 0, 1.0)


def _effective(arm: Arm | None) -> tuple[int, int]:
    k, n, deff = _counts(arm)
    return stats.effective_counts(k, n, deff)


def hypothesis_row(
    h: HypothesisSpec,
    base_arm: Arm | None,
    treat: Arm | None,
    p: float,
    p_holm: float,
    spec: StudySpec,
    family_size: int,
    state: ArmState | None,
) -> HypothesisRow:
    """One hypothesis' row: its arms' counts, p and Holm's p, and `judge`'s verdict."""
    kb, nb, db = _counts(base_arm)
    kt, nt, dt = _counts(treat)
    diff_ci = stats.newcombe_diff(*_effective(treat), *_effective(base_arm)) if nb and nt else None
    judged = judge(kb, nb, kt, nt, p_holm, spec, family_size, (db, dt), state)
    treatment_label = treat.label if treat else f"{h.factor}={h.treatment}"
    note = judged.note
    if treat is None:
        note = f"no arm with {treatment_label} and every other factor at baseline was run"
    return HypothesisRow(
        id=h.id,
        factor=h.factor,
        statement=h.statement,
        baseline_level=h.baseline,
        treatment_level=h.treatment,
        baseline_arm=base_arm.signature if base_arm else None,
        treatment_arm=treat.signature if treat else None,
        treatment_label=treatment_label,
        baseline_counts=(kb, nb),
        treatment_counts=(kt, nt),
        baseline_runs=base_arm.run_counts if base_arm else (),
        treatment_runs=treat.run_counts if treat else (),
        design_effect=(db, dt),
        effective_counts=(_effective(base_arm), _effective(treat)),
        margin=margin(spec, kb / nb) if nb else None,
        diff=(kt / nt - kb / nb) if nb and nt else None,
        diff_ci=tuple(diff_ci) if diff_ci else None,
        p=p,
        p_holm=p_holm,
        test=spec.test,
        verdict=judged.verdict,
        note=note,
        sessions_needed_per_arm=judged.sessions_needed_per_arm,
        more_sessions=judged.more_sessions,
        treatment_state=state.state if state else None,
    )


# --- throughput ------------------------------------------------------------------------------------


def _samples(runs: Sequence[RunRecord], concurrency: int) -> list[LevelSample]:
    return [lv for r in runs if r.status == "FINISHED" for lv in r.bench if lv.concurrency == concurrency]


def throughput(
    runs: Sequence[RunRecord],
    arms: Sequence[Arm],
    spec: StudySpec,
    conditions: Mapping[str, str] | None = None,
) -> list[ThroughputRow]:
    """Each non-baseline arm's tok/s ratio to the baseline arm per level, with a bootstrap interval and
    a throughput verdict: no regression only when every level's lower bound clears the floor and
    neither arm's client self-audit warned."""
    base = find_arm(arms, spec.baseline, conditions=conditions)
    if base is None:
        return []
    by_sig: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_sig.setdefault(identity(r), []).append(r)
    base_levels = {lv.concurrency for lv in base.throughput}
    rows = []
    for arm in arms:
        if arm.signature == base.signature or not arm.throughput:
            continue
        if arm.conditions != base.conditions:
            continue  # another deployment or workload: not comparable
        levels = [
            ratio_level(
                by_sig[arm.signature],
                by_sig[base.signature],
                c,
                _seed(arm.signature, base.signature, c),
                spec,
            )
            for c in sorted(base_levels & {lv.concurrency for lv in arm.throughput})
        ]
        client_bound = arm.client_bound or base.client_bound
        rows.append(
            ThroughputRow(
                arm=arm.signature,
                label=arm.label,
                client_bound=client_bound,
                verdict=throughput_verdict(
                    levels, client_bound, bool(arm.missing_usage or base.missing_usage), spec
                ),
                levels=tuple(levels),
            )
        )
    return rows


def ratio_level(
    treat_runs: Sequence[RunRecord], base_runs: Sequence[RunRecord], c: int, seed: int, spec: StudySpec
) -> RatioLevel:
    """One level's tok/s ratio (treatment / baseline) with its bootstrap interval: over the requests
    where every run recorded them, else over the runs."""
    t, b = _samples(treat_runs, c), _samples(base_runs, c)
    if all(s.request_tokens for s in t + b):
        ratio = stats.bootstrap_ratio_requests(
            [(s.request_tokens, s.request_latency_s) for s in t],
            [(s.request_tokens, s.request_latency_s) for s in b],
            N_BOOT,
            seed,
        )
    else:
        ratio = stats.bootstrap_ratio_runs([s.tok_s for s in t], [s.tok_s for s in b], N_BOOT, seed)
    return RatioLevel(
        concurrency=c,
        ratio=clean_float(ratio.point),
        ci=(clean_float(ratio.low), clean_float(ratio.high)),
        method=ratio.method,
        clears_floor=ratio.low >= spec.throughput_floor if math.isfinite(ratio.low) else False,
    )


def throughput_verdict(
    levels: Sequence[RatioLevel], client_bound: bool, missing_usage: bool, spec: StudySpec
) -> str:
    if client_bound:
        return "no verdict (client-bound)"
    if missing_usage:
        return "no verdict (the server sent no usage)"
    if not levels:
        return "no verdict (no common levels)"
    if all(lv.clears_floor for lv in levels):
        return "no regression"
    if any(lv.ci[1] is not None and lv.ci[1] < spec.throughput_floor for lv in levels):
        return "regression"
    return "inconclusive"


# --- the whole study -------------------------------------------------------------------------------


def _geomean(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else 0.0


def _deploy(arm: Arm, label: str, hypothesis: str | None, tput: Sequence[ThroughputRow]) -> Deploy:
    """The arm to deploy, with its throughput verdict against the baseline."""
    t = next((t for t in tput if t.arm == arm.signature), None)
    return Deploy(
        arm=arm.signature,
        label=label,
        hypothesis=hypothesis,
        factors=arm.factors,
        throughput_verdict=t.verdict if t else "no throughput data",
        config=arm.config,
    )


def choose_deploy(
    arms: Sequence[Arm], hyps: Sequence[HypothesisRow], tput: Sequence[ThroughputRow]
) -> Deploy | None:
    """The arm to deploy: an implicated hypothesis' treatment arm, preferring no throughput regression,
    then the highest geometric-mean tok/s ratio, then the lowest corruption upper bound."""
    by_sig = {a.signature: a for a in arms}
    tput_by = {t.arm: t for t in tput}
    candidates = [h for h in hyps if h.verdict == "implicated" and h.treatment_arm in by_sig]
    if not candidates:
        return None

    def rank(h: HypothesisRow) -> tuple:
        t = tput_by.get(h.treatment_arm or "")
        ratio = _geomean([lv.ratio for lv in t.levels]) if t else 0.0
        no_reg = bool(t and t.verdict == "no regression")
        return (not no_reg, -ratio, by_sig[h.treatment_arm or ""].upper_bound, h.id)

    best = sorted(candidates, key=rank)[0]
    arm = by_sig[best.treatment_arm or ""]
    return _deploy(arm, arm.label, best.id, tput)


def headline(
    spec: StudySpec,
    arms: Sequence[Arm],
    hyps: Sequence[HypothesisRow],
    deploy: Deploy | None,
    conditions: Mapping[str, str] | None = None,
) -> str:
    base = find_arm(arms, spec.baseline, conditions=conditions)
    if base is None or not base.n:
        return "No verdict: the baseline arm has no sessions with an outcome."
    oracle = symptom_of(base.conditions)
    base_txt = f"baseline {oracle_phrase(oracle, base.corrupted, base.n, format(base.rate, '.1%'))}"
    implicated = [h for h in hyps if h.verdict == "implicated"]
    if base.corrupted == 0:
        bound = f"upper bound {base.upper_bound:.1%}"
        return f"The baseline arm {oracle_phrase(oracle, 0, base.n, bound)}."
    if not implicated:
        return f"No hypothesis implicated ({base_txt}){verdict_groups(hyps)}."
    names = ", ".join(f"{h.id} ({h.treatment_label})" for h in implicated)
    text = f"Implicated: {names}; {base_txt}."
    if deploy:
        text += f" Fix: deploy `{deploy.label}` (throughput: {deploy.throughput_verdict})."
    return text


# an arm's corrupted sessions in its oracle's words (`oracle_phrase`): (some, none)
ORACLE_WORDS = {
    "tool_calls": ("corruption {k}/{n}", "showed no corruption"),
    "divergence": (
        "diverged from its batch-1 reference in {k}/{n} sessions",
        "never diverged from its batch-1 reference",
    ),
    "reproducer": (
        "judged corrupted by your reproducer in {k}/{n} sessions",
        "was never judged corrupted by your reproducer",
    ),
    # the same where a prompts file's expected answers count too: a missed answer is not a divergence
    "tool_calls+answers": (
        "corruption (a broken tool call or a missed expected answer) {k}/{n}",
        "showed no corruption and missed no expected answer",
    ),
    "divergence+answers": (
        "diverged from its batch-1 reference or missed an expected answer in {k}/{n} sessions",
        "never diverged from its batch-1 reference nor missed an expected answer",
    ),
}


def oracle_phrase(oracle: str, corrupted: int, n: int, detail: str = "") -> str:
    """An arm's corrupted sessions out of n in the words of the oracle that judged them, `detail` (a rate,
    a bound) in parentheses: "corruption 39/240 (16.2%)", "diverged from its batch-1 reference in 39/240
    sessions (16.2%)", "never diverged from its batch-1 reference (0/240, upper bound 1.5%)". The headline
    and the report's arms read it (pure)."""
    some, none = ORACLE_WORDS.get(oracle, ORACLE_WORDS["tool_calls"])
    if corrupted == 0:
        return f"{none} (0/{n}{', ' + detail if detail else ''})"
    return some.format(k=corrupted, n=n) + (f" ({detail})" if detail else "")


# the verdicts a headline without an implicated hypothesis lists, in this order (report/check.py reads them)
HEADLINE_GROUPS = ("partial", "exonerated", "inconclusive")


def verdict_groups(hyps: Sequence[HypothesisRow]) -> str:
    """ "; partial: H-a; exonerated: H-b, H-c; inconclusive: H-d (its row gives the sessions that would
    decide it)": what the hypotheses say, for a headline that implicates none."""
    text = ""
    for verdict in HEADLINE_GROUPS:
        ids = [h.id for h in hyps if h.verdict == verdict]
        if ids:
            text += f"; {verdict}: {', '.join(ids)}"
    if any(h.verdict == "inconclusive" for h in hyps):
        text += " (their rows give the sessions that would decide them)"
    return text


def ddmin_deploy(
    search: DdminSearch, arms: Sequence[Arm], tput: Sequence[ThroughputRow], spec: StudySpec
) -> Deploy | None:
    """A ddmin study's arm to deploy: the bad configuration without the minimal set, once it was run
    and found clean; with its throughput verdict against the good configuration (the baseline)."""
    if search.deploy is None or not search.done:
        return None
    # the check of the answer's attempt (a failed attempt checked a configuration to deploy too)
    trial = next((t for t in reversed(search.trials) if t.role == "deploy"), None)
    if trial is None or trial.verdict != ddmin.CLEAN:
        return None
    ids = [d.id for d in spec.ddmin.differences]
    arm = find_arm(arms, ddmin.levels_of(frozenset(search.deploy), ids))
    if arm is None:
        return None
    return _deploy(arm, ddmin.describe_subset(frozenset(search.deploy), ids), None, tput)


def ddmin_headline(search: DdminSearch, deploy: Deploy | None) -> str:
    n = len(search.differences)
    if not search.done:
        return f"Delta debugging over {n} differences stopped before it ended: {search.outcome}."
    if search.minimal is None:
        return f"Delta debugging over {n} differences: {search.outcome}."
    names = ", ".join(search.minimal)
    text = (
        f"Minimal cause: {names} ({len(search.minimal)} of {n} differences; error bound "
        f"{search.error_bound:.3f}, {search.error_bound_covers})."
    )
    if deploy:
        text += f" Fix: deploy the bad configuration without them (throughput: {deploy.throughput_verdict})."
    else:
        text += f" {search.outcome[0].upper()}{search.outcome[1:]}."
    return text


def analyse(
    spec: StudySpec,
    runs: Sequence[RunRecord],
    context: Mapping[str, Any] | None = None,
    conditions: Mapping[str, str] | None = None,
    design: Any = None,
) -> StudyResult:
    """report.json's content, typed (`result.StudyResult`; `result.to_json` gives the JSON). `context`
    carries what the report quotes verbatim (parent run id, overrides); it must itself be deterministic.
    `conditions`: today's deployment and workload, which choose the baseline arm when runs of several are
    given (default: the baseline with most sessions). `design`: an adaptive design (`study.designs`),
    whose own block (`report_block(runs)`) the report carries; `study.designs.analyse_study` passes the
    one the context names."""
    context = dict(context or {})
    runs = sorted(runs, key=lambda r: (r.signature, r.repetition, r.run_id))
    between = between_runs(runs, spec)
    arms = pool_arms(runs, spec, between)
    # the study's one state per arm of today's deployment and workload (the baseline's conditions): every
    # section below reads these (analysis/states.py)
    policy = StatePolicy.of(spec.alpha)
    base_arm = find_arm(arms, spec.baseline, conditions=conditions)
    scope_conditions = base_arm.conditions if base_arm else conditions
    states = arm_states(cause.in_scope(arms, scope_conditions), between.icc, spec.ceiling, policy)
    hyps = hypotheses(arms, spec, conditions, states)
    # an adaptive design's own block (designs.py): a sequential study's stopping trace, a ddmin search
    block = design.report_block(runs) if design else None
    stopping = block if isinstance(block, Stopping) else None
    search = block if isinstance(block, DdminSearch) else None
    if stopping is not None:
        hyps = [sequential_row(row, stopping) for row in hyps]
        # the design's own test of the ceiling judges the arms it decided: one state each, still
        states = sequential_states(states, [(row.treatment_arm, row.verdict) for row in hyps])
    tput = throughput(runs, arms, spec, conditions)
    deploy = choose_deploy(arms, hyps, tput)
    if search is not None:
        deploy = ddmin_deploy(search, arms, tput, spec)
        states = ddmin_states(states, search.trials, [d.id for d in spec.ddmin.differences])
    arms = [
        dataclasses.replace(a, state=states[a.signature].state if a.signature in states else None)
        for a in arms
    ]
    hyps = [dataclasses.replace(h, treatment_state=_state_of(states, h.treatment_arm)) for h in hyps]
    minimal = cause.minimal_cause(
        arms,
        spec,
        between.icc,
        conditions=scope_conditions,
        design=context.get("design"),
        states=states,
        policy=policy,
    )
    return StudyResult(
        schema=SCHEMA_VERSION,
        # the study as report.json keeps it (a copy in the config's own types: lists, not a caller's tuples)
        study=from_json(StudyConf, spec.to_dict()),
        context=context,
        headline=ddmin_headline(search, deploy) if search else headline(spec, arms, hyps, deploy, conditions),
        confidence=stats.CONFIDENCE,
        between_runs=between_summary(between),
        policy=policy.report_row(spec.ceiling, between.icc, context.get("design")),
        arm_states=tuple(states[a.signature].report_row() for a in arms if a.signature in states),
        arms=tuple(arms),
        hypotheses=tuple(hyps),
        throughput=tuple(tput),
        problem_runs=tuple(problem_runs(arms)),
        deploy=deploy,
        stopping=stopping,
        families=families_block(arms),
        ddmin=search,
        minimal_cause=minimal,
        clusters=clusters_block(spec, runs, between),
        cost=gpu_time_block(spec, runs, arms, context, stopping),
        # left out where no run recorded a machine: the embedded default's reports stay as they were
        machines=machines_block(runs) or ABSENT,
    )


def _state_of(states: Mapping[str, ArmState], signature: str | None) -> str | None:
    found = states.get(signature or "")
    return found.state if found else None


def sequential_row(row: HypothesisRow, stopping: Stopping) -> HypothesisRow:
    """A hypothesis of a sequential study: looks taken along the way void the fixed-design p-values, so
    the anytime-valid evidence decides (its verdict, its reason as the note, its last look's evidence)."""
    decided = stopping.decisions[row.id]
    evidence = stopping.trace[-1].hypotheses[row.id].evidence if stopping.trace else None
    if decided.verdict != "inconclusive":
        return dataclasses.replace(
            row,
            verdict=decided.verdict,
            note=decided.reason,
            evidence=evidence,
            sessions_needed_per_arm=None,
            more_sessions=None,
        )
    note = f"{decided.reason}; {row.note}" if row.note else decided.reason
    return dataclasses.replace(row, verdict=decided.verdict, note=note, evidence=evidence)


def problem_runs(arms: Sequence[Arm]) -> list[ProblemRun]:
    """Failed, interrupted, or with errored sessions (a server that died mid-workload): listed with why,
    with their counts; only FINISHED runs with complete outcomes are pooled (`used`)."""
    return [
        ProblemRun(**_run_fields(r), reason=_problem_reason(r), arm=a.label, signature=a.signature)
        for a in arms
        for r in a.runs
        if r.status != "FINISHED" or r.outcomes == "partial" or r.errored
    ]


# internal: a constructor's keyword arguments, not a result shape (the result is the `ProblemRun`)
def _run_fields(row: RunRow) -> dict[str, Any]:
    """A run row's fields (but its reason), to make its `ProblemRun`; its ABSENT times stay absent."""
    return {f.name: getattr(row, f.name) for f in dataclasses.fields(RunRow) if f.name != "reason"}


def _problem_reason(r: RunRow) -> str:
    reason = r.reason
    if not reason and r.errored:
        reason = f"{r.errored} sessions errored (not counted as corruption, not in n)"
    if not r.used and r.outcomes != "none":
        reason = (reason + "; " if reason else "") + (
            f"outcomes not pooled ({r.corrupted} corrupted, {r.clean} clean): "
            "an interrupted run over-represents corrupted sessions"
        )
    return reason


def gpu_time_block(
    spec: StudySpec,
    runs: Sequence[RunRecord],
    arms: Sequence[Arm],
    context: Mapping[str, Any] | None,
    stopping: Stopping | None,
) -> Cost | None:
    """report.json's `cost`: GPU time spent by the study's runs, by the cost model (analysis/cost.py),
    whose deployment estimate the sweep recorded in its context; for a sequential study, beside what the
    fixed design of as many starts per arm at the smallest run size would have spent."""
    model = cost.cost_model(spec.cost, (context or {}).get("deployment_cost"), runs)
    if "unknown" in model.sources.values() and not any(r.wall_s is not None for r in runs):
        return None  # runs that recorded no held time, of a study that names no cost: nothing to state
    label_of = {run.run_id: a.label for a in arms for run in a.runs}
    fixed = remaining = None
    if stopping is not None and runs:
        smallest = min((r.planned or r.clean + r.corrupted) for r in runs)
        max_runs = int(spec.stopping.max_runs_per_arm)
        compared = len(stopping.sessions_per_arm) or len(arms)
        fixed = cost.fixed_design_hours(model, compared, max_runs, smallest)
        # an interrupted study: the most its open hypotheses may still spend (each one's treatment and
        # the baseline, every round the budget has left)
        last = stopping.trace[-1].hypotheses if stopping.trace else {}
        still_open = sum(1 for h in last.values() if h.verdict is None)
        open_arms = still_open + 1 if still_open else 0
        left = max(0, max_runs - int(stopping.rounds))
        remaining = cost.fixed_design_hours(model, open_arms, left, smallest) if open_arms else 0.0
    return cost.cost_block(model, runs, lambda r: label_of.get(r.run_id, "?"), fixed, remaining)


def families_counted_by(arm: Arm) -> list[str]:
    """The detector families an arm's sessions counted as corruption (runs logged before families were
    configurable counted all of them)."""
    text = arm.conditions.get("workload.count")
    return text.split(",") if text else list(DEFAULT_COUNTED)


def _noted(arm: Arm, family: str) -> bool:
    """Whether an arm's row notes a family beside its counted ones: one its oracle judges, or one it found
    (runs log every family, 0 included: another oracle's zeros say nothing)."""
    if family in families_counted_by(arm):
        return False
    return family in ORACLES.get(oracle_of(arm.conditions), ()) or bool(arm.families.get(family))


def families_block(arms: Sequence[Arm]) -> Families:
    """Which detector families the verdicts count, and per arm the sessions with a finding of each
    family, the counted ones and those only noted beside (pure)."""
    counted = sorted({f for a in arms for f in families_counted_by(a)}, key=list(FAMILIES).index)
    return Families(
        counted=tuple(counted),
        same_in_every_arm=len({tuple(families_counted_by(a)) for a in arms}) <= 1,
        by_arm=tuple(
            ArmFamilies(
                label=a.label,
                signature=a.signature,
                sessions=a.n,
                counted={f: a.families.get(f, 0) for f in families_counted_by(a)},
                noted={f: a.families.get(f, 0) for f in FAMILIES if _noted(a, f)},
            )
            for a in arms
            if a.families
        ),
    )
