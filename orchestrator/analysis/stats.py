"""Exact statistics for corruption counts and throughput ratios (pure: numbers in, numbers out).

Methods, and why each one:
- **Rate of an arm**: k corrupted of n sessions with an outcome (errored sessions are not trials: they
  carry no evidence either way). Interval: Clopper-Pearson (exact, never below nominal coverage), so a
  clean arm's upper bound is the largest rate still compatible with seeing no corruption
  (0/180 -> 2.0% at 95%).
- **Baseline vs treatment**: Fisher's exact test on the 2x2 table, two-sided (scipy's definition:
  tables as or less likely than the observed one); Boschloo's unconditional test as an option (more
  power, slower). Holm's step-down adjustment across the study's hypotheses controls the family-wise
  error at alpha under any dependence (arms share the baseline).
- **Interval of the difference** (treatment rate minus baseline rate): Newcombe's hybrid score
  interval (method 10, Wilson intervals without continuity correction). It has close to nominal
  coverage for small counts and zero cells, where the Wald interval collapses.
- **Sessions needed** to decide an undecided comparison: per arm, for a two-sided test at level alpha
  with the given power, when the baseline rate is the observed one and the treatment differs by the
  study's minimum effect (a reduction when the baseline rate allows one, else an increase). Formula:
  Fleiss, Tytun & Ury (1980), the normal approximation with continuity correction, which tracks
  the power of Fisher's exact test closely (checked by simulation in tests/test_stats.py), multiplied
  by the design effect when runs are correlated (below). What it promises is power against that
  difference, nothing more: when there is no difference, that many sessions do not by themselves make
  the interval of the difference narrower than the minimum effect (exoneration), which can need more.

Between runs (the replicate unit is the run, one server start; see docs/fault-model.md): a
heisenbug's rate moves from one start to the next, so the sessions of one run are correlated
(intra-class correlation rho) and a run of m sessions carries the information of m / D independent
ones, D = 1 + (m - 1) rho (the design effect). Method, and why:
- **Model**: beta-binomial, one rho shared by every arm of a study (the variation belongs to the
  deployment's restart, not to one arm; with a few runs per arm, a per-arm rho would rest on 2 degrees
  of freedom). `dispersion` estimates it from the per-run counts of every arm with two or more runs
  and some corruption, by the pooled Pearson dispersion phi = X^2 / df over runs within arms (a
  moment estimator that needs no iteration; arms with no corruption carry no information about it),
  rho = (phi - 1) / (m - 1), clipped at 0. Without between-run variation phi averages 1; with it,
  samples this small bias it low (3 runs of 60 per arm, D = 2.18: phi averages about 2.05 at 15%,
  1.8 at 3%; D = 6.9: 5.7 and 4.2), and clipping at 0 biases rho up when it is near 0.
- **Comparison**: the Rao-Scott (1992) adjustment: every count of an arm is divided by that arm's D
  (`effective_counts`), then the exact methods above run on the effective counts (Fisher, Holm,
  Newcombe). With D = 1 (no between-run variation seen) they are the exact independent-session
  methods (the exact fallback). phi is a plug-in estimate with few degrees of freedom, so the test is
  only approximately valid; its family-wise error, measured by `python -m orchestrator.study.rehearse` on
  the dsv4 design (3% and 15%, rho 0 to 0.1), stays under alpha (Fisher's conservatism and Holm absorb
  the estimate's noise there); other designs can be rehearsed the same way.
- **Rate of an arm** (and so the ceiling of "implicated"): `runs_interval`, the Clopper-Pearson
  construction on the beta-binomial model itself (the sum over runs of beta-binomial counts with that
  rho), not on effective counts: a clean arm's bound is a tail probability (all of its runs clean),
  which dividing n by D would overstate. With rho = 0 it is Clopper-Pearson exactly.
- **Few runs**: with 2 runs per arm the estimate rests on a degree of freedom or two and can fall far
  below the truth; the quick study (2 arms x 2 runs x 60) then implicates in 6-7% of null studies at
  rho 0.1 (rehearsed, 2,000 studies). A study can state `assumed_icc`, the ICC its deployment is
  known to vary by at least: the analysis never uses less (with `study.assumed_icc=0.05`, 1.7%).
- **One run per arm** (or no arm with two runs and corruption): between-run variation cannot be
  estimated from the data. The analysis then assumes the study's `assumed_icc` (default 0:
  sessions independent) and says so in the report.
- **Effects in a factorial** (main effects, interactions: linear contrasts of arms' rates):
  `contrast_interval`, Price & Bonett's adjusted Wald interval, on effective counts; it adds 2/m
  successes and 4/m trials to each of the m rates, which keeps its coverage where rates are 0 or near.
- **Throughput ratio**: see `bootstrap_ratio_requests` / `bootstrap_ratio_runs`.
- **One arm's rate on two clusters** (`runs_split_test`, for `orchestrator/analysis/clusters.py`): Fisher's
  exact test generalised to the runs model. Given the arm's total corrupted K, the probability of each
  split of K between the clusters' runs, each run beta-binomial with the pooled rate K / N and the
  ICC; the p-value sums the splits as or less likely than the one seen (scipy's two-sided definition).
  With ICC 0 the runs are binomial, the split is hypergeometric, and it is Fisher's test exactly. More
  than two clusters: each against the others pooled, Bonferroni over them. The ICC it is given is an
  estimate on few degrees of freedom; plugged in as if known, the test alarms on restart variation alone
  (7-10% of null studies at nominal 5%, 3-6 runs per arm): `t_reference` refers the p-value's
  normal deviate to Student's t on the estimate's degrees of freedom, as a t test does for a z whose
  variance is estimated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize, special
from scipy import stats as sps

from orchestrator.config.checks import TESTS

CONFIDENCE = 0.95


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be within 0..n={n}")
    tail = (1 - confidence) / 2
    # Beta quantiles by scipy.special directly: the same function as sps.beta.ppf without the
    # distribution object's argument handling, which cost the Monte Carlo rehearsals a quarter of their time
    lo = 0.0 if k == 0 else float(special.betaincinv(k, n - k + 1, tail))
    hi = 1.0 if k == n else float(special.betaincinv(k + 1, n - k, 1 - tail))
    return lo, hi


def _z(confidence: float) -> float:
    """The normal deviate of a two-sided interval at `confidence`."""
    return float(special.ndtri(1 - (1 - confidence) / 2))


def upper_bound(k: int, n: int, confidence: float = CONFIDENCE) -> float:
    """The largest rate still compatible with k of n: the Clopper-Pearson upper limit."""
    return clopper_pearson(k, n, confidence)[1]


def wilson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval for a proportion; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_diff(k1: int, n1: int, k2: int, n2: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Newcombe's hybrid score interval for p1 - p2 (method 10); (-1, 1) when either n is 0."""
    if n1 <= 0 or n2 <= 0:
        return -1.0, 1.0
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, confidence)
    l2, u2 = wilson(k2, n2, confidence)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return max(-1.0, lo), min(1.0, hi)


