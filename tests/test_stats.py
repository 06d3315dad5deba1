"""The statistics against known values: scipy's own results, published examples, hand-computed tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from orchestrator.analysis import stats


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (27, 180), (9, 60), (60, 60), (3, 1000)])
def test_clopper_pearson_matches_scipy_exact_interval(k, n):
    ref = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    lo, hi = stats.clopper_pearson(k, n)
    assert lo == pytest.approx(ref.low, abs=1e-12)
    assert hi == pytest.approx(ref.high, abs=1e-12)


def test_zero_corruption_upper_bound_is_the_closed_form():
    # with k = 0 the exact upper limit solves (1 - p)^n = 0.025
    for n in (10, 60, 180, 240):
        assert stats.upper_bound(0, n) == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-10)
    assert stats.upper_bound(0, 10) == pytest.approx(0.3085, abs=1e-4)
    assert stats.upper_bound(0, 180) == pytest.approx(0.0203, abs=1e-4)
    assert stats.clopper_pearson(0, 0) == (0.0, 1.0)


def test_sessions_for_ceiling_is_the_smallest_n_under_it():
    for ceiling in (0.03, 0.06, 0.1):
        n = stats.sessions_for_ceiling(ceiling)
        assert stats.upper_bound(0, n) < ceiling <= stats.upper_bound(0, n - 1)
    assert stats.sessions_for_ceiling(0.03) == 122


def test_wilson_and_newcombe_match_newcombe_1998():
    # Newcombe (1998) Stat Med 17:857 and 17:873, worked examples
    assert stats.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)
    assert stats.newcombe_diff(56, 70, 48, 80) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    assert stats.newcombe_diff(9, 10, 3, 10) == pytest.approx((0.1705, 0.8090), abs=1e-4)
    assert stats.newcombe_diff(6, 7, 2, 7) == pytest.approx((0.0582, 0.8062), abs=1e-4)
    # zero cells, by hand: Wilson 10/10 lower = 10/(10+z^2), 0/20 upper = z^2/(20+z^2);
    # lower = 1 - sqrt((1 - l1)^2 + u2^2)
    z2 = 1.959963984540054**2
    l1, u2 = 10 / (10 + z2), z2 / (20 + z2)
    lo, hi = stats.newcombe_diff(10, 10, 0, 20)
    assert lo == pytest.approx(1 - math.sqrt((1 - l1) ** 2 + u2**2), abs=1e-12)
    assert hi == pytest.approx(1.0)


def test_fisher_matches_hand_computed_hypergeometric_tables():
    # lady tasting tea: P(a) = C(4,a)C(4,4-a)/70 -> a=3 two-sided: (16+1+16+1)/70
    assert stats.compare(3, 4, 1, 4) == pytest.approx(34 / 70, rel=1e-12)
    # 0/10 vs 5/10: only the two extreme tables (252 each of C(20,5)=15504) are as unlikely
    assert stats.compare(0, 10, 5, 10) == pytest.approx(504 / 15504, rel=1e-12)
    assert stats.compare(5, 60, 5, 60) == pytest.approx(1.0)
    assert stats.compare(0, 0, 3, 10) == 1.0


@pytest.mark.parametrize("table", [(27, 180, 0, 180), (9, 60, 4, 60), (2, 30, 7, 30)])
def test_compare_is_scipys_fisher_and_boschloo(table):
    kb, nb, kt, nt = table
    t = [[kb, nb - kb], [kt, nt - kt]]
    assert stats.compare(*table, test="fisher") == pytest.approx(sps.fisher_exact(t).pvalue, rel=1e-12)
    boschloo = sps.boschloo_exact(t, alternative="two-sided").pvalue
    assert stats.compare(*table, test="boschloo") == pytest.approx(boschloo, rel=1e-9)
    # Boschloo is uniformly at least as powerful as Fisher
    assert stats.compare(*table, test="boschloo") <= stats.compare(*table, test="fisher") + 1e-12


def test_compare_rejects_unknown_test():
    with pytest.raises(ValueError, match="boschloo"):
        stats.compare(1, 10, 2, 10, test="chi2")


def test_holm_hand_computed():
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> monotone 0.06
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert stats.holm([]) == []


def test_sessions_needed_matches_fleiss_table_value():
    # Fleiss, Tytun & Ury: 0.15 vs 0.10, alpha 0.05 two-sided, power 0.8 -> 726 per group (hand-computed)
    assert stats.sessions_needed(0.15, 0.05, 0.05, 0.8) == 726
    # stricter alpha and more power need more sessions; a bigger effect fewer
    assert stats.sessions_needed(0.15, 0.05, 0.0125) > 726
    assert stats.sessions_needed(0.15, 0.05, 0.05, 0.9) > 726
    assert stats.sessions_needed(0.15, 0.10) < 726
    # no corruption at baseline: the calculation aims at an increase instead
    assert stats.target_rate(0.0, 0.05) == pytest.approx(0.05)


def test_sessions_needed_gives_the_promised_power_for_fisher():
    """Simulate Fisher's test at the computed size: power near 80% (seeded Monte Carlo)."""
    p1, effect = 0.30, 0.20
    n = stats.sessions_needed(p1, effect)
    rng = np.random.default_rng(7)
    sims = 300
    hits = sum(
        stats.compare(int(rng.binomial(n, p1)), n, int(rng.binomial(n, p1 - effect)), n) < 0.05
        for _ in range(sims)
    )
    assert 0.72 <= hits / sims <= 0.92


