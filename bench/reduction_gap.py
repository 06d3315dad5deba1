"""What the sequential design's reduction e-value leaves on the table for a moderate effect: its log e
against an oracle that knows both rates, and against half-oracles that know one of them, on the same
simulated pairs of arms (HiCache's 15% -> 5% at restart ICC 0.02, runs of 60, the baseline two starts
ahead, the dsv4 study's 3% ceiling). Not a timing: a statistics probe, through `sequential.evidence`
(what judges real runs) and the same likelihoods.

    python bench/reduction_gap.py [--pairs 200] [--seed 2] [--null 1000]

Prints, per number of treatment starts: the mean log e-value of each numerator over the same
denominator (the sup of the likelihood over the null t >= b), and how often each reaches log 20 (what
a lone hypothesis needs at alpha 0.05). The columns:
- shipped: the paired reduction (`sequential.evidence`'s reduction since issue 51: the rounds both arms
  ran, each conditioned on its corrupted sessions so the baseline's rate drops out, effective counts at
  the ICC, a prior aimed at the design effect; the 2x2 column's idea, shipped);
- oracle: the likelihood at the true (b, t) (no valid test knows them: the most any numerator gets);
- b known: t mixed below the true b, as the pair mixture (the reduction shipped before issue 51, still
  the "increase" claim's) mixes it; t known: b mixed as that mixture mixes it;
- plug-in: each arm's next start predicted at its earlier starts' pooled rate ((k + 1/2) / (n + 1)), its
  first start by the pair mixture (a valid e-process, the obvious learner of the rates);
- 2x2: a safe test of the 2x2 tables, one per round (the treatment's start and the baseline's of the same
  round), each conditioned on its total, so the baseline's rate drops out: the product over rounds of
  Fisher's noncentral hypergeometric likelihood ratios, mixed over the odds ratio (log-uniform on
  [0.01, 1), half the weight near 0). On effective counts (each start's counts over its design effect at
  the true ICC, rounded), so only approximately valid with restart variation, and the baseline's two
  starts ahead carry nothing. The probe that led to the shipped test.

`--null N`: N simulated pairs with no effect (b = t, at 15% and 3%; ICC 0, 0.02, 0.1), and how often the
2x2 test's e-value ever reaches 20 within 6 rounds, looked at after each (what Ville's inequality bounds
by 1/20 when the test is valid; at ICC 0 it is exact, otherwise it rests on the effective counts).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy.special import gammaln

from orchestrator.analysis.sequential import FINE_GRID, GONE, MIX_GRID, _mix, evidence, run_loglik
from orchestrator.study.rehearse import ArmTruth, draw_counts

BASELINE, TREATMENT, ICC, SESSIONS, CEILING = 0.15, 0.05, 0.02, 60, 0.03
THRESHOLD = math.log(20)


def draw(rng: np.random.Generator, rate: float, starts: int, icc: float = ICC) -> list[list[int]]:
    """Beta-binomial starts of SESSIONS, drawn by the rehearsal's own `draw_counts` (binomial at ICC 0)."""
    counts = draw_counts([ArmTruth("pair", {}, rate, icc)], starts, SESSIONS, 1, rng)[0, 0]
    return [[int(k), SESSIONS] for k in counts]


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


# the 2x2 test's prior over the odds ratio: log-uniform below 1, and half the weight near 0 (gone)
ODDS = np.geomspace(0.01, 0.99, 64)
ODDS_GONE = 1e-3


def _log_binom(n: int, k: np.ndarray) -> np.ndarray:
    return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)


def _conditional_loglik(x: int, n_treat: int, n_base: int, total: int, odds: np.ndarray) -> np.ndarray:
    """log P(treatment count = x | the table's total) under Fisher's noncentral hypergeometric law."""
    support = np.arange(max(0, total - n_base), min(n_treat, total) + 1)
    weights = _log_binom(n_treat, support) + _log_binom(n_base, total - support)
    logs = weights[None, :] + np.log(odds)[:, None] * support[None, :]
    top = logs.max(axis=1, keepdims=True)
    norm = top[:, 0] + np.log(np.exp(logs - top).sum(axis=1))
    return (
        _log_binom(n_treat, np.array(x)) + _log_binom(n_base, np.array(total - x)) + np.log(odds) * x - norm
    )


def safe_2x2(base: list[list[int]], treat: list[list[int]], icc: float = ICC) -> float:
    """The 2x2 test's log e-value (module doc), rounds paired in order, counts over the design effect at
    `icc`."""
    deff = 1 + (SESSIONS - 1) * icc
    odds = np.append(ODDS, [ODDS_GONE, 1.0])  # the prior's points, then the null's (no effect)
    total = np.zeros(len(odds))
    for (kb, nb), (kt, nt) in zip(base, treat, strict=False):
        kb_e, nb_e, kt_e, nt_e = (round(v / deff) for v in (kb, nb, kt, nt))
        total += _conditional_loglik(kt_e, nt_e, nb_e, kt_e + kb_e, odds)
    ratio = total[:-1] - total[-1]
    return _mix(ratio[:-1], np.ones(len(ODDS), bool), ratio[-1:])


def numerators(base: list[list[int]], treat: list[list[int]]) -> tuple[float, ...]:
    """(shipped, oracle, b known, t known, plug-in, 2x2) log e-values of the reduction claim."""
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
        safe_2x2(base[2:], treat),
    )


def null_crossings(pairs: int, rate: float, icc: float, rng: np.random.Generator, rounds: int = 6) -> float:
    """How often the 2x2 test's e-value ever reaches 20 within `rounds` rounds when b = t = `rate`."""
    hits = 0
    for _ in range(pairs):
        base, treat = draw(rng, rate, rounds, icc), draw(rng, rate, rounds, icc)
        hits += max(safe_2x2(base[:r], treat[:r], icc) for r in range(1, rounds + 1)) >= THRESHOLD
    return hits / pairs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--null", type=int, default=0, help="pairs per null cell (0: none)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    names = ("shipped", "oracle", "b known", "t known", "plug-in", "2x2")
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
    if args.null:
        print()
        print(f"no effect, {args.null} pairs a cell: how often the 2x2 test ever reaches 20 within 6 rounds")
        print("| ICC | b = t = 15% | b = t = 3% |")
        print("|---|---|---|")
        for icc in (0.0, 0.02, 0.1):
            cells = [f"{null_crossings(args.null, rate, icc, rng):.3f}" for rate in (0.15, 0.03)]
            print(f"| {icc:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