@functools.lru_cache(maxsize=65536)  # pure; rehearsals meet the same tables many times
def compare(k_base: int, n_base: int, k_treat: int, n_treat: int, test: str = "fisher") -> float:
    """Two-sided p-value for "baseline and treatment have the same corruption rate"; 1.0 without data."""
    if test not in TESTS:
        raise ValueError(f"test={test!r} is not one of {list(TESTS)}")
    if n_base <= 0 or n_treat <= 0:
        return 1.0
    table = [[k_base, n_base - k_base], [k_treat, n_treat - k_treat]]
    if test == "fisher":
        p = float(sps.fisher_exact(table, alternative="two-sided").pvalue)
    else:
        p = float(sps.boschloo_exact(table, alternative="two-sided").pvalue)
    # a table with an all-zero column carries no evidence; scipy gives 1.0 or NaN depending on the test
    return 1.0 if math.isnan(p) else min(1.0, p)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order (monotone, capped at 1)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: (pvalues[i], i))
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def target_rate(p_base: float, min_effect: float) -> float:
    """The treatment rate a power calculation aims at: a reduction by min_effect when possible."""
    return p_base - min_effect if p_base - min_effect >= 0 else min(1.0, p_base + min_effect)


def sessions_needed(
    p_base: float, min_effect: float, alpha: float = 0.05, power: float = 0.8, design_effect: float = 1.0
) -> int:
    """Sessions per arm for a two-sided test at level `alpha` to find a difference of `min_effect` from
    the baseline rate `p_base` with probability `power` (and no more than that: see the module doc).

    Fleiss-Tytun-Ury continuity-corrected sample size for two independent proportions, times the
    design effect of runs of the size the arm will be run in (1: independent sessions)."""
    if not 0 < min_effect < 1:
        raise ValueError(f"min_effect={min_effect} must be within (0, 1)")
    p1 = min(max(p_base, 0.0), 1.0)
    p2 = target_rate(p1, min_effect)
    delta = abs(p1 - p2)
    pbar = (p1 + p2) / 2
    z_a = float(special.ndtri(1 - alpha / 2))
    z_b = float(special.ndtri(power))
    n0 = (z_a * math.sqrt(2 * pbar * (1 - pbar)) + z_b * math.sqrt(p1 * (1 - p1) + p2 * (1 - p2))) ** 2
    n0 /= delta**2
    n = n0 / 4 * (1 + math.sqrt(1 + 4 / (n0 * delta))) ** 2
    return math.ceil(n * max(1.0, design_effect) - 1e-9)


