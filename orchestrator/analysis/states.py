"""One state per arm per study, the only one: every section of a report reads it, none computes its own.

An arm's state says where its corruption rate stands against the study's ceiling: `clean` (its interval
is wholly under the ceiling), `corrupting` (wholly over it) or `undetermined` (the interval holds it, or
the step-down stopped before it). The interval is the arm's beta-binomial interval from its runs
(`stats.runs_interval`: sessions of one server start share a rate, restart to restart it varies with the
study's ICC). The hypotheses ("implicated": corruption gone, the treatment arm clean), the minimal cause
(corrupting and clean arms), the headline and the fix to deploy all read these states, so the same arm
never gets two states, and arms with the same runs always get the same one.

The study's one multiplicity policy (`StatePolicy`): every state right together with probability >=
1 - alpha. Holm's step-down over the arms with sessions, in order of how clearly each lies off the
ceiling (the two-sided p of its runs at the ceiling, `stats.runs_tails`): a group of arms with the same
p (ties: the same runs) takes one step together, judged at the level of its first place,
1 - alpha/(m - i); each arm of the group is classified when its interval at that level excludes the
ceiling and no earlier group stopped the step-down. Where one fails, it and every later arm stay
undetermined. The state and the bounds shown are the same computation, so a bound under the ceiling is
never shown beside "undetermined" (the old per-section step-downs split ties and showed an arm's bound at
one level while judging it at another). The hypotheses once judged "corruption gone" with each arm's own
95% bound; now they read these states, so an arm called clean there is clean everywhere.

Also here, once: the ICC rule (`study_icc`): the restart-to-restart ICC estimated from runs grouped by
arm, never below the study's `assumed_icc`, and the assumed value alone when nothing can be estimated.

Pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator import stats

STATES = ("corrupting", "clean", "undetermined")

Item = tuple[str, str]  # (factor, level)


def study_icc(groups: Sequence[Sequence[Sequence[int]]], assumed: float) -> stats.Dispersion:
    """The ICC rule: the between-run dispersion of `groups` (each one arm's, or one cell's, runs as
    [corrupted, sessions]), its ICC floored at `assumed`; `assumed` alone (0 degrees of freedom) when no
    group has two runs with corruption to estimate it from."""
    found = stats.dispersion([list(g) for g in groups])
    if found.estimated:
        return stats.Dispersion(found.phi, found.df, max(found.icc, assumed), found.mean_run_size)
    return stats.Dispersion(1.0, 0, assumed, 0.0)


@dataclass(frozen=True)
class StatePolicy:
    """How the study's arm states are judged (module doc): stated once in the report, used by every
    section, headline included."""

    alpha: float
    name: str = "holm"

    @classmethod
    def of(cls, alpha: float) -> StatePolicy:
        return cls(alpha=alpha)

    @property
    def confidence(self) -> float:
        """The confidence that every state is right together."""
        return 1 - self.alpha

    def describe(self, ceiling: float, icc: float, m: int, design: str | None = None) -> str:
        by_design = {
            "sequential": (
                "; a treatment arm whose hypothesis the sequential evidence decided takes that decision "
                "(anytime-valid under the study's looks: implicated is clean, partial is not)"
            ),
            "ddmin": (
                "; an arm the search tried takes its trial's verdict (anytime-valid e-values, the j-th "
                "subset at alpha / (j (j + 1)))"
            ),
        }
        return (
            f"every arm's state against the ceiling {ceiling:.0%} right together with probability >= "
            f"{self.confidence:.0%}: Holm's step-down over the {m} arms with sessions, each arm's "
            f"beta-binomial interval (ICC {icc:.3f}) at {1 - self.alpha / max(1, m):.2%} for the clearest "
            f"up to {self.confidence:.0%} for the last, arms with the same runs judged together; clean: "
            f"wholly under the ceiling, corrupting: wholly over it, else undetermined. Every section reads "
            f"these states"
        ) + by_design.get(design or "", "")

    def to_dict(self, ceiling: float, icc: float, m: int, design: str | None = None) -> dict[str, Any]:
        return {
            "design": design,
            "name": self.name,
            "alpha": self.alpha,
            "confidence": self.confidence,
            "ceiling": ceiling,
            "icc": icc,
            "arms": m,
            "text": self.describe(ceiling, icc, m, design),
        }


@dataclass(frozen=True)
class ArmState:
    """One arm as every section sees it: its levels, its counts, its state against the ceiling."""

    label: str
    signature: str
    factors: dict[str, str]
    corrupted: int
    n: int
    design_effect: float
    state: str
    bounds: tuple[float, float] | None
    # for an undetermined arm, the state its observed rate points to (None without sessions)
    leaning: str | None
    # sessions in all that would likely classify an undetermined arm (None: cannot say)
    sessions_needed: int | None = None
    # the confidence of `bounds` (its Holm step's)
    confidence: float | None = None
    # the arm at which the step-down stopped before this one (its own bounds may then clear the ceiling)
    held_by: str | None = None
    # what judged it: "interval" (the step-down above), "sequential" (a sequential study's anytime-valid
    # decision on the hypothesis this arm is the treatment of), "ddmin" (the search's trial of this subset)
    source: str = "interval"

    @property
    def items(self) -> frozenset[Item]:
        return frozenset(self.factors.items())

    @property
    def rate(self) -> float | None:
        return self.corrupted / self.n if self.n else None

    def counts(self) -> str:
        return f"{self.corrupted}/{self.n}"

    def to_dict(self) -> dict[str, Any]:
        """report.json's `arm_states[]` entry."""
        return {
            "label": self.label,
            "signature": self.signature,
            "factors": dict(self.factors),
            "corrupted": self.corrupted,
            "n": self.n,
            "rate": self.rate,
            "state": self.state,
            "bounds": list(self.bounds) if self.bounds else None,
            "confidence": self.confidence,
            "leaning": self.leaning,
            "sessions_needed": self.sessions_needed,
            "held_by": self.held_by,
            "source": self.source,
        }


