"""One state per arm per study, the only one: every section of a report reads it, none computes its own.

An arm's state says where its corruption rate stands against the study's ceiling: `clean` (its interval
is wholly under the ceiling), `corrupting` (wholly over it) or `undetermined` (the interval holds it). The
interval is the arm's beta-binomial interval from its runs (`stats.runs_interval`: sessions of one server
start share a rate, restart to restart it varies with the study's ICC). The hypotheses ("implicated":
corruption gone, the treatment arm clean), the minimal cause (its corrupting and clean arms), the arms
table, the headline and the fix to deploy all read these states, so the same arm never gets two states,
and arms with the same runs always get the same one.

The study's one multiplicity policy (`StatePolicy`), stated once in the report: each arm's interval at
the study's confidence, 1 - alpha (95%), the confidence the hypotheses have always judged "corruption
gone" at; the family of comparisons is Holm-adjusted across hypotheses (`stats.holm`), the states are
not adjusted across arms. What the report concludes from several states at once is held to alpha by
rehearsal instead: with every arm at the ceiling (the hardest null), the minimal cause named a
conjunction in 1.4% and 2.8% of 500 studies (restart ICC 0.02 and 0.1) and called it found in 0.0% and
0.6% (tests/test_cause.py). The alternatives were measured and refused: Holm's step-down across arms (the
minimal cause's own, before) split ties and showed one arm at two confidences; any joint family costs
a factor of m in the clean arms' confidence, and took the shipped dsv4 design (four starts) from the
three fixes implicated in 98.6% of rehearsed studies to 74% (Hochberg's step-up) or 60% (Holm), and the
GPU race's 0/120 arms from implicated to partial (orchestrator/report/consistency.py).

A sequential study's anytime-valid decisions and a ddmin search's checks are their designs' own tests of
the ceiling: the arms they decided take those verdicts (`sequential_states`, `ddmin_states`), still one
state each.

The ICC every interval here uses comes from the one ICC rule, `stats.study_icc`.

Pure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from orchestrator.analysis import stats
from orchestrator.analysis.ddmin import STEER
from orchestrator.analysis.result import Arm, ArmStateRow, Policy, State, Trial

STATES = get_args(State)  # corrupting, clean, undetermined

Item = tuple[str, str]  # (factor, level)


@dataclass(frozen=True)
class StatePolicy:
    """How the study's arm states are judged (module doc): stated once in the report, used by every
    section, headline included."""

    alpha: float
    name: str = "per-arm"

    @classmethod
    def of(cls, alpha: float) -> StatePolicy:
        return cls(alpha=alpha)

    @property
    def confidence(self) -> float:
        return 1 - self.alpha

    def describe(self, ceiling: float, icc: float, design: str | None = None) -> str:
        by_design = {
            "sequential": (
                "; a treatment arm whose hypothesis the sequential evidence decided takes that decision "
                "(anytime-valid under the study's looks: implicated is clean, partial is not)"
            ),
            "ddmin": (
                "; an arm the search tried takes its trial's verdict (anytime-valid e-values, each subset "
                "at its planned share of alpha)"
            ),
        }
        return (
            f"each arm's state against the ceiling {ceiling:.0%} is its beta-binomial interval at "
            f"{self.confidence:.0%} (restart ICC {icc:.3f}), one arm at a time: clean when wholly under the "
            f"ceiling, corrupting when wholly over it, else undetermined. Every section reads these states"
        ) + by_design.get(design or "", "")

    def report_row(self, ceiling: float, icc: float, design: str | None = None) -> Policy:
        """report.json's `policy`."""
        return Policy(
            name=self.name,
            design=design,
            alpha=self.alpha,
            confidence=self.confidence,
            ceiling=ceiling,
            icc=icc,
            text=self.describe(ceiling, icc, design),
        )


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
    # the confidence of `bounds` (the policy's)
    confidence: float | None = None
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

    def report_row(self) -> ArmStateRow:
        """report.json's `arm_states[]` entry."""
        return ArmStateRow(
            label=self.label,
            signature=self.signature,
            factors=dict(self.factors),
            corrupted=self.corrupted,
            n=self.n,
            rate=self.rate,
            state=self.state,
            bounds=tuple(self.bounds) if self.bounds else None,
            confidence=self.confidence,
            leaning=self.leaning,
            sessions_needed=self.sessions_needed,
            source=self.source,
        )


def classify(arm: Arm, icc: float, ceiling: float, confidence: float) -> ArmState:
    """An arm's state against the ceiling from its runs' bounds at `confidence` (two-sided)."""
    n, k = arm.n, arm.corrupted
    deff = float(arm.design_effect or 1.0)
    common = {
        "label": arm.label,
        "signature": arm.signature,
        "factors": dict(arm.factors),
        "corrupted": k,
        "n": n,
        "design_effect": deff,
        "confidence": confidence,
    }
    if n == 0:
        return ArmState(**common, state="undetermined", bounds=None, leaning=None)
    lo, hi = stats.runs_interval(arm.run_counts, icc, confidence)
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


def arm_states(arms: Sequence[Arm], icc: float, ceiling: float, policy: StatePolicy) -> dict[str, ArmState]:
    """signature -> the arm's one state under the study's policy (module doc)."""
    return {a.signature: classify(a, icc, ceiling, policy.confidence) for a in arms}


# --- the designs whose own tests judge some arms ----------------------------------------------------------


def _judged(state: ArmState, verdict: str, source: str) -> ArmState:
    if verdict not in STATES:
        verdict = "undetermined"  # a trial still running (no verdict yet)
    leaning = state.leaning if verdict == "undetermined" else verdict
    return dataclasses.replace(state, state=verdict, leaning=leaning, source=source)


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
    states: Mapping[str, ArmState], trials: Sequence[Trial], ids: Sequence[str]
) -> dict[str, ArmState]:
    """A ddmin study's states: each subset the search checked is judged by its own check (anytime-valid
    e-values at its planned share of alpha, ddmin.test_alpha), the design's multiplicity; the arm that
    applies exactly that subset takes its last check's verdict (undetermined while it has none). A
    steering lean is no verdict: a subset only steered keeps the state its runs give it."""
    out = dict(states)
    by_subset = {
        frozenset(d for d in ids if state.factors.get(d) == "bad"): signature
        for signature, state in out.items()
    }
    for trial in ddmin_checks(trials):
        signature = by_subset.get(frozenset(trial.subset))
        if signature is not None:
            out[signature] = _judged(out[signature], trial.verdict or "undetermined", "ddmin")
    return out


def ddmin_checks(trials: Sequence[Trial]) -> list[Trial]:
    """A ddmin search's checks (its trials without the steering's leans), the last one of each subset
    only: what judges the subset's arm."""
    last = {frozenset(t.subset): t for t in trials if t.role != STEER}
    return list(last.values())
