"""Sequential studies (pure): anytime-valid evidence per hypothesis, when to stop, what the next round runs.

A sequential study runs in rounds. Round r starts one more server (repetition r) of every arm whose
hypotheses are still undecided; after each round the evidence is recomputed from every pooled run so
far, and an arm stops as soon as its hypotheses are decided or the budget (`study.stopping`) is spent.

Method: e-values, one per claim, from universal inference (Wasserman, Ramdas & Balakrishnan, PNAS 2020)
on the runs themselves. Why this one:
- **Runs are the blocks.** Each run's count of corrupted sessions is beta-binomial: its rate is the
  arm's mean drawn afresh at each server start, with the study's intra-class correlation rho (the same
  model as `stats`: one rho per study, never below `assumed_icc`). The likelihood of an arm is the
  product over its runs, so restart-to-restart variation is part of the evidence, not averaged away.
- **Anytime valid.** For a claim whose null is a set H0 of (baseline mean, treatment mean), the e-value
  is E = mixture likelihood / sup over H0 of the likelihood. The numerator, a fixed prior mixture over
  the alternative, divided by the likelihood at any one null point is a non-negative martingale over
  runs with mean 1; the sup in the denominator only makes E smaller. By Ville's inequality
  P(E ever reaches 1/a) <= a under H0, however many looks are taken and whatever the stopping rule,
  so stopping early, resuming, or extending the budget later keeps the guarantee: the e-value is a
  function of all the runs, recomputed at every look.
- **Exact nulls, no asymptotics.** The log-likelihood of a beta-binomial run is concave in its mean at
  fixed rho, so the sup over each (convex) null is at the unconstrained maximum or on the null's
  boundary, a one-dimensional search on a fine grid.

Claims, per hypothesis (baseline mean b, treatment mean t, ceiling c, margin d):
- `reduction`: H0 t >= b, tested on the rounds both arms ran (`paired_reduction`): given a round's
  corrupted sessions in both arms, the treatment's share depends on the ratio t / b alone, so the
  baseline's rate is conditioned away instead of paid for by a sup (what made a moderate effect cost
  about twice a fixed test's sessions before). `increase`: H0 t <= b.
- `equivalence`: H0 t >= (1 + d) b or t <= (1 - d) b (relative margin, the default; `min_effect`
  absolute: t >= b + d or t <= b - d); intersection-union, E = the smaller of the two one-sided e-values.
- `under`: H0 t >= c (corruption gone: under the ceiling). `over`: H0 t <= c (corruption remains).

Error control. The comparison claims (reduction, increase, equivalence) are closed across the H
hypotheses (`closed`, e-Holm: a claim stands when the mean e-value of every set of hypotheses holding it
reaches 1 / alpha; the mean of e-processes is an e-process for their intersection), so each kind of
comparison claim has family-wise error at most alpha at every look, under any dependence between the
hypotheses (they share the baseline): false implication (a reduction claimed where there is none) and
false exoneration are each at most alpha. Once the clear hypotheses are settled, the rest are tested at
about alpha, not alpha / H. The ceiling claims are per-arm bounds at level alpha, as the fixed design's
95% upper bound is (E >= 1 / alpha).

Priors (any fixed prior keeps the guarantee; these decide the power): rates log-uniform (MIX_GRID); for
the comparisons the baseline at least half the ceiling (a baseline under it is no bug to hunt) and the
treatment within a factor RATIO_SPAN of it; for "under", half the weight on the treatment's rate being ~0
(GONE: the alternative that matters most, the change removed the bug). The reduction's prior is over the
ratio t / b (REDUCTION_WEIGHTS): most of it on the study's design effect (t / b = 1 - min_effect), some on
"removed" and a little spread, so a moderate effect costs close to a Wald SPRT aimed at it
(`python -m orchestrator.study.rehearse` shows it per design; bench/gpu_time_floor.py the floors).

Verdicts, at each look, for a hypothesis not yet decided:
- implicated: reduction and under; partial: reduction and over (corruption remains above the ceiling);
- exonerated: equivalence; inconclusive: increase (the change made it worse);
- when the treatment arm's budget is spent: partial if the reduction is shown (the ceiling undecided),
  else inconclusive;
- futility (`stopping.futility`, on by default): an arm stops as soon as no verdict can be reached
  within its budget at twice the pace its evidence has grown so far (then as when the budget is
  spent; a reduction on its way counts, since "partial" is a verdict), or once its reduction's log
  e-value falls to Wald's acceptance boundary ln(beta / (1 - alpha)) at power 0.8
  (REDUCTION_OUT_OF_REACH). Stopping early for futility can only make a study say less, never raise its
  error;
- nothing is decided before `stopping.min_runs_per_arm` rounds (default 1).

rho is the study's plug-in estimate at each look (`analysis.between_runs`), as in the fixed design: the
guarantee is exact for a known rho and approximate with an estimated one. An arm with a single start
cannot show how much starts vary, so a hypothesis with such an arm is judged at an upper confidence
bound of the study's ICC (`icc_upper_bound`, at `stopping.icc_confidence`, 0.8) from the arms with two
starts or more (the model has one ICC per study), and is not judged at all while no arm has shown any
between-start variation. `python -m orchestrator.study.rehearse ... hydra.sweeper.design=sequential`
measures the family-wise error with rho estimated as it is here, with sized and killed runs.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import special
from scipy.stats import chi2

from orchestrator.analysis import result
from orchestrator.analysis.stats import (
    ICC_CEILING,
    beta_binomial_kernel,
    beta_shape,
    design_effect,
    dispersion,
    study_icc,
)
from orchestrator.config.plan import BASELINE_LABEL, arm_label

CLAIMS = ("reduction", "increase", "equivalence", "under", "over")
COMPARISONS = ("reduction", "increase", "equivalence")  # the claims closed testing runs across hypotheses
LOG_E_FLOOR = -50.0
RATIO_SPAN = 100.0
# futility: a claim is out of reach when twice its pace so far would not carry it over its threshold
FUTILITY_OPTIMISM = 2.0
# the mixture prior: log-uniform over rates (a heisenbug's rate is as likely 0.1% as 10%)
MIX_GRID = np.unique(np.concatenate([np.geomspace(1e-4, 0.5, 64), np.linspace(0.55, 0.99, 10)]))
# the null sups: fine enough that the grid maximum is the true one to well under 0.01 in log
# (1.6% apart in log rate below 0.3: the sup it misses is under 1e-4 k in log, k corrupted sessions)
FINE_GRID = np.unique(np.concatenate([np.geomspace(1e-6, 0.3, 800), np.linspace(0.3, 1 - 1e-6, 300)]))
# the ICC is rounded up to this step, so the likelihoods of repeated run counts are computed once
ICC_STEP = 1e-3
# the confidence of the ICC's upper bound at which an arm with a single start is judged
ICC_CONFIDENCE = 0.8

# the prior of "under" puts GONE_WEIGHT on the treatment's rate being ~0 (the alternative that matters
# most: the change removed the bug), the rest spread as above
GONE = 1e-6
GONE_WEIGHT = 0.5
# Wald's acceptance boundary for the reduction, ln(beta / (1 - alpha)) at power 0.8 and alpha 0.05: a
# reduction whose log e-value has fallen this low has lost its race (futility); stopping there costs at
# most the power it was designed for, never the level
REDUCTION_OUT_OF_REACH = math.log(0.2 / 0.95)
GRIDS = {"mix": MIX_GRID, "fine": FINE_GRID, "point": np.array([1.0])}  # ("point", p, 0): the rate p
Runs = Sequence[Sequence[int]]  # [[corrupted, sessions], ...] per run


def floored_log_e(value: float) -> float:
    """A claim's log e-value as traces and reports keep it: floored at LOG_E_FLOOR, where the e-value is
    nil for any purpose, so traces stay finite numbers. A NaN (a likelihood that could not be evaluated)
    is no evidence either way, 0, and a warning: flooring it would read as "decisively against"."""
    if math.isnan(value):
        warnings.warn(
            "a log e-value could not be computed (NaN): counted as no evidence", RuntimeWarning, stacklevel=2
        )
        return 0.0
    return max(LOG_E_FLOOR, value)


def round_icc(icc: float) -> float:
    """The ICC the likelihoods use: rounded up to ICC_STEP (more between-run variation: weaker evidence),
    at most ICC_CEILING (an arm with one start is judged at a bound on the study's ICC, which reaches 1
    when the runs vary as much as they can)."""
    return min(math.ceil(icc / ICC_STEP - 1e-9) * ICC_STEP, ICC_CEILING) if icc > 0 else 0.0


# a grid: its name, or (name, scale, shift) for name * scale + shift
GridKey = str | tuple[str, float, float]


@functools.lru_cache(maxsize=64)
def grid(key: GridKey) -> np.ndarray:
    if isinstance(key, str):
        return GRIDS[key]
    name, scale, shift = key
    return GRIDS[name] * scale + shift


@functools.lru_cache(maxsize=256)
def _grid_terms(key: GridKey, icc: float) -> tuple[np.ndarray, ...]:
    """What a grid's likelihood needs that no count changes: the rates outside (0, 1), and log p and
    log(1 - p) (binomial) or a, b and betaln(a, b) of each rate's Beta (beta-binomial)."""
    p = grid(key)
    outside = (p <= 0) | (p >= 1)
    p = np.clip(p, 1e-12, 1 - 1e-12)
    if icc <= 0:
        return outside, np.log(p), np.log1p(-p)
    a, b = beta_shape(p, icc)
    return outside, a, b, special.betaln(a, b)