def sessions_for_ceiling(ceiling: float, confidence: float = CONFIDENCE) -> int:
    """Sessions an arm needs, with no corruption seen, for its upper bound to fall under `ceiling`."""
    # CP upper bound at k=0 is 1 - (tail)^(1/n); solve 1 - tail^(1/n) < ceiling for n
    tail = (1 - confidence) / 2
    return math.floor(math.log(tail) / math.log(1 - ceiling)) + 1


@functools.lru_cache(maxsize=65536)  # pure; an observed rate is k/n, and rehearsals meet the same ones
def sessions_to_exclude(rate: float, threshold: float, confidence: float = CONFIDENCE) -> int | None:
    """About how many sessions an arm at this observed rate needs for its Clopper-Pearson interval to
    exclude `threshold` (its upper bound under it when the rate is below, its lower bound over it when
    above); None when the rate is the threshold itself (no number of sessions separates them)."""
    if rate <= 0:
        return sessions_for_ceiling(threshold, confidence)
    if rate == threshold:
        return None

    def excludes(n: int) -> bool:
        lo, hi = clopper_pearson(min(n, round(rate * n)), n, confidence)
        return hi < threshold if rate < threshold else lo > threshold

    high = 1
    while not excludes(high):
        high *= 2
        if high > 10**9:
            return None
    low = high // 2  # excludes(low) is false (or low is 0)
    while high - low > 1:  # the bound moves by steps as k is rounded: the smallest n found by bisection
        mid = (low + high) // 2
        low, high = (low, mid) if excludes(mid) else (mid, high)
    return high


def contrast_interval(
    counts: Sequence[tuple[float, float]], coefficients: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float, float]:
    """(estimate, low, high) of a linear contrast sum(c_i p_i) of binomial proportions, k_i of n_i each:
    Price & Bonett's (2004) adjusted Wald interval, which adds 2/m successes and 4/m trials to each of
    the m proportions in the contrast. Unlike the plain Wald interval it keeps close to nominal coverage
    when the proportions are near 0 (a clean arm's 0/n). The estimate is the unadjusted contrast."""
    used = [(k, n, c) for (k, n), c in zip(counts, coefficients, strict=True) if c != 0]
    if not used or any(n <= 0 for _, n, _ in used):
        return math.nan, math.nan, math.nan
    m = len(used)
    z = _z(confidence)
    estimate = sum(c * k / n for k, n, c in used)
    adjusted = [((k + 2 / m) / (n + 4 / m), n + 4 / m, c) for k, n, c in used]
    centre = sum(c * p for p, _, c in adjusted)
    se = math.sqrt(sum(c * c * p * (1 - p) / n for p, n, c in adjusted))
    return estimate, centre - z * se, centre + z * se


