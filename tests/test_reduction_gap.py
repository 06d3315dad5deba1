"""bench/reduction_gap.py: the reduction e-value's numerators on simulated pairs. The oracle (the true
rates) is the most any numerator gets on average; the shipped mixture and the half-oracles sit under it."""

from __future__ import annotations

import numpy as np

from tests.conftest import script_module

gap = script_module("bench/reduction_gap.py", "reduction_gap")


def test_no_numerator_beats_the_oracle_on_average_and_each_half_oracle_beats_the_shipped_mixture():
    rng = np.random.default_rng(5)
    rows = np.array(
        [gap.numerators(gap.draw(rng, gap.BASELINE, 6), gap.draw(rng, gap.TREATMENT, 4)) for _ in range(60)]
    )
    shipped, oracle, b_known, t_known, plug = rows.mean(0)
    assert np.isfinite(rows).all()
    assert oracle > max(shipped, b_known, t_known, plug)
    # knowing either rate is worth something over mixing over both
    assert min(b_known, t_known) > shipped