@functools.lru_cache(maxsize=65536)
def _grid_loglik(k: int, n: int, key: GridKey, icc: float) -> np.ndarray:
    outside, *terms = _grid_terms(key, icc)
    if icc <= 0:
        log_p, log_q = terms
        out = k * log_p + (n - k) * log_q
    else:
        out = beta_binomial_kernel(k, n, *terms)
    return np.where(outside, -np.inf, out)


def run_loglik(runs: Runs, key: GridKey, icc: float) -> np.ndarray:
    """Log-likelihood of an arm's runs at each mean rate of the grid `key` (a one-point grid for a single
    rate): beta-binomial with ICC `icc` per run (binomial at 0), without the binomial coefficients (they
    cancel in every ratio here). Rates outside (0, 1) get -inf."""
    icc = round_icc(icc)
    total = np.zeros(len(grid(key)))
    for k, n in runs:
        total = total + _grid_loglik(int(k), int(n), key, icc)
    return total


@dataclass(frozen=True)
class Evidence:
    """Log e-values of one hypothesis' claims (below 0: the data lean the other way; log(1 / alpha), after
    `closed` for the comparisons, decides a claim)."""

    reduction: float = 0.0
    increase: float = 0.0
    equivalence: float = 0.0
    under: float = 0.0
    over: float = 0.0
    # not a claim: the nats a round adds to the reduction's log e-value on average at the effect seen so
    # far, or the design effect where that is larger (`reduction_pace`): what futility projects it by
    reduction_pace: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {c: round(float(getattr(self, c)), 4) for c in CLAIMS}


