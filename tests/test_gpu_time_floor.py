"""bench/gpu_time_floor.py: the least GPU time a design can spend on the seed story's verdicts, as two
floors: the fixed-sample floor (designs whose size is fixed in advance) and Wald's mean-cost floor (the
mean of any design, adaptive ones included). Each is checked here by simulation for what it claims to
bound, so a wrong formula shows as a bound that is not tight or not a bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.conftest import script_module

floor = script_module("bench/gpu_time_floor.py", "gpu_time_floor")


def _all_clean_share(rng, ceiling: float, icc: float, n: int, starts: int, studies: int) -> float:
    a, b = ceiling * (1 - icc) / icc, (1 - ceiling) * (1 - icc) / icc
    rates = rng.beta(a, b, size=(studies, starts))
    return float(np.mean((rng.binomial(n, rates) == 0).all(axis=1)))


@pytest.mark.parametrize("icc", [0.005, 0.02])
def test_the_zero_arms_floor_is_the_fewest_sessions_whose_all_clean_outcome_is_rare_at_the_ceiling(icc):
    """At the floor's start size, an arm truly at the ceiling comes back all clean in at most alpha of
    simulated starts (so a test may call it under); one session in ten fewer, more often than alpha."""
    cluster, ceiling, alpha = floor.Cluster(), 0.03, 0.05
    seconds = floor.ceiling_floor_s(ceiling, icc, alpha, cluster, most_starts=1)
    n = round(seconds - cluster.restart_s)
    rng = np.random.default_rng(7)
    at_floor = _all_clean_share(rng, ceiling, icc, n, 1, 200_000)
    under = _all_clean_share(rng, ceiling, icc, int(n * 0.9), 1, 200_000)
    assert at_floor <= alpha * 1.03, (n, at_floor)
    assert under > alpha * 1.03, (n, under)
    assert math.exp(floor.log_p_all_clean(n, ceiling, icc)) == pytest.approx(at_floor, abs=0.003)


def test_one_start_is_the_cheapest_way_to_show_a_zero_arm_under_the_ceiling():
    cluster = floor.Cluster()
    one = floor.ceiling_floor_s(0.03, 0.02, 0.05, cluster, most_starts=1)
    assert floor.ceiling_floor_s(0.03, 0.02, 0.05, cluster, most_starts=4) == one
    # at ICC 0 the same evidence is sessions, wherever they run: one start still, for its restart
    assert floor.ceiling_floor_s(0.03, 0.0, 0.05, cluster) == cluster.start_s(99)  # 0.97^99 < 0.05 < 0.97^98


def test_the_oracle_test_has_the_power_the_reduction_floor_says_at_the_floor():
    """Spend the reduction floor's seconds (as whole starts at the best size, split as the bound splits
    them) and the oracle z-test's simulated power is about the 80% the floor was computed for."""
    cluster, icc = floor.Cluster(), 0.02
    seconds = floor.reduction_floor_s(0.15, 0.05, icc, 0.05, 0.8, cluster)
    power, k_b, k_t, n = floor.oracle_power(0.15, 0.05, icc, 0.05, seconds * 1.1, cluster, 20_000, seed=3)
    assert 0.78 <= power <= 0.92, (power, k_b, k_t, n)
    power, *_ = floor.oracle_power(0.15, 0.05, icc, 0.05, seconds * 0.8, cluster, 20_000, seed=3)
    assert power < 0.8


def test_at_icc_0_02_no_fixed_size_design_reaches_the_two_demands_together():
    """The seed story at ICC 0.02 on the real cluster's cost model: for a design whose size is fixed in
    advance, every zero arm under the ceiling plus HiCache's reduction at 80% power costs more than half
    the fixed design's GPU time (at ICC 0.005 it does not). Wald's mean-cost floor, which bounds adaptive
    designs too, is under half."""
    cluster = floor.Cluster()
    fixed = floor.fixed_design_s(5, 4, 60, cluster)

    def total(icc: float) -> float:
        zeros = 3 * floor.ceiling_floor_s(0.03, icc, 0.05, cluster)
        return zeros + floor.reduction_floor_s(0.15, 0.05, icc, 0.05, 0.8, cluster)

    assert total(0.02) > 0.5 * fixed
    assert total(0.005) < 0.5 * fixed
    mean = 3 * floor.ceiling_floor_s(0.03, 0.02, 0.05, cluster) + floor.reduction_mean_floor_s(
        0.15, 0.05, 0.02, 0.05, 0.8, cluster
    )
    assert mean < 0.5 * fixed


def test_an_adaptive_test_beats_the_fixed_sample_floor_but_not_walds():
    """An oracle SPRT on HiCache's reduction (the variances known, Wald's boundaries for alpha 0.05 and
    power 0.8, a look after every pair of starts of 120): its simulated level and power are about what it
    was built for, and its mean GPU time is under the fixed-sample floor (which therefore does not bound
    adaptive designs) and over Wald's mean-cost floor (which does)."""
    cluster, icc, alpha, power = floor.Cluster(), 0.02, 0.05, 0.8
    n, delta = 120, 0.10
    per_pair = 1 / floor.start_information(0.15, icc, n) + 1 / floor.start_information(0.05, icc, n)
    upper, lower = math.log(power / alpha), math.log((1 - power) / (1 - alpha))
    rng = np.random.default_rng(51)

    def run(mean: float, step: float, studies: int = 20_000) -> tuple[float, float]:
        """(power or size, mean pairs) with a look every `step` of a pair's information."""
        llr, pairs = np.zeros(studies), np.zeros(studies)
        open_ = np.ones(studies, dtype=bool)
        var = per_pair / step
        while open_.any():
            d = rng.normal(mean, math.sqrt(var), open_.sum())
            llr[open_] += (delta * d - delta**2 / 2) / var
            pairs[open_] += step
            open_ &= (llr < upper) & (llr > lower)
        return float(np.mean(llr >= upper)), float(pairs.mean())

    # looks after every quarter of a pair's evidence: near the continuous monitoring Wald's bound assumes
    size, _ = run(0.0, 0.25)
    got, mean_pairs = run(delta, 0.25)
    assert size <= alpha and got >= 0.78, (size, got)
    mean_s = mean_pairs * 2 * cluster.start_s(n)
    # the fixed z-test on the same starts needs this many pairs for the same power
    fixed_pairs = 2 * floor.fixed_nats(alpha, power) * per_pair / delta**2
    assert mean_pairs < 0.9 * fixed_pairs, (mean_pairs, fixed_pairs)
    assert mean_s > floor.reduction_mean_floor_s(0.15, 0.05, icc, alpha, power, cluster)
    assert floor.wald_nats(0.05, 0.8) == pytest.approx(1.906, abs=1e-3)
    # a look only after each whole pair of starts: each is about a nat of evidence, the overshoot eats the
    # gain, and the mean is no better than the fixed test's (at ICC 0.02 a start is a coarse unit)
    _, whole = run(delta, 1.0)
    assert whole > 0.95 * fixed_pairs, (whole, fixed_pairs)
