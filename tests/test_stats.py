"""The statistics against known values: scipy's own results, published examples, hand-computed tables."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from orchestrator import stats


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