def _mix(values: np.ndarray, mask: np.ndarray, gone: np.ndarray | None = None) -> float:
    """Log of the prior mixture of likelihoods exp(values): uniform over the masked grid points, or,
    with `gone` (the likelihoods with the treatment's rate at ~0, where the mask allows it), half the
    prior on "the change removed it" and half uniform."""
    chosen = values[mask]
    if not chosen.size:
        return -math.inf
    with_gone = gone is not None and gone.size > 0
    top = max(float(chosen.max()), float(gone.max()) if with_gone else -math.inf)
    if top == -math.inf:  # no rate explains the runs (exp(-inf - -inf) would be NaN)
        return -math.inf
    spread = float(np.exp(chosen - top).sum()) / chosen.size
    if not with_gone:
        return top + math.log(spread)
    w = GONE_WEIGHT
    return top + math.log((1 - w) * spread + w * float(np.exp(gone - top).sum()) / gone.size)


def _pair_mix(pair: np.ndarray, allowed: np.ndarray, rows: np.ndarray) -> float:
    """Log of the prior mixture over (baseline b, treatment t) of likelihoods exp(pair[b, t]): b uniform
    over the grid's `rows`, t given b uniform over the row's `allowed` points."""
    counts = allowed.sum(axis=1)
    use = rows & (counts > 0)
    if not use.any():
        return -math.inf
    masked = np.where(allowed, pair, -np.inf)[use]
    top = masked.max(axis=1, keepdims=True)
    # a row no treatment rate explains is 0 in the mixture, not NaN (exp(-inf - -inf))
    explained = np.isfinite(top[:, 0])
    if not explained.any():
        return -math.inf
    masked, top, counts = masked[explained], top[explained], counts[use][explained]
    row = top[:, 0] + np.log(np.exp(masked - top).sum(axis=1) / counts)
    high = float(row.max())
    # the prior's weight is over every used row, the unexplained ones included
    return high + math.log(float(np.exp(row - high).sum()) / explained.size)


# the reduction's prior over the rate ratio psi = treatment / baseline (`paired_reduction`): weights on
# "the change removed it" (psi ~ 0), on the design effect (psi = 1 - study.min_effect, relative; 0.5 for
# an absolute min_effect), and spread log-uniform over (1 / RATIO_SPAN, 1)
REDUCTION_WEIGHTS = {"gone": 0.2, "design": 0.7, "spread": 0.1}
RATIO_GRID = np.geomspace(1 / RATIO_SPAN, 0.99, 48)


def effective(k: float, n: float, icc: float) -> tuple[float, float]:
    """A run's counts as independent sessions at ICC `icc` (Rao-Scott: both divided by the design
    effect)."""
    deff = design_effect(icc, n)
    return k / deff, n / deff


def paired_reduction(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], icc: float, relative_margin: float | None
) -> float:
    """Log e-value of "the treatment's rate is below the baseline's" (null: psi = t / b >= 1) from the
    rounds both arms ran: in each round, given the round's corrupted sessions in both arms (effective
    counts at ICC `icc`), the treatment's share is binomial with p(psi) = n_t psi / (n_b + n_t psi); a
    round's likelihood ratio at psi < 1 against psi = 1 has mean 1 at psi = 1 and less above it, given the
    past, so their product over rounds, mixed over psi by a fixed prior (REDUCTION_WEIGHTS), is a test
    supermartingale under the whole null: valid at every look (the nuisance, the baseline's own rate,
    is conditioned away, not paid for). Effective counts make it approximate where the ICC is
    estimated; the rehearsal measures its size (null models at ICC up to 0.1)."""
    psis = np.concatenate([[GONE, _design_ratio(relative_margin)], RATIO_GRID])
    total = np.zeros(len(psis))
    for xb, mb, xt, mt in _effective_rounds(pairs, icc):
        share, null = _share(mb, mt, psis), _share(mb, mt, 1.0)
        total += xt * np.log(share / null) + xb * np.log((1 - share) / (1 - null))
    w = REDUCTION_WEIGHTS
    weights = np.concatenate(
        [[w["gone"], w["design"]], np.full(len(RATIO_GRID), w["spread"] / len(RATIO_GRID))]
    )
    top = float(total.max())
    return floored_log_e(top + math.log(float(np.sum(weights * np.exp(total - top)))))


def _design_ratio(relative_margin: float | None) -> float:
    return 1 - relative_margin if relative_margin is not None and 0 < relative_margin < 1 else 0.5


