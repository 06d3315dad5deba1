"""What the sequential design's reduction e-value leaves on the table for a moderate effect: its log e
against an oracle that knows both rates, and against half-oracles that know one of them, on the same
simulated pairs of arms (HiCache's 15% -> 5% at restart ICC 0.02, runs of 60, the baseline two starts
ahead, the dsv4 study's 3% ceiling). Not a timing: a statistics probe, through `sequential.evidence`
(what judges real runs) and the same likelihoods.

    python bench/reduction_gap.py [--pairs 200] [--seed 2]

Prints, per number of treatment starts: the mean log e-value of each numerator over the same
denominator (the sup of the likelihood over the null t >= b), and how often each reaches log 20 (what
a lone hypothesis needs at alpha 0.05). The columns:
- shipped: the pair mixture (`sequential.evidence`'s reduction: b log-uniform over [ceiling / 2, 0.99],
  t log-uniform within a factor 100 below b, half the weight on t ~ 0);
- oracle: the likelihood at the true (b, t) (no valid test knows them: the most any numerator gets);
- b known: t mixed below the true b, as the shipped prior mixes it; t known: b mixed as shipped;
- plug-in: each arm's next start predicted at its earlier starts' pooled rate ((k + 1/2) / (n + 1)), its
  first start by the shipped mixture (a valid e-process, the obvious learner of the rates).
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from orchestrator.analysis.sequential import FINE_GRID, GONE, MIX_GRID, _mix, evidence, run_loglik

BASELINE, TREATMENT, ICC, SESSIONS, CEILING = 0.15, 0.05, 0.02, 60, 0.03
THRESHOLD = math.log(20)


def draw(rng: np.random.Generator, rate: float, starts: int) -> list[list[int]]:
    """Beta-binomial starts, as the rehearsal draws them."""
    scale = (1 - ICC) / ICC
    rates = rng.beta(rate * scale, (1 - rate) * scale, size=starts)
    return [[int(rng.binomial(SESSIONS, q)), SESSIONS] for q in rates]


def point(runs: list[list[int]], rate: float) -> float:
    return float(run_loglik(runs, ("point", rate, 0.0), ICC)[0])


def plug_in(runs: list[list[int]], first_mask: np.ndarray, gone: bool) -> float:
    """The log predictive likelihood of an arm's starts, each at the pooled rate of the ones before it."""
    first = run_loglik(runs[:1], "mix", ICC)
    total = _mix(first, first_mask, run_loglik(runs[:1], ("point", GONE, 0.0), ICC) if gone else None)
    for i in range(1, len(runs)):
        k, n = sum(r[0] for r in runs[:i]), sum(r[1] for r in runs[:i])
        total += point(runs[i : i + 1], (k + 0.5) / (n + 1))
    return total


def numerators(base: list[list[int]], treat: list[list[int]]) -> tuple[float, ...]:
    """(shipped, oracle, b known, t known, plug-in) log e-values of the reduction claim."""
    lb, lt = run_loglik(base, "fine", ICC), run_loglik(treat, "fine", ICC)
    b_hat, t_hat = FINE_GRID[lb.argmax()], FINE_GRID[lt.argmax()]
    null_sup = float(lb.max() + lt.max()) if t_hat >= b_hat else float(np.max(lb + lt))
    shipped = evidence(base, treat, ICC, CEILING, 0.5).reduction
    below = (MIX_GRID < BASELINE) & (MIX_GRID > BASELINE / 100)
    t_mixed = _mix(run_loglik(treat, "mix", ICC), below)
    b_mixed = _mix(run_loglik(base, "mix", ICC), MIX_GRID >= CEILING / 2)
    b_true, t_true = point(base, BASELINE), point(treat, TREATMENT)
    plug = plug_in(base, MIX_GRID >= CEILING / 2, False) + plug_in(treat, np.ones(len(MIX_GRID), bool), True)
    return (
        shipped,
        b_true + t_true - null_sup,
        b_true + t_mixed - null_sup,
        b_mixed + t_true - null_sup,
        plug - null_sup,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    names = ("shipped", "oracle", "b known", "t known", "plug-in")
    print(f"{args.pairs} pairs a row; mean log e (share reaching log 20)")
    print("| treatment starts | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for starts in (2, 3, 4, 6):
        rows = np.array(
            [
                numerators(draw(rng, BASELINE, starts + 2), draw(rng, TREATMENT, starts))
                for _ in range(args.pairs)
            ]
        )
        cells = [f"{m:.2f} ({p:.0%})" for m, p in zip(rows.mean(0), (rows >= THRESHOLD).mean(0), strict=True)]
        print(f"| {starts} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