# --- between runs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dispersion:
    """Between-run variation of a study, estimated from per-run counts (see the module doc)."""

    phi: float  # pooled Pearson dispersion X^2 / df (1: no more spread than binomial)
    df: int  # degrees of freedom behind it: sum over contributing arms of (runs - 1)
    icc: float  # rho = (phi - 1) / (mean run size - 1), clipped at 0
    mean_run_size: float  # mean sessions per run over the contributing runs

    @property
    def estimated(self) -> bool:
        return self.df > 0


def dispersion(arms: Sequence[Sequence[tuple[int, int]]]) -> Dispersion:
    """Pooled Pearson dispersion over the runs (k corrupted of n) within each arm. Arms with fewer than
    two runs with sessions, or with no corruption (or all), carry no information and are skipped."""
    x2, df, sizes = 0.0, 0, []
    for runs in arms:
        runs = [(k, n) for k, n in runs if n > 0]
        k_all, n_all = sum(k for k, _ in runs), sum(n for _, n in runs)
        if len(runs) < 2 or k_all == 0 or k_all == n_all:
            continue
        p = k_all / n_all
        x2 += sum((k - n * p) ** 2 / (n * p * (1 - p)) for k, n in runs)
        df += len(runs) - 1
        sizes += [n for _, n in runs]
    if df == 0:
        return Dispersion(1.0, 0, 0.0, 0.0)
    phi = x2 / df
    m = sum(sizes) / len(sizes)
    icc = max(0.0, (phi - 1) / (m - 1)) if m > 1 else 0.0
    return Dispersion(phi, df, min(1.0, icc), m)


def _convolution_power(pmf: np.ndarray, times: int, length: int) -> np.ndarray:
    """The pmf of the sum of `times` independent draws of `pmf`, its first `length` terms (by squaring:
    a study's runs are mostly of one size)."""
    result, base = np.array([1.0]), pmf[:length]
    while times:
        if times & 1:
            result = np.convolve(result, base)[:length]
        times >>= 1
        if times:
            base = np.convolve(base, base)[:length]
    return result


def beta_shape(mean: Any, icc: float) -> tuple[Any, Any]:
    """Beta(a, b) of a start's rate whose mean is `mean` and whose sessions correlate with ICC `icc`
    (0 < icc < 1): a = mean (1 - icc) / icc, b = (1 - mean) (1 - icc) / icc. The one statement of the
    restart model: the analysis, the sequential design and the rehearsal all draw or weigh by it."""
    scale = (1 - icc) / icc
    return mean * scale, (1 - mean) * scale


def beta_binomial_kernel(k: Any, n: Any, a: Any, b: Any, log_beta_ab: Any = None) -> Any:
    """log P(k of n) for a run whose rate is Beta(a, b), without the binomial coefficient (which cancels
    in every likelihood ratio). `log_beta_ab`: betaln(a, b), where the caller keeps it (it depends on the
    rate and ICC alone, not on the counts: half the work of a grid's likelihood)."""
    return special.betaln(k + a, n - k + b) - (special.betaln(a, b) if log_beta_ab is None else log_beta_ab)


@functools.lru_cache(maxsize=4096)
def _log_binomial_coefficients(n: int, length: int) -> np.ndarray:
    """log C(n, x) for x < length: the same at every rate an exact bound's root search tries."""
    x = np.arange(length)
    coefficients = special.gammaln(n + 1) - special.gammaln(x + 1) - special.gammaln(n - x + 1)
    coefficients.flags.writeable = False  # shared by every caller through the cache
    return coefficients


def _beta_binomial_log_pmf(x: np.ndarray, n: int, a: float, b: float) -> np.ndarray:
    """log P(X = x) for X ~ BetaBinomial(n, a, b), x = 0, 1, ...: one run's count when its rate is
    Beta(a, b)."""
    return _log_binomial_coefficients(n, x.size) + beta_binomial_kernel(x, n, a, b)