def test_bootstrap_ratio_requests():
    rng = np.random.default_rng(1)
    base = [(rng.integers(60, 70, 120), rng.uniform(1.0, 2.0, 120)) for _ in range(3)]
    same = stats.bootstrap_ratio_requests(base, base, seed=3)
    assert same.point == pytest.approx(1.0)
    assert same.low < 1.0 < same.high
    faster = [(tok, lat / 2) for tok, lat in base]
    ratio = stats.bootstrap_ratio_requests(faster, base, seed=3)
    assert ratio.point == pytest.approx(2.0)
    assert 1.8 < ratio.low < 2.0 < ratio.high < 2.2
    # reproducible with the same seed
    assert stats.bootstrap_ratio_requests(faster, base, seed=3) == ratio
    assert math.isnan(stats.bootstrap_ratio_requests([], base).point)


def test_bootstrap_ratio_runs():
    r = stats.bootstrap_ratio_runs([500, 510, 490], [400, 410, 405], seed=0)
    assert r.point == pytest.approx(500 / 405)
    assert r.low <= r.point <= r.high
    assert r.low >= 490 / 410 and r.high <= 510 / 400
    single = stats.bootstrap_ratio_runs([300], [600])
    assert single.point == single.low == single.high == pytest.approx(0.5)


# --- between runs ----------------------------------------------------------------------------------


def test_dispersion_pools_arms_with_corruption_and_two_runs():
    # one arm, by hand: p = 30/180, X^2 = sum (k - 60p)^2 / (60 p (1 - p)) over runs 5, 10, 15
    p = 30 / 180
    x2 = sum((k - 60 * p) ** 2 / (60 * p * (1 - p)) for k in (5, 10, 15))
    d = stats.dispersion([[(5, 60), (10, 60), (15, 60)], [(0, 60), (0, 60)], [(4, 60)]])
    assert d.df == 2 and d.phi == pytest.approx(x2 / 2)
    assert d.icc == pytest.approx((x2 / 2 - 1) / 59) and d.mean_run_size == 60
    # no arm can show it: not estimated, no variation assumed here (the analysis decides what to assume)
    assert not stats.dispersion([[(3, 60)], [(0, 60), (0, 60)]]).estimated
    # less spread than binomial: ICC 0, not negative
    assert stats.dispersion([[(10, 60), (10, 60), (10, 60)]]).icc == 0.0


