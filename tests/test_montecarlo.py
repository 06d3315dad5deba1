"""The early-stopping Monte Carlo check (tests/montecarlo.py), itself checked by simulation: a rate at its
threshold is accepted early at most DELTA of the time, and one well under it settles in one batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests import montecarlo


def early_acceptances(rate: float, threshold: float, delta: float, checks: int, batch=250, batches=8) -> int:
    """Of `checks` checks on binomial batches at `rate`, how many accepted before their last batch."""
    rng = np.random.default_rng(7)
    early = 0
    for _ in range(checks):
        draws = rng.binomial(batch, rate, size=batches)
        check = montecarlo.rate_at_most(
            lambda i, draws=draws: (int(draws[i]), batch), threshold, batches, delta=delta
        )
        early += check.early
    return early


def test_a_rate_at_the_threshold_is_accepted_early_at_most_delta_of_the_time():
    # delta 0.05 (not the tests' 0.001) so that a breach would show in 2,000 checks
    checks, delta = 2000, 0.05
    early = early_acceptances(0.05, 0.05, delta, checks)
    assert early / checks <= delta + 3 * math.sqrt(delta * (1 - delta) / checks), early
    # and above the threshold, less still
    assert early_acceptances(0.07, 0.05, delta, 500) <= early_acceptances(0.05, 0.05, delta, 500)


def test_a_rate_well_under_the_threshold_settles_in_the_first_batch_and_says_how():
    check = montecarlo.rate_at_most(lambda i: (0, 250), 0.05, max_batches=8)
    assert (check.batches, check.trials, check.early) == (1, 250, True)
    assert check.upper < 0.05 and "accepted on its bound" in str(check)


def test_an_unsettled_rate_runs_every_batch_and_is_judged_on_its_point_estimate():
    seen = []

    def batch(i: int) -> tuple[int, int]:
        seen.append(i)
        return 12, 250  # 4.8%: under 5%, but its bound is not

    check = montecarlo.rate_at_most(batch, 0.05, max_batches=4)
    assert seen == [0, 1, 2, 3] and not check.early and check.rate == pytest.approx(0.048)
    assert "point estimate" in str(check)


def test_the_bound_is_the_exact_one_sided_clopper_pearson_one_at_delta_over_the_looks():
    # 0 of n: the bound solves (1 - u)^n = level, level = delta / looks
    check = montecarlo.rate_at_most(lambda i: (0, 250), 0.05, max_batches=8)
    assert check.upper == pytest.approx(1 - (montecarlo.DELTA / 8) ** (1 / 250))
    assert montecarlo.rate_at_most(lambda i: (5, 5), 0.05, max_batches=1).upper == 1.0
    assert montecarlo.rate_at_most(lambda i: (3, 100), 0.05, max_batches=1, delta=0.05).upper > 0.03
