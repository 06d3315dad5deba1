"""Study analysis (pure): tracked runs -> arms -> verdicts per hypothesis -> the report's facts.

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

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from orchestrator.analysis import cause, clusters, cost, ddmin, stats
from orchestrator.analysis.divergence import arm_divergence
from orchestrator.analysis.machines import machines_block
from orchestrator.analysis.result import StudyResult, from_json
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
from orchestrator.config.schema import Hypothesis as HypothesisSpec  # noqa: F401 - re-exported for callers
from orchestrator.config.schema import StudyConf as StudySpec
from orchestrator.workload import decode_load
from orchestrator.workload.detect import DEFAULT_COUNTED, FAMILIES, ORACLES

# report.json's layout version (orchestrator/report/report.schema.json); 2: one state per arm (arm_states,
# policy), read by every section
SCHEMA_VERSION = 2

VERDICTS = ("implicated", "partial", "exonerated", "inconclusive")
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
) -> list[dict[str, Any]]:
    """One entry per arm identity: per-run counts, counts pooled over the runs that count, the design
    effect and effective counts, intervals, run list. `between` gives the study's ICC (default: the one
    these runs estimate, `between_runs`)."""
    by_id: dict[str, list[RunRecord]] = {}
    for run in runs:
        by_id.setdefault(identity(run), []).append(run)
    if between is None:
        between = between_runs(runs, spec)
    arms = []
    for arm_id, group in by_id.items():
        group = sorted(group, key=lambda r: (r.repetition, r.status != "FINISHED", r.run_id))
        factors = dict(sorted(group[0].factors.items()))
        used = [r for r in group if run_used(r)]
        run_counts = [[r.corrupted, r.corrupted + r.clean] for r in used]
        k = sum(c[0] for c in run_counts)
        n = sum(c[1] for c in run_counts)
        errored = sum(r.errored for r in used)
        mean_size = n / len(used) if used else 0.0
        deff = stats.design_effect(between.icc, stats.pooled_run_size([c[1] for c in run_counts]))
        k_eff, n_eff = stats.effective_counts(k, n, deff)
        lo, hi = stats.runs_interval(run_counts, between.icc)
        used_reps = {r.repetition for r in used}
        missing = [r for r in group if not run_used(r) and r.repetition not in used_reps]
        finished = [r for r in group if r.status == "FINISHED"]
        config_run = finished[0] if finished else group[0]
        arms.append(
            {
                "label": arm_label(factors, spec.baseline),
                "signature": arm_id,
                "deployment_signature": group[0].signature,
                "conditions": dict(sorted(group[0].conditions.items())),
                "factors": factors,
                "n": n,
                "corrupted": k,
                "clean": n - k,
                "errored": errored,
                "rate": (k / n) if n else None,
                "run_counts": run_counts,
                "mean_run_size": mean_size,
                "design_effect": deff,
                "effective_n": n_eff,
                "effective_corrupted": k_eff,
                "ci": [lo, hi] if n else None,
                "upper_bound": hi if n else None,
                "partial": bool(missing),
                "client_bound": any(r.client_bound for r in finished),
                "missing_usage": sum(r.missing_usage for r in finished),
                "families": _sum_maps(r.families for r in used),
                "runs": [
                    {
                        "run_id": r.run_id,
                        "repetition": r.repetition,
                        "status": r.status,
                        "outcomes": r.outcomes,
                        "corrupted": r.corrupted,
                        "clean": r.clean,
                        "errored": r.errored,
                        "planned": r.planned,
                        "used": r in used,
                        "reason": r.reason,
                        **({"wall_s": r.wall_s} if r.wall_s is not None else {}),
                        **({"stress_s": r.stress_s} if r.stress_s is not None else {}),
                        **(
                            {"reference_s": float(r.reference["duration_s"])}
                            if r.reference.get("duration_s") is not None
                            else {}
                        ),
                    }
                    for r in group
                ],
                "facts": _sum_maps(r.facts for r in used),
                "config": config_run.config,
                "throughput": _arm_throughput(finished),
                "decode_load": arm_decode_load(used),
            }
        )
        # an arm judged by the differential oracle: where its sessions diverged, its reference pass
        divergence = arm_divergence(arms[-1]["conditions"], group)
        if divergence is not None:
            arms[-1]["divergence"] = divergence
    arms.sort(key=lambda a: (a["label"] != BASELINE_LABEL, a["label"], a["signature"]))
    return arms


def _sum_maps(maps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Key-wise sums (keys no map has are left out), sorted by key."""
    total: dict[str, Any] = {}
    for values in maps:
        for key, value in values.items():
            total[key] = total.get(key, 0) + value
    return dict(sorted(total.items()))


