"""bench/gpu_time_floor.py: the least GPU time any design can spend on the seed story's verdicts. Its two
bounds are checked here by simulation of the model the rehearsal draws from (beta-binomial starts), so a
wrong formula shows as a bound that is not tight or not a bound."""

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


def test_at_icc_0_02_no_design_reaches_the_issues_two_demands_together():
    """The seed story at ICC 0.02 on the real cluster's cost model: every zero arm under the ceiling plus
    HiCache's reduction at 80% power costs more than half the fixed design's GPU time (at ICC 0.005 it
    does not)."""
    cluster = floor.Cluster()
    fixed = floor.fixed_design_s(5, 4, 60, cluster)

    def total(icc: float) -> float:
        zeros = 3 * floor.ceiling_floor_s(0.03, icc, 0.05, cluster)
        return zeros + floor.reduction_floor_s(0.15, 0.05, icc, 0.05, 0.8, cluster)

    assert total(0.02) > 0.5 * fixed
    assert total(0.005) < 0.5 * fixed
