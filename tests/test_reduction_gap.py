"""bench/reduction_gap.py: the reduction e-value's numerators on simulated pairs. The oracle (the true
rates) is the most any numerator gets on average; the shipped paired reduction, which conditions the
baseline's rate away, is about the 2x2 probe it came from and above a mixture that knows the treatment's
rate but pays for the baseline's; the 2x2 test must also keep its error under the null."""

from __future__ import annotations

import numpy as np

from tests.conftest import script_module

gap = script_module("bench/reduction_gap.py", "reduction_gap")


def test_no_numerator_beats_the_oracle_and_the_shipped_reduction_is_the_2x2_probes_and_beats_paying_for_b():
    rng = np.random.default_rng(5)
    rows = np.array(
        [gap.numerators(gap.draw(rng, gap.BASELINE, 6), gap.draw(rng, gap.TREATMENT, 4)) for _ in range(60)]
    )
    shipped, oracle, b_known, t_known, plug, two_by_two = rows.mean(0)
    assert np.isfinite(rows).all()
    assert oracle > max(shipped, b_known, t_known, plug, two_by_two)
    assert abs(shipped - two_by_two) < 0.5
    assert shipped > max(t_known, plug)


def test_the_2x2_test_rarely_reaches_20_without_an_effect():
    # at ICC 0 the test is exact: Ville's inequality bounds the chance by 1/20 over every look
    rng = np.random.default_rng(3)
    for rate in (0.15, 0.03):
        assert gap.null_crossings(300, rate, 0.0, rng) <= 1 / 20