def arm_decode_load(runs: Sequence[RunRecord]) -> dict[str, Any] | None:
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
    return {
        "planned": planned,
        "runs": len(recorded),
        "runs_measured": len(measured),
        "mean": clean_float(mean),
        "p50": clean_float(_mean([r.decode_load["p50"] for r in measured])),
        "max": clean_float(max((r.decode_load["max"] for r in measured), default=None)),
        "fraction": clean_float(fraction),
        "short": fraction is not None and fraction < decode_load.SHORT_FRACTION,
        "unknown": sorted({_load_unknown(r) for r in recorded if _load_unknown(r)}),
        "per_run": [
            {
                "repetition": r.repetition,
                "mean": clean_float(r.decode_load.get("mean")),
                "p50": clean_float(r.decode_load.get("p50")),
                "max": clean_float(r.decode_load.get("max")),
                "unknown": _load_unknown(r),
            }
            for r in recorded
        ],
    }


def _load_unknown(run: RunRecord) -> str:
    """Why a run has no decode load ("" when it has one)."""
    if run.decode_load.get("measured"):
        return ""
    return run.decode_load.get("unknown") or "not measured"


def _mean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _arm_throughput(finished: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per concurrency level: means over FINISHED runs of tok/s, TTFT and ITL p50/p99, and errors."""
    levels: dict[int, list[LevelSample]] = {}
    for run in finished:
        for lv in run.bench:
            levels.setdefault(lv.concurrency, []).append(lv)
    return [
        {
            "concurrency": c,
            "runs": len(samples),
            "tok_s": clean_float(_mean([s.tok_s for s in samples])),
            "ttft_p50_s": clean_float(_mean([s.ttft_p50_s for s in samples])),
            "ttft_p99_s": clean_float(_mean([s.ttft_p99_s for s in samples])),
            "itl_p50_s": clean_float(_mean([s.itl_p50_s for s in samples])),
            "itl_p99_s": clean_float(_mean([s.itl_p99_s for s in samples])),
            "errors": sum(s.errors for s in samples),
        }
        for c, samples in sorted(levels.items())
    ]


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
) -> dict[str, Any] | None:
    """report.json's `clusters` (`clusters.clusters_report`): where the arms ran, their leases, and whether an
    arm's rate differs between clusters beyond restart variation; None when no run carries a cluster tag.
    `between`: the study's ICC, the check's fallback (default: `between_runs`)."""
    if not any(r.placement.get("cluster") for r in runs):
        return None
    if between is None:
        between = between_runs(runs, spec)
    return clusters.clusters_report(spec, runs, run_used, identity, between)


def between_summary(between: stats.Dispersion) -> dict[str, Any]:
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
    return {
        "method": "beta-binomial, one ICC per study; Rao-Scott effective counts into the exact tests",
        "estimated": between.estimated,
        "dispersion": clean_float(between.phi),
        "df": between.df,
        "icc": between.icc,
        "mean_run_size": clean_float(between.mean_run_size),
        "note": note,
    }


def find_arm(
    arms: Sequence[dict[str, Any]],
    levels: Mapping[str, str],
    like: Mapping[str, str] | None = None,
    conditions: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """The arm whose factors match `levels` (on levels' keys) and, for factors outside `levels`, equal
    `like`'s, run under `conditions` when given (the same deployment and workload); among several,
    the one with most sessions."""
    found = [
        a
        for a in arms
        if all(a["factors"].get(k) == v for k, v in levels.items())
        and all(a["factors"].get(k) == v for k, v in (like or {}).items() if k not in levels)
        and (conditions is None or a["conditions"] == dict(conditions))
    ]
    found.sort(key=lambda a: (-a["n"], a["signature"]))
    return found[0] if found else None


# --- hypotheses ------------------------------------------------------------------------------------


def margin(spec: StudySpec, p_base: float) -> float:
    """The smallest difference worth acting on: min_effect x the baseline rate (relative, the default)
    or min_effect itself."""
    return spec.min_effect * p_base if getattr(spec, "min_effect_relative", True) else spec.min_effect


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
) -> dict[str, Any]:
    """The verdict of one comparison, given its Holm-adjusted p (see the module doc). Counts are the
    arms' pooled sessions; `deff` their design effects (baseline, treatment), the interval of the
    difference is computed on the effective counts; `treat_state` is the treatment arm's one state
    (`analysis.states`): "corruption gone" is that state being clean (default: Clopper-Pearson of the
    effective counts under the ceiling)."""
    out: dict[str, Any] = {
        "verdict": "inconclusive",
        "note": "",
        "sessions_needed_per_arm": None,
        "more_sessions": None,
    }
    if n_base == 0 or n_treat == 0:
        out["note"] = (
            "no sessions with an outcome in the " + ("baseline" if n_base == 0 else "treatment") + " arm"
        )
        return out
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
            out["verdict"] = "implicated"
            out["note"] = (
                f"corruption gone: {k_treat}/{n_treat}{eff}, upper bound {upper:.2%} "
                f"< ceiling {spec.ceiling:.0%}"
            )
        else:
            out["verdict"] = "partial"
            if k_treat:
                out["note"] = f"significant reduction, but corruption remains: {k_treat}/{n_treat}"
                if treat_state is not None:
                    bound = f"upper bound {upper:.2%}, ceiling {spec.ceiling:.0%}"
                    out["note"] += f" (arm {treat_state.state}: {bound})"
            else:
                need = math.ceil(stats.sessions_for_ceiling(spec.ceiling) * deff[1] - 1e-9)
                out["note"] = (
                    f"significant reduction, none seen{eff}, but the upper bound {upper:.2%} is not under "
                    f"the ceiling {spec.ceiling:.0%}: {need} treatment sessions would settle it"
                )
                out["sessions_needed_per_arm"] = need
                out["more_sessions"] = {"baseline": 0, "treatment": max(0, need - n_treat)}
        return out
    if significant:
        out["note"] = f"corruption rose with the change ({k_base}/{n_base} -> {k_treat}/{n_treat})"
        return out
    if k_base == 0:
        out["note"] = f"the baseline arm shows no corruption (0/{n_base}): there is nothing to explain"
        return out
    m = margin(spec, p_b)
    if k_treat == 0:
        why = f"no corruption with the change (0/{n_treat}) but not significant: never exonerated"
    elif -m < lo and hi < m:
        out["verdict"] = "exonerated"
        out["note"] = f"difference within ±{m:.1%} ({lo:+.2%} to {hi:+.2%})"
        return out
    else:
        why = f"not decided: difference {lo:+.2%} to {hi:+.2%} includes ±{m:.1%}"
    need = stats.sessions_needed(p_b, m, spec.alpha / max(1, family_size), POWER, max(deff))
    out["sessions_needed_per_arm"] = need
    out["more_sessions"] = {"baseline": max(0, need - n_base), "treatment": max(0, need - n_treat)}
    out["note"] = (
        f"{why}; {need} sessions per arm would find a difference of {m:.1%} at the baseline rate {p_b:.1%}"
    )
    return out


def hypotheses(
    arms: Sequence[dict[str, Any]],
    spec: StudySpec,
    conditions: Mapping[str, str] | None = None,
    states: Mapping[str, ArmState] | None = None,
) -> list[dict[str, Any]]:
    """One row per hypothesis: the two arms, their counts and effective counts, p, Holm, the verdict.
    `states`: the study's one state per arm (by signature), which "corruption gone" reads."""
    base_arm = find_arm(arms, spec.baseline, conditions=conditions)
    rows = []
    for h in spec.hypotheses:
        treat_levels = {**spec.baseline, h.factor: h.treatment}
        treat = (
            find_arm(arms, treat_levels, like=base_arm["factors"], conditions=base_arm["conditions"])
            if base_arm
            else None
        )
        kb, nb, db = (
            (base_arm["corrupted"], base_arm["n"], base_arm["design_effect"]) if base_arm else (0, 0, 1.0)
        )
        kt, nt, dt = (treat["corrupted"], treat["n"], treat["design_effect"]) if treat else (0, 0, 1.0)
        kb_e, nb_e = stats.effective_counts(kb, nb, db)
        kt_e, nt_e = stats.effective_counts(kt, nt, dt)
        p = stats.compare(kb_e, nb_e, kt_e, nt_e, spec.test)
        diff_ci = stats.newcombe_diff(kt_e, nt_e, kb_e, nb_e) if nb and nt else None
        rows.append(
            {
                "id": h.id,
                "factor": h.factor,
                "statement": h.statement,
                "baseline_level": h.baseline,
                "treatment_level": h.treatment,
                "baseline_arm": base_arm["signature"] if base_arm else None,
                "treatment_arm": treat["signature"] if treat else None,
                "treatment_label": treat["label"] if treat else f"{h.factor}={h.treatment}",
                "baseline_counts": [kb, nb],
                "treatment_counts": [kt, nt],
                "baseline_runs": base_arm["run_counts"] if base_arm else [],
                "treatment_runs": treat["run_counts"] if treat else [],
                "design_effect": [db, dt],
                "effective_counts": [[kb_e, nb_e], [kt_e, nt_e]],
                "margin": margin(spec, kb / nb) if nb else None,
                "diff": (kt / nt - kb / nb) if nb and nt else None,
                "diff_ci": list(diff_ci) if diff_ci else None,
                "p": p,
                "test": spec.test,
            }
        )
    adjusted = stats.holm([r["p"] for r in rows])
    for row, p_holm in zip(rows, adjusted, strict=True):
        row["p_holm"] = p_holm
        kb, nb = row["baseline_counts"]
        kt, nt = row["treatment_counts"]
        state = (states or {}).get(row["treatment_arm"] or "")
        row["treatment_state"] = state.state if state else None
        row.update(judge(kb, nb, kt, nt, p_holm, spec, len(rows), tuple(row["design_effect"]), state))
        if row["treatment_arm"] is None:
            row["note"] = f"no arm with {row['treatment_label']} and every other factor at baseline was run"
    return rows


# --- throughput ------------------------------------------------------------------------------------


def _samples(runs: Sequence[RunRecord], concurrency: int) -> list[LevelSample]:
    return [lv for r in runs if r.status == "FINISHED" for lv in r.bench if lv.concurrency == concurrency]


def throughput(
    runs: Sequence[RunRecord],
    arms: Sequence[dict[str, Any]],
    spec: StudySpec,
    conditions: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each non-baseline arm's tok/s ratio to the baseline arm per level, with a bootstrap interval and
    a throughput verdict: no regression only when every level's lower bound clears the floor and
    neither arm's client self-audit warned."""
    base = find_arm(arms, spec.baseline, conditions=conditions)
    if base is None:
        return []
    by_sig: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_sig.setdefault(identity(r), []).append(r)
    base_levels = {lv["concurrency"] for lv in base["throughput"]}
    rows = []
    for arm in arms:
        if arm["signature"] == base["signature"] or not arm["throughput"]:
            continue
        if arm["conditions"] != base["conditions"]:
            continue  # another deployment or workload: not comparable
        levels = []
        for c in sorted(base_levels & {lv["concurrency"] for lv in arm["throughput"]}):
            t, b = _samples(by_sig[arm["signature"]], c), _samples(by_sig[base["signature"]], c)
            seed = _seed(arm["signature"], base["signature"], c)
            if all(s.request_tokens for s in t + b):
                ratio = stats.bootstrap_ratio_requests(
                    [(s.request_tokens, s.request_latency_s) for s in t],
                    [(s.request_tokens, s.request_latency_s) for s in b],
                    N_BOOT,
                    seed,
                )
            else:
                ratio = stats.bootstrap_ratio_runs([s.tok_s for s in t], [s.tok_s for s in b], N_BOOT, seed)
            levels.append(
                {
                    "concurrency": c,
                    "ratio": clean_float(ratio.point),
                    "ci": [clean_float(ratio.low), clean_float(ratio.high)],
                    "method": ratio.method,
                    "clears_floor": ratio.low >= spec.throughput_floor if math.isfinite(ratio.low) else False,
                }
            )
        client_bound = arm["client_bound"] or base["client_bound"]
        if client_bound:
            verdict = "no verdict (client-bound)"
        elif arm["missing_usage"] or base["missing_usage"]:
            verdict = "no verdict (the server sent no usage)"
        elif not levels:
            verdict = "no verdict (no common levels)"
        elif all(lv["clears_floor"] for lv in levels):
            verdict = "no regression"
        elif any(lv["ci"][1] is not None and lv["ci"][1] < spec.throughput_floor for lv in levels):
            verdict = "regression"
        else:
            verdict = "inconclusive"
        rows.append(
            {
                "arm": arm["signature"],
                "label": arm["label"],
                "client_bound": client_bound,
                "verdict": verdict,
                "levels": levels,
            }
        )
    return rows


# --- the whole study -------------------------------------------------------------------------------


def _geomean(values: Sequence[float | None]) -> float:
    vals = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else 0.0


def choose_deploy(
    arms: Sequence[dict[str, Any]], hyps: Sequence[dict[str, Any]], tput: Sequence[dict[str, Any]]
) -> dict[str, Any] | None:
    """The arm to deploy: an implicated hypothesis' treatment arm, preferring no throughput regression,
    then the highest geometric-mean tok/s ratio, then the lowest corruption upper bound."""
    by_sig = {a["signature"]: a for a in arms}
    tput_by = {t["arm"]: t for t in tput}
    candidates = [h for h in hyps if h["verdict"] == "implicated" and h["treatment_arm"] in by_sig]
    if not candidates:
        return None

    def rank(h: dict[str, Any]) -> tuple:
        t = tput_by.get(h["treatment_arm"])
        ratio = _geomean([lv["ratio"] for lv in t["levels"]]) if t else 0.0
        no_reg = bool(t and t["verdict"] == "no regression")
        return (not no_reg, -ratio, by_sig[h["treatment_arm"]]["upper_bound"], h["id"])

    best = sorted(candidates, key=rank)[0]
    arm = by_sig[best["treatment_arm"]]
    t = tput_by.get(arm["signature"])
    return {
        "arm": arm["signature"],
        "label": arm["label"],
        "hypothesis": best["id"],
        "factors": arm["factors"],
        "throughput_verdict": t["verdict"] if t else "no throughput data",
        "config": arm["config"],
    }


def headline(
    spec: StudySpec,
    arms: Sequence[dict[str, Any]],
    hyps: Sequence[dict[str, Any]],
    deploy: dict[str, Any] | None,
    conditions: Mapping[str, str] | None = None,
) -> str:
    base = find_arm(arms, spec.baseline, conditions=conditions)
    if base is None or not base["n"]:
        return "No verdict: the baseline arm has no sessions with an outcome."
    oracle = symptom_of(base["conditions"])
    base_txt = f"baseline {oracle_phrase(oracle, base['corrupted'], base['n'], format(base['rate'], '.1%'))}"
    implicated = [h for h in hyps if h["verdict"] == "implicated"]
    if base["corrupted"] == 0:
        bound = f"upper bound {base['upper_bound']:.1%}"
        return f"The baseline arm {oracle_phrase(oracle, 0, base['n'], bound)}."
    if not implicated:
        return f"No hypothesis implicated ({base_txt}){verdict_groups(hyps)}."
    names = ", ".join(f"{h['id']} ({h['treatment_label']})" for h in implicated)
    text = f"Implicated: {names}; {base_txt}."
    if deploy:
        text += f" Fix: deploy `{deploy['label']}` (throughput: {deploy['throughput_verdict']})."
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


def verdict_groups(hyps: Sequence[Mapping[str, Any]]) -> str:
    """ "; partial: H-a; exonerated: H-b, H-c; inconclusive: H-d (its row gives the sessions that would
    decide it)": what the hypotheses say, for a headline that implicates none."""
    text = ""
    for verdict in HEADLINE_GROUPS:
        ids = [h["id"] for h in hyps if h["verdict"] == verdict]
        if ids:
            text += f"; {verdict}: {', '.join(ids)}"
    if any(h["verdict"] == "inconclusive" for h in hyps):
        text += " (their rows give the sessions that would decide them)"
    return text


def ddmin_deploy(
    search: Mapping[str, Any], arms: Sequence[dict[str, Any]], tput: Sequence[dict[str, Any]], spec: StudySpec
) -> dict[str, Any] | None:
    """A ddmin study's arm to deploy: the bad configuration without the minimal set, once it was run
    and found clean; with its throughput verdict against the good configuration (the baseline)."""
    if search["deploy"] is None or not search["done"]:
        return None
    # the check of the answer's attempt (a failed attempt checked a configuration to deploy too)
    trial = next((t for t in reversed(search["trials"]) if t["role"] == "deploy"), None)
    if trial is None or trial["verdict"] != ddmin.CLEAN:
        return None
    ids = [d.id for d in spec.ddmin.differences]
    arm = find_arm(arms, ddmin.levels_of(frozenset(search["deploy"]), ids))
    if arm is None:
        return None
    t = next((t for t in tput if t["arm"] == arm["signature"]), None)
    return {
        "arm": arm["signature"],
        "label": ddmin.describe_subset(frozenset(search["deploy"]), ids),
        "hypothesis": None,
        "factors": arm["factors"],
        "throughput_verdict": t["verdict"] if t else "no throughput data",
        "config": arm["config"],
    }


def ddmin_headline(search: Mapping[str, Any], deploy: Mapping[str, Any] | None) -> str:
    n = len(search["differences"])
    if not search["done"]:
        return f"Delta debugging over {n} differences stopped before it ended: {search['outcome']}."
    if search["minimal"] is None:
        return f"Delta debugging over {n} differences: {search['outcome']}."
    names = ", ".join(search["minimal"])
    text = (
        f"Minimal cause: {names} ({len(search['minimal'])} of {n} differences; error bound "
        f"{search['error_bound']:.3f}, {search['error_bound_covers']})."
    )
    if deploy:
        text += (
            f" Fix: deploy the bad configuration without them (throughput: {deploy['throughput_verdict']})."
        )
    else:
        text += f" {search['outcome'][0].upper()}{search['outcome'][1:]}."
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
    runs = sorted(runs, key=lambda r: (r.signature, r.repetition, r.run_id))
    between = between_runs(runs, spec)
    arms = pool_arms(runs, spec, between)
    # the study's one state per arm of today's deployment and workload (the baseline's conditions): every
    # section below reads these (analysis/states.py)
    policy = StatePolicy.of(spec.alpha)
    base_arm = find_arm(arms, spec.baseline, conditions=conditions)
    scope = cause.in_scope(arms, base_arm["conditions"] if base_arm else conditions)
    states = arm_states(scope, between.icc, spec.ceiling, policy)
    hyps = hypotheses(arms, spec, conditions, states)
    # an adaptive design's own block (designs.py): a sequential study's stopping trace, a ddmin search
    block = design.report_block(runs) if design else None
    stopping = block if design and design.name == "sequential" else None
    search = block if design and design.name == "ddmin" else None
    if stopping is not None:
        # looks taken along the way void the fixed-design p-values: the anytime-valid evidence decides
        for row in hyps:
            decided = stopping["decisions"][row["id"]]
            last = stopping["trace"][-1]["hypotheses"][row["id"]]["evidence"] if stopping["trace"] else None
            row["evidence"] = last
            if decided["verdict"] != "inconclusive":
                row["sessions_needed_per_arm"] = row["more_sessions"] = None
                row["note"] = decided["reason"]
            else:
                row["note"] = f"{decided['reason']}; {row['note']}" if row["note"] else decided["reason"]
            row["verdict"] = decided["verdict"]
        # the design's own test of the ceiling judges the arms it decided: one state each, still
        states = sequential_states(states, [(row["treatment_arm"], row["verdict"]) for row in hyps])
    tput = throughput(runs, arms, spec, conditions)
    deploy = choose_deploy(arms, hyps, tput)
    if search is not None:
        deploy = ddmin_deploy(search, arms, tput, spec)
        states = ddmin_states(states, search["trials"], [d.id for d in spec.ddmin.differences])
    for arm in arms:
        arm["state"] = states[arm["signature"]].state if arm["signature"] in states else None
    for row in hyps:
        found = states.get(row["treatment_arm"] or "")
        row["treatment_state"] = found.state if found else None
    # failed, interrupted, or with errored sessions (a server that died mid-workload): listed with why,
    # with their counts; only FINISHED runs with complete outcomes are pooled (`used`)
    problems = [
        {"arm": a["label"], "signature": a["signature"], **r}
        for a in arms
        for r in a["runs"]
        if r["status"] != "FINISHED" or r["outcomes"] == "partial" or r["errored"]
    ]
    for p in problems:
        if not p["reason"] and p["errored"]:
            p["reason"] = f"{p['errored']} sessions errored (not counted as corruption, not in n)"
        if not p["used"] and p["outcomes"] != "none":
            p["reason"] = (p["reason"] + "; " if p["reason"] else "") + (
                f"outcomes not pooled ({p['corrupted']} corrupted, {p['clean']} clean): "
                "an interrupted run over-represents corrupted sessions"
            )
    minimal = cause.minimal_cause(
        arms,
        spec,
        between.icc,
        conditions=base_arm["conditions"] if base_arm else conditions,
        design=(context or {}).get("design"),
        states=states,
        policy=policy,
    )
    for arm in arms:
        arm["rate"], arm["upper_bound"] = clean_float(arm["rate"]), clean_float(arm["upper_bound"])
    # the typed result is the boundary: a key analysis writes that the types do not know fails here
    report = {
        "schema": SCHEMA_VERSION,
        "study": spec.to_dict(),
        "context": dict(context or {}),
        "headline": ddmin_headline(search, deploy)
        if search
        else headline(spec, arms, hyps, deploy, conditions),
        "confidence": stats.CONFIDENCE,
        "between_runs": between_summary(between),
        "policy": policy.to_dict(spec.ceiling, between.icc, (context or {}).get("design")),
        "arm_states": [states[a["signature"]].to_dict() for a in arms if a["signature"] in states],
        "arms": arms,
        "hypotheses": hyps,
        "throughput": tput,
        "problem_runs": problems,
        "deploy": deploy,
        "stopping": stopping,
        "families": families_block(arms),
        "ddmin": search,
        "minimal_cause": minimal,
        "clusters": clusters_block(spec, runs, between),
        "cost": gpu_time_block(spec, runs, arms, context, stopping),
    }
    machines = machines_block(runs)
    if machines is not None:  # left out otherwise: the embedded default's reports stay as they were
        report["machines"] = machines
    return from_json(StudyResult, report)


def gpu_time_block(
    spec: StudySpec,
    runs: Sequence[RunRecord],
    arms: Sequence[Mapping[str, Any]],
    context: Mapping[str, Any] | None,
    stopping: Mapping[str, Any] | None,
) -> dict[str, Any] | None:
    """report.json's `cost`: GPU time spent by the study's runs, by the cost model (analysis/cost.py),
    whose deployment estimate the sweep recorded in its context; for a sequential study, beside what the
    fixed design of as many starts per arm at the smallest run size would have spent."""
    model = cost.cost_model(spec.cost, (context or {}).get("deployment_cost"), runs)
    if "unknown" in model.sources.values() and not any(r.wall_s is not None for r in runs):
        return None  # runs that recorded no held time, of a study that names no cost: nothing to state
    label_of = {run["run_id"]: a["label"] for a in arms for run in a["runs"]}
    fixed = remaining = None
    if stopping is not None and runs:
        smallest = min((r.planned or r.clean + r.corrupted) for r in runs)
        max_runs = int(spec.stopping.max_runs_per_arm)
        compared = len(stopping["sessions_per_arm"]) or len(arms)
        fixed = cost.fixed_design_hours(model, compared, max_runs, smallest)
        # an interrupted study: the most its open hypotheses may still spend (each one's treatment and
        # the baseline, every round the budget has left)
        last = stopping["trace"][-1]["hypotheses"] if stopping["trace"] else {}
        still_open = sum(1 for h in last.values() if h["verdict"] is None)
        open_arms = still_open + 1 if still_open else 0
        left = max(0, max_runs - int(stopping["rounds"]))
        remaining = cost.fixed_design_hours(model, open_arms, left, smallest) if open_arms else 0.0
    return cost.cost_block(model, runs, lambda r: label_of.get(r.run_id, "?"), fixed, remaining)


def counted_families(arm: Mapping[str, Any]) -> list[str]:
    """The detector families an arm's sessions counted as corruption (runs logged before families were
    configurable counted all of them)."""
    text = arm["conditions"].get("workload.count")
    return text.split(",") if text else list(DEFAULT_COUNTED)


def _noted(arm: Mapping[str, Any], family: str) -> bool:
    """Whether an arm's row notes a family beside its counted ones: one its oracle judges, or one it found
    (runs log every family, 0 included: another oracle's zeros say nothing)."""
    if family in counted_families(arm):
        return False
    return family in ORACLES.get(oracle_of(arm["conditions"]), ()) or bool(arm["families"].get(family))


def families_block(arms: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Which detector families the verdicts count, and per arm the sessions with a finding of each
    family, the counted ones and those only noted beside (pure)."""
    counted = sorted({f for a in arms for f in counted_families(a)}, key=list(FAMILIES).index)
    return {
        "counted": counted,
        "same_in_every_arm": len({tuple(counted_families(a)) for a in arms}) <= 1,
        "by_arm": [
            {
                "label": a["label"],
                "signature": a["signature"],
                "sessions": a["n"],
                "counted": {f: a["families"].get(f, 0) for f in counted_families(a)},
                "noted": {f: a["families"].get(f, 0) for f in FAMILIES if _noted(a, f)},
            }
            for a in arms
            if a["families"]
        ],
    }
