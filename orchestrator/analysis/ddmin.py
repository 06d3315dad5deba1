"""Delta debugging over a configuration diff, with a noisy oracle (pure).

The question: "it works with last month's serve script and not with this one". The study names the
differences (`study.ddmin.differences`: each an id and what it sets per role, env vars and flags, the
shape of a factor level); the good configuration is the job's deployment and factor levels, the bad one
is the good one with every difference applied. `hydra.sweeper.design=ddmin` then searches for a
1-minimal subset of differences that still brings the corruption: removing any one of its differences
removes it.

The search is in the spirit of Zeller and Hildebrandt's ddmin (2002), as adaptive group testing:
Junker's QuickXplain (2004) splits the candidates in two and finds what the second half must add to
the first, then what the first must add to that (about 2k log2(n/k) + 2k subsets for k needed
differences of n; ddmin's chunks and complements ask for about twice as many once the needed ones fall
in different chunks, and here every subset costs server starts); then, as ddmin ends, each difference
found is removed in turn, so the answer is 1-minimal whatever the form of the cause. Its oracle is a
server start that may or may not show a rare bug, so each subset tried is an arm (good + subset, each
difference a two-level factor `good`/`bad`) whose verdict comes from its runs, by the sequential
machinery (`sequential.evidence`: the `over` and `under` e-values against the study's ceiling, on
beta-binomial runs with the study's ICC):
- corrupting: the rate is above the ceiling (e-value of `over` >= 1 / alpha_j);
- clean: the rate is under the ceiling (`under` >= 1 / alpha_j);
- undecided after `study.stopping.max_runs_per_arm` runs: taken the way its evidence leans (the larger
  of the two e-values), and reported: the error bound then no longer covers the answer.
No verdict before `study.stopping.min_runs_per_arm` runs (one start cannot show the restart variation).

Error rate: the j-th subset the search asks about is tested at alpha_j (`test_alpha`), planned from the
number of differences n before any run. A search over n differences, two of which corrupt only together,
asks about J = planned_tests(n) subsets on average (15 of 20); each of the first J gets alpha / (J + 1),
and the last share is spread over any further ones as alpha / (i (i + 1)) spreads alpha. These sum to
alpha over any number of tests. Why plan for two: a subset's threshold is log(1 / alpha_j), so planning
for more tests than come costs little on each (one culprit of 20 asks about 8-9 subsets: log(16 / 9),
under a quarter of a clean run's evidence), while each test past the plan pays log(i (i + 1)) more, and
three that corrupt together ask about 19 of 20. (alpha / (j (j + 1)), spent from the first subset on,
gave the 15th alpha / 240: 2.7 nats more to reach than alpha / 16, about one clean run's evidence.) Each
verdict is an anytime-valid test (Ville's inequality), so the chance that any verdict of the whole search
is wrong is at most alpha (for the ICC used), and when every verdict is right ddmin's answer is exactly
1-minimal; when the corruption needs one conjunction of differences, that is the true minimal set.

Arms already run are reused: the search is a pure function of every run so far (`search`), replayed
from the start at each look, so a resumed study, or a subset the search asks about twice, spends
nothing twice. Before the search, the good configuration must be clean and the bad one corrupting;
after it, the configuration to deploy (the bad one minus the minimal set) is tried too: if it still
corrupts, the bad configuration has another cause as well, and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.analysis.sequential import Evidence, evidence, plug_in_icc
from orchestrator.config.plan import BAD, GOOD, difference_label

CORRUPTING, CLEAN, UNDECIDED = "corrupting", "clean", "undecided"

# what a fixed one-at-a-time sweep over the differences would give each arm (the dsv4 study's starts)
ONE_AT_A_TIME_STARTS = 4

Subset = frozenset[str]
Runs = Sequence[Sequence[int]]


def one_at_a_time_sessions(differences: int, run_size: int) -> int:
    """What a fixed one-at-a-time sweep over the differences spends: the bad configuration and one arm
    per difference removed, ONE_AT_A_TIME_STARTS starts each."""
    return (differences + 1) * ONE_AT_A_TIME_STARTS * run_size


# the search plans its alpha for this many differences that corrupt only together (module doc: why two)
PLANNED_NEEDED = 2


def planned_tests(differences: int) -> int:
    """How many subsets the search is expected to ask about over this many differences when
    PLANNED_NEEDED of them corrupt only together, averaged over where they sit: the bad, deploy and good
    checks, QuickXplain's subsets (about k (1.45 log2(n / k) + 0.7) for k needed differences of n, with
    an exact oracle: fewer than Junker's bound 2k log2(n / k) + 2k) and the one one-minimality removal
    QuickXplain has not asked about already. Within 0.2 of an exact oracle's average for 3 to 200
    differences (tests/test_ddmin.py measures it)."""
    k = PLANNED_NEEDED
    n = max(differences, k)
    return round(4 + k * (1.45 * math.log2(n / k) + 0.7))


def test_alpha(alpha: float, differences: int, index: int) -> float:
    """The error rate the index-th subset tried (1-based) is tested at, planned before any run: J + 1
    equal shares of alpha for J = planned_tests(differences), one for each of the first J subsets and
    the last spread over any further ones as alpha / (i (i + 1)) spreads alpha over the i-th. These sum
    to alpha over any number of tests, and never increase with the index."""
    planned = planned_tests(differences)
    share = alpha / (planned + 1)
    if index <= planned:
        return share
    extra = index - planned
    return share / (extra * (extra + 1))


def levels_of(subset: Subset, ids: Sequence[str]) -> dict[str, str]:
    """The factor levels of the arm that applies `subset` (every other difference at `good`)."""
    return {d: (BAD if d in subset else GOOD) for d in ids}


def subset_of(factors: Mapping[str, str], ids: Sequence[str]) -> Subset:
    """The differences a run applied, from its factor levels."""
    return frozenset(d for d in ids if factors.get(d) == BAD)


def describe_subset(subset: Subset, ids: Sequence[str]) -> str:
    """ "good" (none applied), "bad" (every difference), "bad -c" or "+a +b" (plan.difference_label)."""
    return difference_label(sorted(subset), ids)


def verdict_of(
    runs: Runs, icc: float, ceiling: float, log_threshold: float, min_runs: int, max_runs: int
) -> tuple[str | None, Evidence]:
    """A subset's verdict from its runs (None: run it again) and the evidence behind it."""
    ev = evidence((), runs, icc, ceiling, 0.0)
    if len(runs) < min_runs:
        return None, ev
    if ev.over >= log_threshold:
        return CORRUPTING, ev
    if ev.under >= log_threshold:
        return CLEAN, ev
    if len(runs) >= max_runs:
        return UNDECIDED, ev
    return None, ev


