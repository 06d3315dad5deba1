"""Study analysis (pure): tracked runs -> arms -> verdicts per hypothesis -> the report's facts.

Input: the study (`StudySpec`) and one `RunRecord` per MLflow child run (built by
`tracking.load_study`). Output: one JSON-ready dict, the content of report.json, which `report.py`
renders. Nothing here reads files or MLflow, and the same input always gives the same output
(bootstrap seeds derive from signatures and levels), so report.json can be rebuilt from MLflow alone.

Pooling. Runs are grouped into arms by signature (the hash of the effective env and flags per role).
An arm's corruption counts pool:
- every FINISHED run that logged stress outcomes;
- the outcomes of a KILLED, FAILED (or orphaned RUNNING) run that logged them before it ended (the
  tracker tags them `outcomes=partial|complete`): sessions that completed have a valid verdict even
  when the run was interrupted later. The arm is then marked partial in the report. Such a run is
  left out when the same (signature, repetition) also has a FINISHED run (it was re-run on resume).
Errored sessions are never corruption and are not trials: n = clean + corrupted.
Throughput uses FINISHED runs only (an interrupted sweep has missing levels).

Verdicts (hypothesis: baseline arm vs the arm that differs only in the hypothesis' factor):
- implicated: significant after Holm, corruption lower, and the treatment's upper bound < ceiling;
- partial: significant reduction, but the treatment's upper bound is not under the ceiling
  (corruption remains, or too few sessions to rule it out: the note says which);
- exonerated: not significant, and the Newcombe interval of the difference lies within
  (-min_effect, +min_effect);
- inconclusive: anything else (missing arm, too few sessions, or a significant *increase*), with the
  sessions per arm that would decide it (`stats.sessions_needed` at alpha / number of hypotheses, the
  strictest step of Holm, and 80% power).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator import stats

VERDICTS = ("implicated", "partial", "exonerated", "inconclusive")
POWER = 0.8
N_BOOT = 2000
BASELINE_LABEL = "baseline"


@dataclass(frozen=True)
class HypothesisSpec:
    id: str
    factor: str
    statement: str
    baseline: str
    treatment: str


@dataclass(frozen=True)
class StudySpec:
    name: str
    baseline: dict[str, str]
    hypotheses: tuple[HypothesisSpec, ...] = ()
    description: str = ""
    alpha: float = 0.05
    test: str = "fisher"
    min_effect: float = 0.05
    ceiling: float = 0.03
    throughput_floor: float = 0.95

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StudySpec:
        hyps = tuple(
            HypothesisSpec(**{k: str(h[k]) for k in ("id", "factor", "statement", "baseline", "treatment")})
            for h in data.get("hypotheses", [])
        )
        return cls(
            name=str(data["name"]),
            baseline={str(k): str(v) for k, v in (data.get("baseline") or {}).items()},
            hypotheses=hyps,
            description=str(data.get("description") or ""),
            alpha=float(data.get("alpha", 0.05)),
            test=str(data.get("test", "fisher")),
            min_effect=float(data.get("min_effect", 0.05)),
            ceiling=float(data.get("ceiling", 0.03)),
            throughput_floor=float(data.get("throughput_floor", 0.95)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "baseline": dict(self.baseline),
            "hypotheses": [vars(h).copy() for h in self.hypotheses],
            "alpha": self.alpha,
            "test": self.test,
            "min_effect": self.min_effect,
            "ceiling": self.ceiling,
            "throughput_floor": self.throughput_floor,
        }


@dataclass(frozen=True)
class LevelSample:
    """One concurrency level of one run's throughput sweep."""

    concurrency: int
    tok_s: float
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    errors: int = 0
    request_tokens: tuple[float, ...] = ()
    request_latency_s: tuple[float, ...] = ()


@dataclass(frozen=True)
class RunRecord:
    """What the analysis needs of one child run (an arm x repetition), as read back from MLflow."""

    run_id: str
    status: str  # FINISHED | FAILED | KILLED | RUNNING
    signature: str
    repetition: int
    factors: dict[str, str]
    outcomes: str = "none"  # none | partial | complete: whether stress outcomes were logged
    clean: int = 0
    corrupted: int = 0
    errored: int = 0
    planned: int = 0
    reason: str = ""
    client_bound: bool = False
    bench: tuple[LevelSample, ...] = ()
    # role -> {"env": {NAME: value}, "flags": "...", "argv": "..."} (already redacted)
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    facts: dict[str, float] = field(default_factory=dict)


# --- small helpers ---------------------------------------------------------------------------------