def test_dispersion_estimates_the_design_effect_of_beta_binomial_runs():
    """Averaged over simulated studies (two corrupted arms of 3 runs of 60): phi ~ 1 without between-run
    variation; with it, phi is biased low in samples this small (the module doc says by how much)."""
    rng = np.random.default_rng(11)
    for rho, low, high in ((0.0, 0.95, 1.05), (0.05, 0.8, 1.0)):
        phis = []
        for _ in range(400):
            arms = []
            for q in (0.15, 0.05):
                s = rng.beta(q * (1 - rho) / rho, (1 - q) * (1 - rho) / rho, 3) if rho else np.full(3, q)
                arms.append([(int(k), 60) for k in rng.binomial(60, s)])
            phis.append(stats.dispersion(arms).phi)
        assert low <= np.mean(phis) / (1 + 59 * rho) <= high


def test_effective_counts_and_design_effect():
    assert stats.design_effect(0.02, 60) == pytest.approx(2.18)
    assert stats.design_effect(0.5, 1) == 1.0  # one session per run: nothing to correlate
    assert stats.effective_counts(27, 180, 2.18) == (12, 83)
    assert stats.effective_counts(27, 180, 1.0) == (27, 180)
    assert stats.effective_counts(1, 3, 10.0) == (0, 1)


def test_runs_interval_is_clopper_pearson_without_icc_and_exact_with_it():
    assert stats.runs_interval([[9, 60], [8, 60], [10, 60]], 0.0) == stats.clopper_pearson(27, 180)
    # all runs clean: the upper bound q solves prod_j B(a, b + n_j) / B(a, b) = 0.025 (beta-binomial zero)
    icc = 0.02
    lo, hi = stats.runs_interval([[0, 60]] * 3, icc)
    a, b = hi * (1 - icc) / icc, (1 - hi) * (1 - icc) / icc
    log_zero_per_run = math.lgamma(a + b) - math.lgamma(b) + math.lgamma(b + 60) - math.lgamma(a + b + 60)
    p_zero = math.exp(3 * log_zero_per_run)
    assert lo == 0.0 and p_zero == pytest.approx(0.025, rel=1e-4)
    assert hi > stats.upper_bound(0, 180)  # correlated runs: three clean runs say less than 180 sessions
    lo, hi = stats.runs_interval([[9, 60], [8, 60], [10, 60]], 0.05)
    lo0, hi0 = stats.clopper_pearson(27, 180)
    assert lo < lo0 < 0.15 < hi0 < hi


def test_runs_interval_covers_the_true_rate():
    """Coverage of the beta-binomial interval at its own ICC, simulated: at least nominal, near it."""
    rng = np.random.default_rng(12)
    q, rho, sims = 0.1, 0.05, 400
    covered = 0
    for _ in range(sims):
        s = rng.beta(q * (1 - rho) / rho, (1 - q) * (1 - rho) / rho, 3)
        lo, hi = stats.runs_interval([[int(k), 60] for k in rng.binomial(60, s)], rho)
        covered += lo <= q <= hi
    assert 0.93 <= covered / sims <= 0.995


def test_sessions_needed_keeps_its_promise_with_correlated_runs():
    """At the computed size, in runs of 60 with ICC rho, the comparison the analysis makes (Fisher on the
    Rao-Scott effective counts) finds the difference with about the promised 80% power."""
    p1, effect, rho, m = 0.15, 0.10, 0.02, 60
    deff = stats.design_effect(rho, m)
    n = stats.sessions_needed(p1, effect, 0.05, 0.8, deff)
    runs = math.ceil(n / m)
    rng = np.random.default_rng(9)
    sims, hits = 400, 0
    for _ in range(sims):
        counts = []
        for q in (p1, p1 - effect):
            s = rng.beta(q * (1 - rho) / rho, (1 - q) * (1 - rho) / rho, runs)
            counts.append(int(rng.binomial(m, s).sum()))
        kb, nb = stats.effective_counts(counts[0], runs * m, deff)
        kt, nt = stats.effective_counts(counts[1], runs * m, deff)
        hits += stats.compare(kb, nb, kt, nt) < 0.05
    assert 0.72 <= hits / sims <= 0.95