@dataclass(frozen=True)
class Trial:
    """One subset the search asked about: its verdict (None: still running) and the evidence."""

    index: int
    subset: Subset
    role: str  # "good", "bad", "search" or "deploy"
    alpha: float
    runs: tuple[tuple[int, int], ...]
    verdict: str | None
    evidence: Evidence


@dataclass(frozen=True)
class Search:
    """Where the search stands: the trials so far in the order asked, the subset it needs a verdict for
    next (None: done), and once done the minimal set, the configuration to deploy and why it ended."""

    trials: list[Trial]
    need: Subset | None
    minimal: Subset | None = None
    deploy: Subset | None = None
    outcome: str = ""
    steps: list[str] = field(default_factory=list)
    icc: float = 0.0


class _Need(Exception):
    def __init__(self, subset: Subset):
        super().__init__(sorted(subset))
        self.subset = subset


def split(items: Sequence[str], n: int) -> list[list[str]]:
    """`items` in n contiguous chunks whose sizes differ by at most one (the larger first)."""
    size, extra = divmod(len(items), n)
    chunks, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return [c for c in chunks if c]


def quickxplain(
    items: Sequence[str], corrupts: Callable[[Subset], bool], note: Callable[[str], None]
) -> list[str]:
    """A minimal subset of `items` (which corrupt together; none of them, nothing) by divide and conquer
    (Junker's QuickXplain, 2004: adaptive group testing): split the candidates in two, find what the
    second half must add to the first, then what the first must add to that. About 2k log2(n/k) + 2k
    subsets for k needed differences of n (ddmin's chunk-and-complement search asks for about twice as
    many once the needed ones are split across chunks, and each subset costs server starts here).
    Minimal when the corruption needs one conjunction of differences; `one_minimal` checks the rest."""

    def qx(base: list[str], added: bool, candidates: list[str]) -> list[str]:
        if added and corrupts(frozenset(base)):
            note(f"{{{', '.join(base)}}} corrupts without {{{', '.join(candidates)}}}: those are not needed")
            return []
        if len(candidates) == 1:
            note(f"{candidates[0]} is needed: {{{', '.join(base)}}} corrupts only with it")
            return candidates
        first, second = split(candidates, 2)
        found_second = qx(base + first, bool(first), second)
        found_first = qx(base + found_second, bool(found_second), first)
        return [d for d in items if d in set(found_first) | set(found_second)]

    return qx([], False, list(items))