def clean_float(x: float | None) -> float | None:
    """JSON has no NaN: missing numbers are null."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return float(x)


def arm_label(factors: Mapping[str, str], baseline: Mapping[str, str]) -> str:
    """ "baseline", or the factors that differ from it ("capture=eager,multi_stream=off")."""
    diff = [f"{k}={v}" for k, v in sorted(factors.items()) if k in baseline and baseline[k] != v]
    return ",".join(diff) if diff else BASELINE_LABEL


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:4], "big")


def run_used(run: RunRecord, finished_keys: set[tuple[str, int]]) -> bool:
    """Whether a run's stress outcomes count (see the module doc)."""
    if run.outcomes == "none":
        return False
    if run.status == "FINISHED":
        return True
    return (run.signature, run.repetition) not in finished_keys


# --- arms ------------------------------------------------------------------------------------------


def pool_arms(runs: Sequence[RunRecord], spec: StudySpec) -> list[dict[str, Any]]:
    """One entry per signature: counts pooled over the runs that count, intervals, run list."""
    finished_keys = {
        (r.signature, r.repetition) for r in runs if r.status == "FINISHED" and r.outcomes != "none"
    }
    by_sig: dict[str, list[RunRecord]] = {}
    for run in runs:
        by_sig.setdefault(run.signature, []).append(run)
    arms = []
    for sig, group in by_sig.items():
        group = sorted(group, key=lambda r: (r.repetition, r.status != "FINISHED", r.run_id))
        factors = dict(sorted(group[0].factors.items()))
        used = [r for r in group if run_used(r, finished_keys)]
        k = sum(r.corrupted for r in used)
        n = sum(r.corrupted + r.clean for r in used)
        errored = sum(r.errored for r in used)
        lo, hi = stats.clopper_pearson(k, n)
        interrupted = [r for r in used if r.status != "FINISHED" or r.outcomes == "partial"]
        finished = [r for r in group if r.status == "FINISHED"]
        config_run = finished[0] if finished else group[0]
        arms.append(
            {
                "label": arm_label(factors, spec.baseline),
                "signature": sig,
                "factors": factors,
                "n": n,
                "corrupted": k,
                "clean": n - k,
                "errored": errored,
                "rate": (k / n) if n else None,
                "ci": [lo, hi] if n else None,
                "upper_bound": hi if n else None,
                "partial": bool(interrupted),
                "client_bound": any(r.client_bound for r in finished),
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
                    }
                    for r in group
                ],
                "facts": _sum_facts(used),
                "config": config_run.config,
                "throughput": _arm_throughput(finished),
            }
        )
    arms.sort(key=lambda a: (a["label"] != BASELINE_LABEL, a["label"], a["signature"]))
    return arms


def _sum_facts(runs: Sequence[RunRecord]) -> dict[str, float]:
    total: dict[str, float] = {}
    for r in runs:
        for key, value in r.facts.items():
            total[key] = total.get(key, 0.0) + value
    return dict(sorted(total.items()))


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