def _share(mb: float, mt: float, psi: Any) -> Any:
    """The treatment's expected share of a round's corrupted sessions at rate ratio `psi`, given the
    arms' (effective) sessions."""
    return mt * psi / (mb + mt * psi)


def _effective_rounds(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], icc: float
) -> list[tuple[float, float, float, float]]:
    """Each round's effective counts (xb, mb, xt, mt), the rounds with no information left out (an arm
    without sessions, or no corrupted session in either)."""
    rounds = []
    for (kb, nb), (kt, nt) in pairs:
        if nb <= 0 or nt <= 0:
            continue
        (xb, mb), (xt, mt) = effective(kb, nb, icc), effective(kt, nt, icc)
        if xb + xt > 0:
            rounds.append((xb, mb, xt, mt))
    return rounds


def reduction_pace(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], icc: float, relative_margin: float | None
) -> float:
    """What a round adds to the reduction's log e-value on average were the effect the larger of the one
    seen so far and the design effect (the treatment's rate relative to the baseline's, from the rounds'
    effective counts, never above 1 - min_effect): a round's effective corrupted sessions times the
    Kullback-Leibler divergence of the treatment's share at that effect from its share at none, averaged
    over the rounds so far (0 before any)."""
    rounds = _effective_rounds(pairs, icc)
    if not rounds:
        return 0.0
    seen = sum(xt for _, _, xt, _ in rounds) * sum(mb for _, mb, _, _ in rounds)
    seen /= max(sum(xb for xb, _, _, _ in rounds) * sum(mt for _, _, _, mt in rounds), 1e-12)
    psi = min(max(seen, GONE), _design_ratio(relative_margin))
    paces = []
    for xb, mb, xt, mt in rounds:
        p, null = _share(mb, mt, psi), _share(mb, mt, 1.0)
        paces.append((xb + xt) * (p * math.log(p / null) + (1 - p) * math.log((1 - p) / (1 - null))))
    return float(np.mean(paces))


def _boundary_sup(l_base: np.ndarray, treat_runs: Runs, icc: float, scale: float, shift: float) -> float:
    """max over b of l_base(b) + l_treat(b * scale + shift): the sup on a null's boundary."""
    return float(np.max(l_base + run_loglik(treat_runs, ("fine", scale, shift), icc)))


def evidence(
    base_runs: Runs,
    treat_runs: Runs,
    icc: float,
    ceiling: float,
    margin: float,
    relative: bool = True,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
) -> Evidence:
    """The log e-values of every claim (module doc) from the two arms' per-run counts. `pairs`: the
    (baseline, treatment) runs of the same round, which the reduction compares (default: the runs in
    order, pair by pair)."""
    if pairs is None:
        pairs = list(zip(base_runs, treat_runs, strict=False))  # runs in order, as many as both have
    key = (tuple(map(tuple, base_runs)), tuple(map(tuple, treat_runs)), round_icc(icc))
    paired = tuple((tuple(b), tuple(t)) for b, t in pairs)
    return _evidence(*key, float(ceiling), float(margin), bool(relative), paired)


@functools.lru_cache(maxsize=16384)
def _evidence(
    base_runs: tuple,
    treat_runs: tuple,
    icc: float,
    ceiling: float,
    margin: float,
    relative: bool,
    pairs: tuple = (),
) -> Evidence:
    if not treat_runs:
        return Evidence()
    lt_f = run_loglik(treat_runs, "fine", icc)
    t_max, t_hat = float(lt_f.max()), float(FINE_GRID[lt_f.argmax()])
    lt_m = run_loglik(treat_runs, "mix", icc)
    lt_c = float(run_loglik(treat_runs, ("point", ceiling, 0.0), icc)[0])
    lt_0 = run_loglik(treat_runs, ("point", GONE, 0.0), icc)
    under = _mix(lt_m, ceiling > MIX_GRID, lt_0) - (t_max if t_hat >= ceiling else lt_c)
    over = _mix(lt_m, ceiling < MIX_GRID) - (t_max if t_hat <= ceiling else lt_c)
    if not base_runs:
        return Evidence(under=max(under, 0.0), over=max(over, 0.0))
    lb_f = run_loglik(base_runs, "fine", icc)
    b_max, b_hat = float(lb_f.max()), float(FINE_GRID[lb_f.argmax()])
    lb_m = run_loglik(base_runs, "mix", icc)
    pair = lb_m[:, None] + lt_m[None, :]  # [baseline, treatment]
    b_grid, t_grid = MIX_GRID[:, None], MIX_GRID[None, :]
    equal = float(np.max(lb_f + lt_f))  # the sup on t = b
    free = b_max + t_max
    # the prior of the comparisons: a baseline worth hunting (at least half the ceiling), and the
    # treatment within a factor RATIO_SPAN of it, log-uniform (the effect's size is what is unknown)
    rows = ceiling / 2 <= MIX_GRID
    higher = (t_grid > b_grid) & (t_grid < b_grid * RATIO_SPAN)
    reduction = paired_reduction(pairs, icc, margin if relative else None)
    increase = _pair_mix(pair, higher, rows) - (free if t_hat <= b_hat else equal)
    # the null boundaries t = b * scale + shift, above and below the margin
    hi, lo = ((1 + margin, 0.0), (1 - margin, 0.0)) if relative else ((1.0, margin), (1.0, -margin))
    within = (t_grid < b_grid * hi[0] + hi[1]) & (t_grid > b_grid * lo[0] + lo[1])
    near = _pair_mix(pair, within, rows)
    above = free if t_hat >= b_hat * hi[0] + hi[1] else _boundary_sup(lb_f, treat_runs, icc, *hi)
    below = free if t_hat <= b_hat * lo[0] + lo[1] else _boundary_sup(lb_f, treat_runs, icc, *lo)
    equivalence = min(near - above, near - below) if margin > 0 else -math.inf
    # the log e-values as they are (below 0: the data lean the other way), floored (`floored_log_e`)
    pace = reduction_pace(pairs, icc, margin if relative else None)
    claims = (floored_log_e(x) for x in (reduction, increase, equivalence, under, over))
    return Evidence(*claims, reduction_pace=pace)