def _runs_cdf(k: int, sizes: tuple[int, ...], q: float, icc: float) -> float:
    """P(total corrupted <= k) over runs of these sizes, each beta-binomial with mean q and ICC icc."""
    a, b = beta_shape(q, icc)
    if k == 0:  # every run clean (a clean arm's bound): a product of scalars, no arrays
        log_clean = sum(sizes.count(n) * beta_binomial_kernel(0, n, a, b) for n in set(sizes))
        return float(math.exp(log_clean))
    total = np.array([1.0])
    for n in sorted(set(sizes)):
        x = np.arange(min(k, n) + 1)
        log_pmf = _beta_binomial_log_pmf(x, n, a, b)
        runs = _convolution_power(np.exp(log_pmf), sizes.count(n), k + 1)
        total = np.convolve(total, runs)[: k + 1]
    return float(min(1.0, total.sum()))


@functools.lru_cache(maxsize=65536)
def _runs_bound(k: int, sizes: tuple[int, ...], icc: float, tail: float, upper: bool) -> float:
    if upper:  # the rate at which seeing k or fewer is as unlikely as `tail`
        return float(
            optimize.brentq(lambda q: _runs_cdf(k, sizes, q, icc) - tail, 1e-12, 1 - 1e-12, xtol=1e-7)
        )
    return float(
        optimize.brentq(lambda q: 1 - _runs_cdf(k - 1, sizes, q, icc) - tail, 1e-12, 1 - 1e-12, xtol=1e-7)
    )


# the highest ICC any likelihood is evaluated at: at 1 a run's sessions share one fate, the beta-binomial's
# limit, which its formula cannot evaluate (Beta(0, 0): inf - inf); this close to it a run of n sessions
# weighs as 1 + (n - 1) 0.999 of them against n
ICC_CEILING = 0.999


def exact_icc(icc: float) -> float:
    """The ICC the exact runs computations use: within [0, ICC_CEILING], to 4 decimals (more than any
    estimate supports, and a cache key that repeats)."""
    return round(max(0.0, min(icc, ICC_CEILING)), 4)