def classify(arm: Mapping[str, Any], icc: float, ceiling: float, confidence: float) -> ArmState:
    """An arm's state against the ceiling from its runs' bounds at `confidence` (two-sided)."""
    n, k = int(arm["n"]), int(arm["corrupted"])
    deff = float(arm.get("design_effect") or 1.0)
    common = {
        "label": arm["label"],
        "signature": arm["signature"],
        "factors": dict(arm["factors"]),
        "corrupted": k,
        "n": n,
        "design_effect": deff,
        "confidence": confidence,
    }
    if n == 0:
        return ArmState(**common, state="undetermined", bounds=None, leaning=None)
    lo, hi = stats.runs_interval(arm["run_counts"], icc, confidence)
    if hi < ceiling:
        return ArmState(**common, state="clean", bounds=(lo, hi), leaning="clean")
    if lo > ceiling:
        return ArmState(**common, state="corrupting", bounds=(lo, hi), leaning="corrupting")
    rate = k / n
    per = stats.sessions_to_exclude(rate, ceiling, confidence)
    need = None if per is None else math.ceil(per * deff - 1e-9)
    return ArmState(
        **common,
        state="undetermined",
        bounds=(lo, hi),
        leaning="clean" if rate < ceiling else "corrupting",
        sessions_needed=need,
    )


def state_p(arm: Mapping[str, Any], icc: float, ceiling: float) -> float:
    """The two-sided p of "this arm's rate is the ceiling": the smallest 1 - confidence at which the
    arm's interval (`stats.runs_interval`) excludes the ceiling (1 for an arm without sessions)."""
    if not arm["n"]:
        return 1.0
    low, high = stats.runs_tails(arm["run_counts"], ceiling, icc)
    return min(1.0, 2 * min(low, high))