def _prefix_log_mean_exps(logs: Sequence[float]) -> list[float]:
    """log(mean(exp(logs[:k]))) for k = 1..len(logs), in one pass (a running log-sum-exp, rescaled to
    the largest value so far, so no term under- or overflows)."""
    out, top, scaled = [], -math.inf, 0.0
    for k, x in enumerate(logs, start=1):
        if x > top:
            scaled, top = scaled * math.exp(top - x) + 1.0, x
        else:
            scaled += math.exp(x - top)
        out.append(top + math.log(scaled / k))
    return out


def closed(evidences: Mapping[str, Evidence]) -> dict[str, Evidence]:
    """The comparison claims after closed testing across the hypotheses (e-Holm): a claim of hypothesis
    i stands only if, for every set I of hypotheses containing i, the mean of I's e-values for that claim
    reaches 1 / alpha; the smallest such mean is reported as i's closed e-value. The mean of e-processes
    is an e-process for their intersection, so this controls the family-wise error of each claim at alpha
    under any dependence (the arms share the baseline), at every look (Vovk & Wang 2021, e-closure)."""
    out = {h: dict(ev.as_dict()) for h, ev in evidences.items()}
    for claim in COMPARISONS:
        values = {h: float(getattr(ev, claim)) for h, ev in evidences.items()}
        for h, own in values.items():
            others = sorted(v for k, v in values.items() if k != h)
            # the sets containing h whose mean is smallest: h with its k weakest companions, each k
            out[h][claim] = min(_prefix_log_mean_exps([own, *others]))
    return {h: Evidence(**values, reduction_pace=evidences[h].reduction_pace) for h, values in out.items()}


# --- decisions --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Thresholds:
    """log(1 / alpha): for the closed comparison e-values (`closed`) and for the per-arm ceiling bounds."""

    comparison: float
    ceiling: float

    @classmethod
    def of(cls, alpha: float) -> Thresholds:
        return cls(math.log(1 / alpha), math.log(1 / alpha))


@dataclass(frozen=True)
class Decision:
    verdict: str | None  # None: undecided, keep running
    reason: str
    # whether the baseline is still needed by this hypothesis (its comparison is undecided)
    needs_baseline: bool = False


def reachable(ev: Evidence, th: Thresholds, rounds_done: int, max_runs: int) -> bool:
    """Whether some verdict's claims could still reach their thresholds within the budget. A reduction
    not yet shown is in reach while its log e-value is above Wald's acceptance boundary
    (REDUCTION_OUT_OF_REACH: its likelihood ratio at the design effect is then as small as an SPRT of
    power 0.8 would accept the null at) and could reach its threshold in the rounds left at
    FUTILITY_OPTIMISM times the pace the effect seen so far would give it, or the design effect where
    the effect seen is smaller (`reduction_pace`: a round's worth depends on how many sessions it sees
    corrupted, few on a low rate); the other claims project their log e-value's growth so far forward
    at FUTILITY_OPTIMISM times its pace (a log e-value grows about linearly with the runs when its
    alternative holds). Once the reduction is shown, "partial" is in hand, and the arm goes on only
    while its ceiling could still settle."""
    scale = FUTILITY_OPTIMISM * max_runs / max(1, rounds_done)
    p = {c: max(0.0, getattr(ev, c)) * scale for c in CLAIMS}
    ceiling_settles = p["under"] >= th.ceiling or p["over"] >= th.ceiling
    if ev.reduction >= th.comparison:
        return ceiling_settles
    ahead = FUTILITY_OPTIMISM * ev.reduction_pace * max(0, max_runs - rounds_done)
    return bool(
        (ev.reduction > REDUCTION_OUT_OF_REACH and ev.reduction + ahead >= th.comparison)
        or p["equivalence"] >= th.comparison
        or p["increase"] >= th.comparison
    )


def decide(
    ev: Evidence,
    th: Thresholds,
    budget_spent: bool,
    has_data: bool = True,
    futile: bool = False,
) -> Decision:
    """The verdict the evidence supports now (module doc), or None to go on. `futile`: no verdict can
    be reached within the budget (`reachable`), so the budget counts as spent."""
    reduced = ev.reduction >= th.comparison
    if reduced and ev.under >= th.ceiling:
        return Decision("implicated", "reduction shown and the treatment's rate is under the ceiling")
    if reduced and ev.over >= th.ceiling:
        return Decision("partial", "reduction shown, but the treatment's rate is above the ceiling")
    if ev.equivalence >= th.comparison:
        return Decision("exonerated", "the rates are equal within the margin")
    if ev.increase >= th.comparison:
        return Decision("inconclusive", "the change raised the rate")
    if budget_spent or futile:
        out_of = "the budget ran out" if budget_spent else "the budget cannot settle it (futility)"
        if reduced:
            return Decision("partial", f"reduction shown; {out_of} before the ceiling was settled")
        why = f"{out_of} before the evidence decided" if has_data else "no runs with an outcome"
        return Decision("inconclusive", why)
    comparison_open = not reduced
    return Decision(None, "undecided", needs_baseline=comparison_open)