def runs_interval(
    run_counts: Sequence[Sequence[int]], icc: float, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """Exact interval of an arm's mean rate from its runs ([corrupted, sessions] each) when sessions of
    a run have intra-class correlation `icc` (beta-binomial); Clopper-Pearson when icc is 0."""
    k = sum(int(c[0]) for c in run_counts)
    n = sum(int(c[1]) for c in run_counts)
    icc = exact_icc(icc)
    if icc == 0 or n <= 0:
        return clopper_pearson(k, n, confidence)
    sizes = tuple(sorted(int(c[1]) for c in run_counts if c[1] > 0))
    tail = (1 - confidence) / 2
    lo = 0.0 if k == 0 else _runs_bound(k, sizes, icc, tail, upper=False)
    hi = 1.0 if k == n else _runs_bound(k, sizes, icc, tail, upper=True)
    return lo, hi


def runs_tails(run_counts: Sequence[Sequence[int]], q: float, icc: float) -> tuple[float, float]:
    """(P(K <= k), P(K >= k)) for an arm's total corrupted K at mean rate q, its runs beta-binomial with
    ICC `icc` (binomial at 0): the two tails `runs_interval` puts (1 - confidence) / 2 in each of, so
    its interval at confidence c excludes q exactly when 2 x the smaller tail < 1 - c."""
    k = sum(int(c[0]) for c in run_counts)
    n = sum(int(c[1]) for c in run_counts)
    icc = exact_icc(icc)
    if icc == 0 or n <= 0:
        return float(sps.binom.cdf(k, n, q)), float(sps.binom.sf(k - 1, n, q))
    sizes = tuple(sorted(int(c[1]) for c in run_counts if c[1] > 0))
    low = _runs_cdf(k, sizes, q, icc)
    high = 1.0 if k == 0 else 1.0 - _runs_cdf(k - 1, sizes, q, icc)
    return float(low), float(max(0.0, high))


def _runs_pmf(sizes: Sequence[int], q: float, icc: float, length: int) -> np.ndarray:
    """P(total corrupted = x) for x < length over runs of these sizes, each beta-binomial with mean q and
    ICC icc (binomial when icc is 0), zero-padded to `length`."""
    out = np.zeros(length)
    if icc <= 0:
        n_all = int(sum(sizes))
        x = np.arange(min(n_all, length - 1) + 1)
        out[: x.size] = sps.binom.pmf(x, n_all, q)
        return out
    a, b = beta_shape(q, icc)
    total = np.array([1.0])
    for n in sorted(set(sizes)):
        x = np.arange(min(n, length - 1) + 1)
        log_pmf = _beta_binomial_log_pmf(x, n, a, b)
        runs = _convolution_power(np.exp(log_pmf), list(sizes).count(n), length)
        total = np.convolve(total, runs)[:length]
    out[: total.size] = total
    return out


def _split_two(first: Sequence[Sequence[int]], second: Sequence[Sequence[int]], icc: float) -> float:
    k1, n1 = sum(int(c[0]) for c in first), sum(int(c[1]) for c in first)
    k2, n2 = sum(int(c[0]) for c in second), sum(int(c[1]) for c in second)
    k, n = k1 + k2, n1 + n2
    if n1 <= 0 or n2 <= 0 or k == 0 or k == n:
        return 1.0  # nothing to compare: no runs on one side, or no corruption (or all) anywhere
    q = k / n
    p1 = _runs_pmf([int(c[1]) for c in first if c[1] > 0], q, icc, k + 1)
    p2 = _runs_pmf([int(c[1]) for c in second if c[1] > 0], q, icc, k + 1)
    split = p1 * p2[::-1]  # split[x]: x corrupted in the first group, k - x in the second
    total = split.sum()
    if total <= 0:
        return 0.0
    split /= total
    return float(min(1.0, split[split <= split[k1] * (1 + 1e-7)].sum()))


def runs_split_test(groups: Sequence[Sequence[Sequence[int]]], icc: float) -> float:
    """Two-sided p-value for "these groups of runs ([corrupted, sessions] each) share one mean rate" when
    sessions of a run have intra-class correlation `icc`: the exact conditional test on the runs model
    (module doc); Fisher's exact test when icc is 0. 1.0 without corruption or without two groups."""
    groups = [g for g in groups if sum(int(c[1]) for c in g) > 0]
    icc = exact_icc(icc)
    if len(groups) < 2:
        return 1.0
    if len(groups) == 2:
        return _split_two(groups[0], groups[1], icc)
    ps = [_split_two(g, [c for h in groups if h is not g for c in h], icc) for g in groups]
    return min(1.0, len(groups) * min(ps))


def t_reference(p: float, df: int) -> float:
    """A two-sided p-value computed with an estimated variance taken as known, referred to Student's t on
    the estimate's `df` degrees of freedom: its normal deviate z, then 2 P(T_df > z) (as is when df is
    0: nothing to refer to)."""
    if df <= 0 or p >= 1:
        return float(min(1.0, p))
    z = -float(special.ndtri(p / 2))
    return float(min(1.0, 2 * special.stdtr(df, -z)))


def design_effect(icc: float, mean_run_size: float) -> float:
    """D = 1 + (m - 1) rho: how many sessions of runs of size m are worth one independent session."""
    return 1.0 + max(0.0, mean_run_size - 1) * max(0.0, icc)


def pooled_run_size(sizes: Sequence[int]) -> float:
    """The run size whose design effect is that of runs of these sizes pooled: the variance of the pooled
    rate is p (1 - p) / N^2 * sum n_i (1 + (n_i - 1) rho), so m = sum n_i^2 / N (the mean, when the runs
    are of one size)."""
    total = sum(sizes)
    return sum(n * n for n in sizes) / total if total else 0.0


def effective_counts(k: int, n: int, deff: float) -> tuple[int, int]:
    """The Rao-Scott effective counts (k / D, n / D), rounded; an arm with sessions keeps at least one."""
    if n <= 0 or deff <= 1.0:
        return k, n
    n_eff = max(1, round(n / deff))
    return min(n_eff, round(k / deff)), n_eff


# --- throughput ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    point: float
    low: float
    high: float
    method: str  # "requests" or "runs"


def _percentile_interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    tail = (1 - confidence) / 2 * 100
    finite = samples[np.isfinite(samples)]
    if finite.size == 0:
        return math.nan, math.nan
    return float(np.percentile(finite, tail)), float(np.percentile(finite, 100 - tail))


def _resampled_rate(
    runs: Sequence[tuple[np.ndarray, np.ndarray]], n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    """Per replicate: resample runs, then requests within each drawn run; sum tokens / sum latency."""
    n_runs = len(runs)
    tokens = np.zeros(n_boot)
    latency = np.zeros(n_boot)
    choice = rng.integers(0, n_runs, size=(n_boot, n_runs))
    for slot in range(n_runs):
        for r, (tok, lat) in enumerate(runs):
            rows = np.nonzero(choice[:, slot] == r)[0]
            if rows.size == 0:
                continue
            idx = rng.integers(0, tok.size, size=(rows.size, tok.size))
            tokens[rows] += tok[idx].sum(axis=1)
            latency[rows] += lat[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return tokens / latency


def bootstrap_ratio_requests(
    treat: Sequence[tuple[Sequence[float], Sequence[float]]],
    base: Sequence[tuple[Sequence[float], Sequence[float]]],
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Ratio:
    """Throughput ratio treatment/baseline at one concurrency level, from per-request samples.

    Each run is (output tokens per request, latency per request). An arm's statistic is its per-stream
    token rate, sum(tokens) / sum(latency), pooled over its runs; in a closed loop with C requests in
    flight, tok/s = C x that rate, so at the same C the ratio of rates is the ratio of tok/s. The
    interval is a two-stage (runs, then requests within a run) percentile bootstrap, so it holds both
    run-to-run and request-to-request variation; a fixed seed makes it reproducible."""
    t = [(np.asarray(a, float), np.asarray(b, float)) for a, b in treat if len(a)]
    b = [(np.asarray(x, float), np.asarray(y, float)) for x, y in base if len(x)]
    if not t or not b:
        return Ratio(math.nan, math.nan, math.nan, "requests")

    def rate(runs: list[tuple[np.ndarray, np.ndarray]]) -> float:
        return float(sum(x.sum() for x, _ in runs) / sum(y.sum() for _, y in runs))

    point = rate(t) / rate(b)
    rng = np.random.default_rng(seed)
    samples = _resampled_rate(t, n_boot, rng) / _resampled_rate(b, n_boot, rng)
    lo, hi = _percentile_interval(samples, confidence)
    return Ratio(point, lo, hi, "requests")


def bootstrap_ratio_runs(
    treat: Sequence[float],
    base: Sequence[float],
    n_boot: int = 2000,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Ratio:
    """Throughput ratio of mean tok/s per run, with a percentile bootstrap over runs (the fallback when
    per-request samples are missing; with few runs the interval is coarse, and with one run it is a point)."""
    t = np.asarray([x for x in treat if math.isfinite(x)], float)
    b = np.asarray([x for x in base if math.isfinite(x)], float)
    if t.size == 0 or b.size == 0 or b.mean() == 0:
        return Ratio(math.nan, math.nan, math.nan, "runs")
    point = float(t.mean() / b.mean())
    rng = np.random.default_rng(seed)
    ts = t[rng.integers(0, t.size, size=(n_boot, t.size))].mean(axis=1)
    bs = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        lo, hi = _percentile_interval(ts / bs, confidence)
    return Ratio(point, lo, hi, "runs")


def study_icc(groups: Sequence[Sequence[Sequence[int]]], assumed: float) -> Dispersion:
    """The ICC rule, the one every part of the analysis uses (the study's, the sequential looks', the
    cluster check's): the between-run dispersion of `groups` (each one arm's, or one cell's, runs as
    [corrupted, sessions]), its ICC floored at `assumed`; `assumed` alone (0 degrees of freedom) when no
    group has two runs with corruption to estimate it from."""
    return floored(dispersion([list(g) for g in groups]), assumed)


def floored(found: Dispersion, assumed: float) -> Dispersion:
    """`study_icc` on a dispersion already estimated (a caller that also reports the raw estimate)."""
    if found.estimated:
        return Dispersion(found.phi, found.df, max(found.icc, assumed), found.mean_run_size)
    return Dispersion(1.0, 0, assumed, 0.0)
