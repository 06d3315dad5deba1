"""A Monte Carlo check of "this rate is at most a threshold" that stops once the answer is clear (test
infrastructure).

The statistical tests check a promise such as "the family-wise error is at most alpha" by simulating
studies through the code that judges real runs. A fixed number of studies spends as much on a design
whose error is a tenth of alpha as on one at alpha. Here the studies come in batches, each with a seed
of its own; after each batch an exact one-sided bound is taken on the rate so far:
- the exact (Clopper-Pearson) upper bound at level DELTA / looks under the threshold: accepted there.
  Over all the looks (Bonferroni), a rate above the threshold is accepted early with probability at most
  DELTA;
- otherwise the next batch runs, and after the last one the rate is judged on its point estimate, as a
  fixed-size check of that many studies would judge it.
So the check is never weaker than the fixed-size one it replaces, and a design well inside its promise
settles in a fraction of the studies (the dsv4 null models: 250 to 750 of 1,000 to 2,000).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.analysis import stats

DELTA = 1e-3  # the chance, over all the looks, that a rate above the threshold is accepted early


@dataclass(frozen=True)
class RateCheck:
    events: int
    trials: int
    batches: int
    upper: float  # the exact one-sided upper bound of the last look, at level DELTA / looks
    early: bool  # accepted on the bound before the last batch

    @property
    def rate(self) -> float:
        return self.events / self.trials

    def __str__(self) -> str:
        how = "accepted on its bound" if self.early else "judged on its point estimate"
        return (
            f"{self.events}/{self.trials} = {self.rate:.4f} after {self.batches} batch(es), "
            f"upper bound {self.upper:.4f}: {how}"
        )


def rate_at_most(
    batch: Callable[[int], tuple[int, int]], threshold: float, max_batches: int, delta: float = DELTA
) -> RateCheck:
    """Runs `batch(i)` (i = 0, 1, ...; its events and trials, drawn with a seed of batch i's own) until the
    rate's upper bound is under `threshold`, or `max_batches` have run. The caller asserts
    `check.rate <= threshold` (true at once where the bound settled it)."""
    # one-sided at delta / max_batches: the upper limit of the two-sided interval at twice that
    confidence = 1 - 2 * delta / max_batches
    events = trials = 0
    for i in range(max_batches):
        k, n = batch(i)
        events, trials = events + k, trials + n
        upper = stats.upper_bound(events, trials, confidence)
        if upper < threshold:
            return RateCheck(events, trials, i + 1, upper, early=i + 1 < max_batches)
    return RateCheck(events, trials, max_batches, upper, early=False)