def find_arm(
    arms: Sequence[dict[str, Any]], levels: Mapping[str, str], like: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """The arm whose factors match `levels` (on levels' keys) and, for factors outside `levels`, equal
    `like`'s; among several (e.g. a changed deployment), the one with most sessions."""
    found = [
        a
        for a in arms
        if all(a["factors"].get(k) == v for k, v in levels.items())
        and all(a["factors"].get(k) == v for k, v in (like or {}).items() if k not in levels)
    ]
    found.sort(key=lambda a: (-a["n"], a["signature"]))
    return found[0] if found else None


# --- hypotheses ------------------------------------------------------------------------------------


def judge(
    k_base: int, n_base: int, k_treat: int, n_treat: int, p_holm: float, spec: StudySpec, family_size: int
) -> dict[str, Any]:
    """The verdict of one comparison, given its Holm-adjusted p (see the module doc)."""
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
    p_b, p_t = k_base / n_base, k_treat / n_treat
    lo, hi = stats.newcombe_diff(k_treat, n_treat, k_base, n_base)
    significant = p_holm < spec.alpha
    if significant and p_t < p_b:
        upper = stats.upper_bound(k_treat, n_treat)
        if upper < spec.ceiling:
            out["verdict"] = "implicated"
            out["note"] = (
                f"corruption gone: {k_treat}/{n_treat}, upper bound {upper:.2%} < ceiling {spec.ceiling:.0%}"
            )
        else:
            out["verdict"] = "partial"
            if k_treat:
                out["note"] = f"significant reduction, but corruption remains: {k_treat}/{n_treat}"
            else:
                need = stats.sessions_for_ceiling(spec.ceiling)
                out["note"] = (
                    f"significant reduction, none seen, but the upper bound {upper:.2%} is not under "
                    f"the ceiling {spec.ceiling:.0%}: {need} treatment sessions would settle it"
                )
                out["sessions_needed_per_arm"] = need
                out["more_sessions"] = {"baseline": 0, "treatment": max(0, need - n_treat)}
        return out
    if significant:
        out["note"] = f"corruption rose with the change ({k_base}/{n_base} -> {k_treat}/{n_treat})"
        return out
    if -spec.min_effect < lo and hi < spec.min_effect:
        out["verdict"] = "exonerated"
        out["note"] = f"difference within ±{spec.min_effect:.0%} ({lo:+.2%} to {hi:+.2%})"
        return out
    need = stats.sessions_needed(p_b, spec.min_effect, spec.alpha / max(1, family_size), POWER)
    out["sessions_needed_per_arm"] = need
    out["more_sessions"] = {"baseline": max(0, need - n_base), "treatment": max(0, need - n_treat)}
    out["note"] = (
        f"not decided: difference {lo:+.2%} to {hi:+.2%} includes ±{spec.min_effect:.0%}; "
        f"{need} sessions per arm would decide it at the baseline rate {p_b:.1%}"
    )
    return out


def hypotheses(arms: Sequence[dict[str, Any]], spec: StudySpec) -> list[dict[str, Any]]:
    base_arm = find_arm(arms, spec.baseline)
    rows = []
    for h in spec.hypotheses:
        treat_levels = {**spec.baseline, h.factor: h.treatment}
        treat = find_arm(arms, treat_levels, like=base_arm["factors"] if base_arm else None)
        kb, nb = (base_arm["corrupted"], base_arm["n"]) if base_arm else (0, 0)
        kt, nt = (treat["corrupted"], treat["n"]) if treat else (0, 0)
        p = stats.compare(kb, nb, kt, nt, spec.test)
        diff_ci = stats.newcombe_diff(kt, nt, kb, nb) if nb and nt else None
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
        row.update(judge(kb, nb, kt, nt, p_holm, spec, len(rows)))
        if row["treatment_arm"] is None:
            row["note"] = f"no arm with {row['treatment_label']} and every other factor at baseline was run"
    return rows


# --- throughput ------------------------------------------------------------------------------------


def _samples(runs: Sequence[RunRecord], concurrency: int) -> list[LevelSample]:
    return [lv for r in runs if r.status == "FINISHED" for lv in r.bench if lv.concurrency == concurrency]


def throughput(
    runs: Sequence[RunRecord], arms: Sequence[dict[str, Any]], spec: StudySpec
) -> list[dict[str, Any]]:
    """Each non-baseline arm's tok/s ratio to the baseline arm per level, with a bootstrap interval and
    a throughput verdict: no regression only when every level's lower bound clears the floor and
    neither arm's client self-audit warned."""
    base = find_arm(arms, spec.baseline)
    if base is None:
        return []
    by_sig: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_sig.setdefault(r.signature, []).append(r)
    base_levels = {lv["concurrency"] for lv in base["throughput"]}
    rows = []
    for arm in arms:
        if arm["signature"] == base["signature"] or not arm["throughput"]:
            continue
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
) -> str:
    base = find_arm(arms, spec.baseline)
    if base is None or not base["n"]:
        return "No verdict: the baseline arm has no sessions with an outcome."
    base_txt = f"baseline corruption {base['corrupted']}/{base['n']} ({base['rate']:.1%})"
    implicated = [h for h in hyps if h["verdict"] == "implicated"]
    if base["corrupted"] == 0:
        return (
            f"The baseline arm showed no corruption (0/{base['n']}, upper bound {base['upper_bound']:.1%})."
        )
    if not implicated:
        return f"No hypothesis implicated ({base_txt}); see the inconclusive rows for the sessions needed."
    names = ", ".join(f"{h['id']} ({h['treatment_label']})" for h in implicated)
    text = f"Implicated: {names}; {base_txt}."
    if deploy:
        text += f" Fix: deploy `{deploy['label']}` (throughput: {deploy['throughput_verdict']})."
    return text


def analyse(
    spec: StudySpec, runs: Sequence[RunRecord], context: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """report.json's content. `context` carries what the report quotes verbatim (parent run id,
    overrides); it must itself be deterministic."""
    runs = sorted(runs, key=lambda r: (r.signature, r.repetition, r.run_id))
    arms = pool_arms(runs, spec)
    hyps = hypotheses(arms, spec)
    tput = throughput(runs, arms, spec)
    deploy = choose_deploy(arms, hyps, tput)
    # failed, interrupted, or with errored sessions (a server that died mid-workload): listed with why
    problems = [
        {"arm": a["label"], "signature": a["signature"], **r}
        for a in arms
        for r in a["runs"]
        if r["status"] != "FINISHED" or r["outcomes"] == "partial" or r["errored"]
    ]
    for p in problems:
        if not p["reason"] and p["errored"]:
            p["reason"] = f"{p['errored']} sessions errored (not counted as corruption, not in n)"
    for arm in arms:
        arm["rate"], arm["upper_bound"] = clean_float(arm["rate"]), clean_float(arm["upper_bound"])
    return {
        "schema": 1,
        "study": spec.to_dict(),
        "context": dict(context or {}),
        "headline": headline(spec, arms, hyps, deploy),
        "confidence": stats.CONFIDENCE,
        "arms": arms,
        "hypotheses": hyps,
        "throughput": tput,
        "problem_runs": problems,
        "deploy": deploy,
    }