# --- rounds -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmRuns:
    """One arm's pooled runs so far, by repetition (round), and the repetitions it has started."""

    label: str
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)  # repetition -> (corrupted, n)
    started: frozenset[int] = frozenset()  # every repetition with a run, pooled or not
    benched: bool = False

    def upto(self, round_index: int) -> list[tuple[int, int]]:
        return [c for r, c in sorted(self.counts.items()) if r <= round_index]


def paired_runs(base: ArmRuns, treat: ArmRuns, round_index: int) -> list[tuple[tuple[int, int], ...]]:
    """The rounds <= round_index in which both arms have a pooled run: (baseline's, treatment's)."""
    return [
        (base.counts[r], treat.counts[r])
        for r in sorted(base.counts)
        if r <= round_index and r in treat.counts
    ]


@dataclass(frozen=True)
class Look:
    """The study after one round: per hypothesis its evidence and decision."""

    round: int
    icc: float
    evidence: dict[str, Evidence]
    decisions: dict[str, Decision]
    arms_run: tuple[str, ...]
    sessions: int

    def as_result(self) -> result.Look:
        """This look as report.json's trace row."""
        return result.Look(
            round=self.round,
            icc=self.icc,
            arms_run=tuple(self.arms_run),
            sessions=self.sessions,
            hypotheses={
                h: result.LookRow(result.Evidence(**self.evidence[h].as_dict()), d.verdict, d.reason)
                for h, d in self.decisions.items()
            },
        )


@dataclass(frozen=True)
class HypothesisArms:
    """A hypothesis as the sequential design sees it: its id and its two arms' labels."""

    id: str
    baseline: str
    treatment: str


def look(
    hyps: Sequence[HypothesisArms],
    arms: Mapping[str, ArmRuns],
    round_index: int,
    icc: float,
    th: Thresholds,
    settings: Any,
    decided: Mapping[str, Decision] | None = None,
    icc_bound: float | None = None,
) -> Look:
    """Judge every hypothesis on the runs of rounds <= round_index. `decided`: decisions of earlier
    looks (a decided hypothesis keeps its verdict). `settings`: the study (its ceiling, min_effect,
    min_effect_relative and stopping.max_runs_per_arm)."""
    decided = dict(decided or {})
    evidences, decisions = {}, {}
    max_runs = int(settings.stopping.max_runs_per_arm)
    early = round_index + 1 < int(settings.stopping.min_runs_per_arm)
    has_data, unbounded = {}, set()
    for h in hyps:
        base_arm = arms.get(h.baseline, ArmRuns(h.baseline))
        treat_arm = arms.get(h.treatment, ArmRuns(h.treatment))
        base, treat = base_arm.upto(round_index), treat_arm.upto(round_index)
        has_data[h.id] = bool(base) and bool(treat)
        # an arm with one start is judged at the study ICC's upper bound (`icc_upper_bound`), and not
        # at all while nothing bounds it
        single = len(base) < 2 or len(treat) < 2
        if single and icc_bound is None:
            unbounded.add(h.id)
        evidences[h.id] = evidence(
            base,
            treat,
            max(icc, icc_bound) if single and icc_bound is not None else icc,
            settings.ceiling,
            settings.min_effect,
            bool(settings.min_effect_relative),
            pairs=paired_runs(base_arm, treat_arm, round_index),
        )
    evidences = closed(evidences)
    for h in hyps:
        ev = evidences[h.id]
        if h.id in decided and decided[h.id].verdict is not None:
            decisions[h.id] = decided[h.id]
            continue
        if early:
            decisions[h.id] = Decision(None, "fewer runs than study.stopping.min_runs_per_arm", True)
            continue
        if h.id in unbounded and round_index + 1 < max_runs:
            why = "one start, and no arm has yet shown how much starts vary (the ICC)"
            decisions[h.id] = Decision(None, why, True)
            continue
        spent = round_index + 1 >= max_runs
        futile = bool(settings.stopping.futility) and not reachable(ev, th, round_index + 1, max_runs)
        decisions[h.id] = decide(ev, th, spent, has_data[h.id], futile)
    run_here = tuple(sorted(a.label for a in arms.values() if round_index in a.counts))
    sessions = sum(n for a in arms.values() for r, (_, n) in a.counts.items() if r == round_index)
    return Look(round_index, icc, evidences, decisions, run_here, sessions)