def step_levels(ps: Sequence[float], alpha: float) -> list[float]:
    """Holm's level per arm (input order), ties taking one step together at their first place's level:
    1 - alpha / (m - i), m the arms with p < 1."""
    m = sum(1 for p in ps if p < 1.0) or 1
    order = sorted(range(len(ps)), key=lambda j: ps[j])
    levels = [1 - alpha / m] * len(ps)
    first = 0
    for place, j in enumerate(order):
        if place and ps[j] != ps[order[place - 1]]:
            first = place
        levels[j] = 1 - alpha / max(1, m - first)
    return levels


def arm_states(
    arms: Sequence[Mapping[str, Any]], icc: float, ceiling: float, policy: StatePolicy
) -> dict[str, ArmState]:
    """signature -> the arm's one state under the study's policy (module doc)."""
    ps = [state_p(a, icc, ceiling) for a in arms]
    levels = step_levels(ps, policy.alpha)
    judged = [classify(a, icc, ceiling, level) for a, level in zip(arms, levels, strict=True)]
    # the step-down: groups in order of p; the first group with an arm its level cannot classify stops it
    out: dict[str, ArmState] = {}
    stopped_at: str | None = None
    for p in sorted(set(ps)):
        group = [i for i, q in enumerate(ps) if q == p]
        for i in group:
            state = judged[i]
            if stopped_at and state.state != "undetermined" and state.n:
                state = dataclasses.replace(
                    state, state="undetermined", leaning=state.state, held_by=stopped_at
                )
            out[arms[i]["signature"]] = state
        failed = [judged[i].label for i in group if judged[i].state == "undetermined"]
        stopped_at = stopped_at or (failed[0] if failed else None)
    return out


def scoped_arms(states: Mapping[str, ArmState]) -> int:
    """The arms with sessions: Holm's m."""
    return sum(1 for s in states.values() if s.n)


# --- the designs whose own tests judge some arms ----------------------------------------------------------


def _judged(state: ArmState, verdict: str, source: str) -> ArmState:
    if verdict == state.state:
        return dataclasses.replace(state, source=source, held_by=None)
    leaning = state.leaning if verdict == "undetermined" else verdict
    return dataclasses.replace(state, state=verdict, leaning=leaning, source=source, held_by=None)


def sequential_states(
    states: Mapping[str, ArmState], decided: Sequence[tuple[str | None, str]]
) -> dict[str, ArmState]:
    """A sequential study's states: each (treatment arm, verdict) its anytime-valid evidence decided, the
    design's test of the ceiling under its looks, replaces the interval's state for that arm: implicated ->
    clean, partial -> not clean (undetermined, unless the interval shows it corrupting)."""
    out = dict(states)
    for signature, verdict in decided:
        state = out.get(signature or "")
        if state is None:
            continue
        if verdict == "implicated":
            out[state.signature] = _judged(state, "clean", "sequential")
        elif verdict == "partial" and state.state == "clean":
            out[state.signature] = _judged(state, "undetermined", "sequential")
    return out


def ddmin_states(
    states: Mapping[str, ArmState], trials: Sequence[Mapping[str, Any]], ids: Sequence[str]
) -> dict[str, ArmState]:
    """A ddmin study's states: each subset the search tried is judged by its own trial (anytime-valid
    e-values at alpha / (j (j + 1)), ddmin.py), the design's multiplicity; the arm that applies exactly that
    subset takes the trial's verdict (undetermined while it has none)."""
    out = dict(states)
    by_subset = {
        frozenset(d for d in ids if state.factors.get(d) == "bad"): signature
        for signature, state in out.items()
    }
    for trial in trials:
        signature = by_subset.get(frozenset(trial["subset"]))
        if signature is not None:
            out[signature] = _judged(out[signature], trial["verdict"] or "undetermined", "ddmin")
    return out