def one_minimal(
    found: Sequence[str], corrupts: Callable[[Subset], bool], note: Callable[[str], None]
) -> list[str]:
    """`found` made 1-minimal: each difference in turn is removed, and dropped for good where the rest
    still corrupts (as ddmin's last step). With one conjunction this only confirms each is necessary."""
    current = list(found)
    if len(current) < 2:
        return current
    for d in list(current):
        rest = [x for x in current if x != d]
        if rest and corrupts(frozenset(rest)):
            note(f"without {d} it still corrupts: {d} dropped")
            current = rest
        else:
            note(f"without {d} the corruption is gone: {d} is necessary")
    return current


@dataclass(frozen=True)
class Settings:
    """What the search needs of the study: its error rate, ceiling, ICC floor and run budget per arm."""

    alpha: float
    ceiling: float
    assumed_icc: float = 0.0
    min_runs: int = 2
    max_runs: int = 6

    @classmethod
    def of(cls, spec: Any) -> Settings:
        return cls(
            float(spec.alpha),
            float(spec.ceiling),
            float(spec.assumed_icc),
            int(spec.stopping.min_runs_per_arm),
            int(spec.stopping.max_runs_per_arm),
        )


def study_icc(runs_by_subset: Mapping[Subset, Runs], assumed: float) -> float:
    """The ICC the verdicts use: estimated from every arm's runs (as the other designs do), never
    below the study's assumed one."""
    return plug_in_icc(list(runs_by_subset.values()), assumed)


def search(ids: Sequence[str], runs_by_subset: Mapping[Subset, Runs], settings: Settings) -> Search:
    """Replay the search on the runs so far (module doc): the verdict of every subset asked about, and
    the next subset needing runs, or the answer."""
    icc = study_icc(runs_by_subset, settings.assumed_icc)
    trials: list[Trial] = []
    steps: list[str] = []
    asked: dict[Subset, Trial] = {}

    def oracle(subset: Subset, role: str = "search") -> bool:
        if subset not in asked:
            index = len(asked) + 1
            alpha_j = test_alpha(settings.alpha, len(ids), index)
            runs = tuple(tuple(int(x) for x in r) for r in runs_by_subset.get(subset, ()))
            verdict, ev = verdict_of(
                runs, icc, settings.ceiling, math.log(1 / alpha_j), settings.min_runs, settings.max_runs
            )
            trial = Trial(index, subset, role, alpha_j, runs, verdict, ev)
            asked[subset] = trial
            trials.append(trial)
        trial = asked[subset]
        if trial.verdict is None:
            raise _Need(subset)
        if trial.verdict == UNDECIDED:  # the budget is spent: go the way the evidence leans (reported)
            return trial.evidence.over > trial.evidence.under
        return trial.verdict == CORRUPTING

    everything = frozenset(ids)
    try:
        if oracle(frozenset(), "good"):
            return Search(
                trials, None, outcome="the good configuration corrupts too: nothing to search", icc=icc
            )
        if not oracle(everything, "bad"):
            return Search(
                trials,
                None,
                outcome="the bad configuration does not corrupt here: nothing to search",
                icc=icc,
            )
        minimal = frozenset(one_minimal(quickxplain(list(ids), oracle, steps.append), oracle, steps.append))
        deploy = everything - minimal
        if oracle(deploy, "deploy"):
            outcome = (
                "minimal set found, but the bad configuration without it still corrupts: it has another "
                "cause too (run the search again from the configuration to deploy)"
            )
        else:
            outcome = "minimal set found; the bad configuration without it is clean"
        return Search(trials, None, minimal, deploy, outcome, steps, icc)
    except _Need as need:
        return Search(trials, need.subset, steps=steps, icc=icc)


def error_bound(result: Search) -> tuple[float, str]:
    """The chance that some verdict of the search is wrong (the sum of the alphas spent), and whether
    the bound covers the answer (not when a verdict was left undecided)."""
    spent = sum(t.alpha for t in result.trials)
    undecided = [t for t in result.trials if t.verdict == UNDECIDED]
    if undecided:
        return spent, f"not covered: {len(undecided)} subset(s) undecided within the run budget"
    return spent, "covers the answer"


def next_repetition(started: set[int] | frozenset[int]) -> int:
    """The repetition a subset's next run gets: one past every one started (finished or not)."""
    return max(started) + 1 if started else 0


def runs_from_records(
    records: Sequence[Any], ids: Sequence[str], used: Callable[[Any], bool]
) -> tuple[dict[Subset, list[tuple[int, int]]], dict[Subset, set[int]]]:
    """From a study's runs (`analysis.RunRecord`): per subset, the pooled runs' counts (by repetition)
    and every repetition started (a killed run's too: its repetition is not run again)."""
    counts: dict[Subset, dict[int, tuple[int, int]]] = {}
    started: dict[Subset, set[int]] = {}
    for r in records:
        subset = subset_of(r.factors, ids)
        started.setdefault(subset, set()).add(r.repetition)
        if used(r):
            counts.setdefault(subset, {})[r.repetition] = (r.corrupted, r.corrupted + r.clean)
    runs = {s: [c for _, c in sorted(by_rep.items())] for s, by_rep in counts.items()}
    return runs, started