def arms_to_run(hyps: Sequence[HypothesisArms], latest: Look | None, baseline: str) -> list[str]:
    """The arms the next round starts: every undecided hypothesis' treatment, and the baseline while a
    comparison is open (before the first look: every arm)."""
    if latest is None:
        return [baseline, *sorted({h.treatment for h in hyps} - {baseline})]
    wanted: set[str] = set()
    for h in hyps:
        d = latest.decisions[h.id]
        if d.verdict is None:
            wanted.add(h.treatment)
            if d.needs_baseline:
                wanted.add(h.baseline)
    return sorted(wanted, key=lambda label: (label != baseline, label))


def bench_arms(
    hyps: Sequence[HypothesisArms], latest: Look | None, arms: Mapping[str, ArmRuns], baseline: str
) -> set[str]:
    """Which arms of the next round carry the throughput sweep: each candidate fix (its reduction
    evidence already favours it) once, and the baseline in the same round as the first candidate, so the
    ratio compares sweeps run side by side. None before the first look: nothing is a candidate yet."""
    if latest is None:
        return set()
    candidates = {
        h.treatment
        for h in hyps
        if latest.evidence[h.id].reduction > 0 and not arms.get(h.treatment, ArmRuns(h.treatment)).benched
    }
    if candidates and not arms.get(baseline, ArmRuns(baseline)).benched:
        candidates.add(baseline)
    return candidates


def _icc_confidence(spec: Any) -> float:
    return float(getattr(spec.stopping, "icc_confidence", ICC_CONFIDENCE))


def plug_in_icc(arm_runs: Sequence[Sequence[Sequence[int]]], assumed: float) -> float:
    """The study's ICC from its arms' runs (as `analysis.between_runs` estimates it for a whole study),
    never below `assumed`: the ICC the e-values use at a look."""
    return study_icc(arm_runs, assumed).icc


def icc_at(arms: Mapping[str, ArmRuns], round_index: int, assumed: float) -> float:
    """`plug_in_icc` on the runs of rounds <= round_index."""
    return plug_in_icc([a.upto(round_index) for a in arms.values()], assumed)


def icc_upper_bound(
    arm_runs: Sequence[Sequence[Sequence[int]]], assumed: float, confidence: float
) -> float | None:
    """An upper confidence bound on the study's ICC, from the arms with two runs or more (Pearson's X^2
    over df is about phi chi^2_df / df, phi = 1 + (m - 1) rho: the bound puts X^2 at the chi-square's
    lower 1 - `confidence` quantile), never below `assumed`; None while no arm shows any between-run
    variation to bound it by (df 0). What an arm with a single start is judged at: its own run cannot
    show how much starts vary, so it borrows the study's ICC with that estimate's uncertainty."""
    found = dispersion([list(g) for g in arm_runs])
    if not found.estimated:
        return None
    phi_upper = found.phi * found.df / float(chi2.ppf(1 - confidence, found.df))
    m = found.mean_run_size
    bound = (phi_upper - 1) / (m - 1) if m > 1 else 0.0
    return min(1.0, max(bound, assumed, 0.0))


def trace(spec: Any, hyps: Sequence[HypothesisArms], arms: Mapping[str, ArmRuns]) -> list[Look]:
    """Every look of the study so far, one per round with a run, recomputed from the runs alone (so a
    resumed or extended study has the same trace as one never interrupted)."""
    rounds = sorted({r for a in arms.values() for r in a.started})
    th = Thresholds.of(spec.alpha)
    # the whole study as its text: a look's key holds every setting `look` may read, now or later
    settings = repr(spec)
    looks: list[Look] = []
    decided: dict[str, Decision] = {}
    for r in rounds:
        key = (settings, tuple(hyps), r, _runs_upto(arms, r))
        current = _LOOKS.get(key)
        if current is None:
            icc = icc_at(arms, r, float(spec.assumed_icc))
            bound = icc_upper_bound(
                [a.upto(r) for a in arms.values()], float(spec.assumed_icc), _icc_confidence(spec)
            )
            current = look(hyps, arms, r, icc, th, spec, decided, icc_bound=bound)
            _remember(key, current)
        decided = {h: d for h, d in current.decisions.items() if d.verdict is not None}
        looks.append(current)
    return looks


# A look is a pure function of the study and the runs of rounds <= its own (the decisions it inherits
# come from the looks before it, on fewer of those runs), so one already taken is taken again only from
# that: the sweeper and the rehearsal ask for the whole trace at every round, and a study's earlier looks
# then cost nothing (300 rehearsed seed-story studies: 5.25 -> 4.80 CPU-s; the rest is their analysis).
_LOOKS: dict[tuple, Look] = {}
_LOOKS_KEPT = 4096


def _remember(key: tuple, taken: Look) -> None:
    if len(_LOOKS) >= _LOOKS_KEPT:
        _LOOKS.pop(next(iter(_LOOKS)))  # the oldest: dicts keep their insertion order
    _LOOKS[key] = taken


def _runs_upto(arms: Mapping[str, ArmRuns], round_index: int) -> tuple:
    """Each arm's runs and started rounds up to `round_index`, as a key."""
    return tuple(
        (
            label,
            tuple((r, c) for r, c in sorted(a.counts.items()) if r <= round_index),
            tuple(sorted(r for r in a.started if r <= round_index)),
        )
        for label, a in sorted(arms.items())
    )


@dataclass(frozen=True)
class NextRound:
    """What the sweeper does next: `arms` to start at repetition `round` (empty: the study is over),
    which of them carry the throughput sweep, and why it stops."""

    round: int
    arms: list[str]
    bench: set[str]
    stop_reason: str = ""


def next_round(
    spec: Any,
    hyps: Sequence[HypothesisArms],
    arms: Mapping[str, ArmRuns],
    baseline: str,
    sessions_per_run: int,
) -> tuple[list[Look], NextRound]:
    """The trace so far and the next round (pure: the sweeper and the rehearsal both call it)."""
    looks = trace(spec, hyps, arms)
    latest = looks[-1] if looks else None
    r = (latest.round + 1) if latest else 0
    stopping = spec.stopping
    wanted = arms_to_run(hyps, latest, baseline)
    if not wanted:
        return looks, NextRound(r, [], set(), "every hypothesis is decided")
    if r >= int(stopping.max_runs_per_arm):
        return looks, NextRound(r, [], set(), f"budget spent: {stopping.max_runs_per_arm} runs per arm")
    spent = sum(n for a in arms.values() for _, n in a.counts.values())
    cap = stopping.max_sessions
    if cap is not None and spent + len(wanted) * sessions_per_run > int(cap):
        return looks, NextRound(r, [], set(), f"budget spent: {spent} of {cap} sessions per study")
    bench = bench_arms(hyps, latest, arms, baseline) & set(wanted)
    return looks, NextRound(r, wanted, bench)


# --- from a study's runs ------------------------------------------------------------------------------


def study_hypotheses(spec: Any) -> list[HypothesisArms]:
    """Each hypothesis' two arms, by the labels `plan.arm_label` gives them."""
    out = []
    for h in spec.hypotheses:
        treatment = arm_label({**spec.baseline, h.factor: h.treatment}, spec.baseline)
        out.append(HypothesisArms(h.id, BASELINE_LABEL, treatment))
    return out


def arm_runs(records: Sequence[Any], spec: Any, used: Callable[[Any], bool]) -> dict[str, ArmRuns]:
    """Per arm label, the pooled runs' counts by repetition, every repetition started, and whether any
    run carried a throughput sweep (records: `analysis.RunRecord`; `used`: `analysis.run_used`, which
    runs are pooled)."""
    grouped: dict[str, list[Any]] = {}
    for r in records:
        grouped.setdefault(arm_label(r.factors, spec.baseline), []).append(r)
    out = {}
    for label, runs in grouped.items():
        counts = {r.repetition: (r.corrupted, r.corrupted + r.clean) for r in runs if used(r)}
        out[label] = ArmRuns(
            label,
            counts,
            frozenset(r.repetition for r in runs),
            any(r.bench for r in runs if r.status == "FINISHED"),
        )
    return out


def stopping_block(spec: Any, records: Sequence[Any], used: Callable[[Any], bool]) -> result.Stopping:
    """report.json's `stopping` block: the trace (per round: arms run, ICC, per hypothesis its
    evidence against the thresholds and its decision), the final decisions, sessions spent per arm,
    and what a fixed design running every arm for as many rounds would have spent."""
    hyps = study_hypotheses(spec)
    arms = arm_runs(records, spec, used)
    th = Thresholds.of(spec.alpha)
    looks = trace(spec, hyps, arms)
    final = looks[-1].decisions if looks else {}
    spent = {label: sum(n for _, n in a.counts.values()) for label, a in sorted(arms.items())}
    rounds = len(looks)
    sizes = [n for a in arms.values() for _, n in a.counts.values()]
    run_size = round(sum(sizes) / len(sizes)) if sizes else 0
    decisions = {}
    for h in hyps:
        d = final.get(h.id)
        if d is None or d.verdict is None:
            why = "undecided when the study stopped" + (f" ({d.reason})" if d else "")
            decisions[h.id] = result.Decision("inconclusive", why)
        else:
            decisions[h.id] = result.Decision(d.verdict, d.reason)
    return result.Stopping(
        method=(
            "e-values on beta-binomial runs (universal inference; the reduction on the rounds both arms "
            "ran, given each round's corrupted sessions), closed across hypotheses "
            "(orchestrator/analysis/sequential.py)"
        ),
        thresholds=result.Thresholds(th.comparison, th.ceiling),
        max_runs_per_arm=spec.stopping.max_runs_per_arm,
        max_sessions=spec.stopping.max_sessions,
        rounds=rounds,
        trace=tuple(look_.as_result() for look_ in looks),
        decisions=decisions,
        sessions_per_arm=spent,
        sessions=sum(spent.values()),
        fixed_design_sessions=len(arms) * rounds * run_size,
        benched=tuple(sorted(label for label, a in arms.items() if a.benched)),
    )


def describe(current: Look, th: Thresholds) -> str:
    """One line per hypothesis for the terminal: its evidence against the thresholds, its decision."""
    lines = [
        f"round {current.round} evidence (ICC {current.icc:.3f}; e-values as log, comparison needs "
        f"{th.comparison:.2f}, ceiling {th.ceiling:.2f}):"
    ]
    for h, d in current.decisions.items():
        ev = current.evidence[h]
        state = d.verdict or "undecided"
        lines.append(
            f"  {h}: reduction {ev.reduction:.2f}, equal {ev.equivalence:.2f}, under {ev.under:.2f}, "
            f"over {ev.over:.2f} -> {state}"
        )
    return "\n".join(lines)