@dataclass(frozen=True)
class Round:
    """The jobs of the next round: (subset, repetition, with the throughput sweep) each; empty: done."""

    jobs: list[tuple[Subset, int, bool]]
    result: Search


def next_round(
    ids: Sequence[str],
    runs: Mapping[Subset, Runs],
    started: Mapping[Subset, set[int]],
    settings: Settings,
) -> Round:
    """What the sweeper launches next. A subset new to the search starts its first min_runs runs at
    once (no verdict comes sooner). The throughput sweep rides on the good configuration's first run
    and on the first run of the configuration to deploy, beside which the good one runs again, so the
    ratio compares sweeps run side by side."""
    result = search(ids, runs, settings)
    if result.need is None:
        return Round([], result)
    need, role = result.need, result.trials[-1].role
    have = started.get(need, set())
    first = next_repetition(have)
    count = max(1, settings.min_runs) if not have else 1  # a new subset: no verdict before min_runs
    fresh = not have
    jobs = [(need, first + i, fresh and i == 0 and role in ("good", "deploy")) for i in range(count)]
    if fresh and role == "deploy" and need:
        jobs.append((frozenset(), next_repetition(started.get(frozenset(), set())), True))
    return Round(jobs, result)


def search_block(spec: Any, records: Sequence[Any], used: Callable[[Any], bool]) -> dict[str, Any]:
    """report.json's `ddmin` block: the differences, every subset tried (in order) with its runs,
    verdict and evidence against its threshold, the steps of the search, the minimal set, the
    configuration to deploy, the error bound, and the sessions spent against a one-at-a-time sweep."""
    ids = [d.id for d in spec.ddmin.differences]
    settings = Settings.of(spec)
    runs, started = runs_from_records(records, ids, used)
    result = search(ids, runs, settings)
    bound, covered = error_bound(result)
    spent = sum(n for rs in runs.values() for _, n in rs)
    sizes = [n for rs in runs.values() for _, n in rs]
    run_size = round(sum(sizes) / len(sizes)) if sizes else 0
    planned = planned_tests(len(ids))
    return {
        "method": (
            "adaptive group testing (QuickXplain, then ddmin's 1-minimal check), each subset judged by "
            "anytime-valid e-values against the ceiling on beta-binomial runs; the j-th subset at "
            f"alpha / {planned + 1} for the first {planned} (planned from the number of differences), one "
            f"more share of alpha / {planned + 1} spread over any further j as alpha / (i (i + 1)) with "
            f"i = j - {planned} (orchestrator/analysis/ddmin.py)"
        ),
        "differences": [
            {"id": d.id, "description": d.description, "sets": difference_settings(d)}
            for d in spec.ddmin.differences
        ],
        "icc": result.icc,
        "trials": [
            {
                "index": t.index,
                "subset": [d for d in ids if d in t.subset],
                "label": describe_subset(t.subset, ids),
                "role": t.role,
                "alpha": t.alpha,
                "log_threshold": math.log(1 / t.alpha),
                "runs": [list(r) for r in t.runs],
                "corrupted": sum(k for k, _ in t.runs),
                "sessions": sum(n for _, n in t.runs),
                "verdict": t.verdict,
                "evidence": {"over": round(t.evidence.over, 4), "under": round(t.evidence.under, 4)},
            }
            for t in result.trials
        ],
        "steps": result.steps,
        "done": result.need is None,
        "waiting_for": None if result.need is None else [d for d in ids if d in result.need],
        "minimal": None if result.minimal is None else [d for d in ids if d in result.minimal],
        "deploy": None if result.deploy is None else [d for d in ids if d in result.deploy],
        "outcome": result.outcome or "the search stopped before it ended",
        "error_bound": bound,
        "error_bound_covers": covered,
        "sessions": spent,
        "one_at_a_time_sessions": one_at_a_time_sessions(len(ids), run_size),
        "runs_started": sum(len(s) for s in started.values()),
    }


def difference_settings(difference: Any) -> dict[str, dict[str, Any]]:
    """What a difference sets, per role ({role: {"env NAME": value, "flag --x": value}}), for reports."""
    out: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode", "router"):
        delta = getattr(difference.roles, role)
        sets = {f"env {k}": str(v) for k, v in delta.env.items()}
        sets |= {f"flag {k}": v for k, v in delta.flags.items()}
        if sets:
            out[role] = sets
    return out
