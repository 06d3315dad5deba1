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
difference a two-level factor `good`/`bad`).

Steer, then check. A search asks about a dozen subsets (15 of 20 for two differences that corrupt
together), and testing each at its share of alpha makes every one of them pay for the multiplicity: at
alpha / 16 a subset needs 5.8 nats, which two clean starts of 60 do not give at the built-in model's ICC
(5.2), so most took three or four starts. Yet the answer rests on a few claims only. So:
- **the good and bad configurations are checked first** (the search's premises: clean, corrupting);
- **the steering** asks QuickXplain's subsets one start at a time and acts on a subset's lean once its
  likelihood ratio against the ceiling reaches 10 (`steer_of`: one clean start of 60 does, as does one
  with 8 corrupted of 60 at a 5% ceiling); a lean is never a verdict, it only chooses what to ask next;
- **the answer is checked on fresh runs**: the candidate corrupts, it is clean without any one of its
  differences (each is necessary), and the configuration to deploy (the bad one without it), either
  way. A check's runs are started after its candidate was chosen (attempt v's runs are repetitions
  v * ATTEMPT_BLOCK onwards, a block of their own), so what chose the candidate cannot bias them, and
  each check is an anytime-valid test of a fixed claim (`sequential.evidence`: the `over` and `under`
  e-values against the study's ceiling, on beta-binomial runs with the study's ICC):
  corrupting (over >= 1 / alpha_j), clean (under >= 1 / alpha_j), or, after
  `study.stopping.max_runs_per_arm` runs, taken the way its evidence leans and reported (the error bound
  then no longer covers the answer); none before two runs (or `study.stopping.min_runs_per_arm`, if more).
- A check that contradicts its candidate (a necessary difference is not, the candidate is clean) fails
  the attempt; its runs then steer the next one, whose candidate is checked on a new block. At most
  MAX_ATTEMPTS candidates are checked.

Error rate: the j-th check is tested at alpha_j (`test_alpha`), planned before any run: a two-difference
answer takes PLANNED_CHECKS = 6 checks (good, bad, candidate, the candidate without each of its two,
deploy), each at alpha / 7, and the last share is spread over any further checks (a larger answer, a
failed attempt) as alpha / (i (i + 1)) spreads alpha. These sum to alpha over any number of checks, so
the chance that any check of the search is wrong is at most alpha (for the ICC used), whatever the
steering did; a wrong lean costs starts, never a wrong answer. When every check is right the answer
is 1-minimal and corrupts, and when the corruption needs one conjunction of differences it is the true
minimal set. At alpha / 7 a check needs 4.9 nats: two clean starts of 60 give 5.2 at ICC 0.005.

Arms already run are reused: the search is a pure function of every run so far (`search`), replayed
from the start at each look, so a resumed study spends nothing twice; the steering reads each subset's
steering runs in order and only as many as its lean needs, so an attempt's candidate never changes with
runs started after it. If the bad configuration without the minimal set still corrupts, it has another
cause as well, and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.analysis.result import DdminSearch, DifferenceRow, TrialEvidence
from orchestrator.analysis.result import Trial as TrialRow  # a trial as the report lists it
from orchestrator.analysis.sequential import FINE_GRID, Evidence, evidence, plug_in_icc, run_loglik
from orchestrator.config.plan import BAD, GOOD, difference_label

# attempt v's checks run repetitions v * ATTEMPT_BLOCK onwards: fresh runs (plan.py says why)
from orchestrator.config.plan import DDMIN_ATTEMPT_BLOCK as ATTEMPT_BLOCK

CORRUPTING, CLEAN, UNDETERMINED = "corrupting", "clean", "undetermined"

# what a fixed one-at-a-time sweep over the differences would give each arm (the dsv4 study's starts)
ONE_AT_A_TIME_STARTS = 4

Subset = frozenset[str]
Runs = Sequence[Sequence[int]]


def one_at_a_time_sessions(differences: int, run_size: int) -> int:
    """What a fixed one-at-a-time sweep over the differences spends: the bad configuration and one arm
    per difference removed, ONE_AT_A_TIME_STARTS starts each."""
    return (differences + 1) * ONE_AT_A_TIME_STARTS * run_size


# the answer's checks are planned for this many differences that corrupt only together (module doc)
PLANNED_NEEDED = 2
# the checks of an answer: the good and bad configurations, the candidate, the candidate without each of
# its PLANNED_NEEDED differences, and the configuration to deploy
PLANNED_CHECKS = 4 + PLANNED_NEEDED
# candidates checked before the search gives up (each failed check is steering evidence for the next)
MAX_ATTEMPTS = 3
# the steering acts on a lean this strong: a likelihood ratio of 10 (the rate's maximum against the
# ceiling); it decides only which subset is asked next, never a verdict
STEER_LOG_RATIO = math.log(10)

STEER = "steer"


def test_alpha(alpha: float, index: int) -> float:
    """The error rate of the index-th check (1-based) of the search, planned before any run: PLANNED_CHECKS
    + 1 equal shares of alpha, one for each of the first PLANNED_CHECKS checks and the last spread over any
    further ones as alpha / (i (i + 1)) spreads alpha over the i-th. These sum to alpha over any number
    of checks, and never increase with the index."""
    share = alpha / (PLANNED_CHECKS + 1)
    if index <= PLANNED_CHECKS:
        return share
    extra = index - PLANNED_CHECKS
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


def block_of(repetition: int) -> int:
    """The attempt a run belongs to (0: the good and bad checks and the steering)."""
    return repetition // ATTEMPT_BLOCK


def verdict_of(
    runs: Runs, icc: float, ceiling: float, log_threshold: float, min_runs: int, max_runs: int
) -> tuple[str | None, Evidence]:
    """A check's verdict from its runs (None: run it again) and the evidence behind it."""
    ev = evidence((), runs, icc, ceiling, 0.0)
    if len(runs) < min_runs:
        return None, ev
    if ev.over >= log_threshold:
        return CORRUPTING, ev
    if ev.under >= log_threshold:
        return CLEAN, ev
    if len(runs) >= max_runs:
        return UNDETERMINED, ev
    return None, ev


def steer_of(runs: Runs, icc: float, ceiling: float) -> tuple[str | None, Evidence]:
    """The steering's lean on a subset from its runs (None: not strong enough yet): the log likelihood
    ratio of the rate's maximum against the ceiling, on the side the maximum lies (module doc)."""
    if not runs:
        return None, Evidence()
    fine = run_loglik(runs, "fine", icc)
    top, rate = float(fine.max()), float(FINE_GRID[fine.argmax()])
    at_ceiling = float(run_loglik(runs, ("point", ceiling, 0.0), icc)[0])
    ratio = max(0.0, top - at_ceiling)
    ev = Evidence(over=ratio) if rate > ceiling else Evidence(under=ratio)
    if ev.over >= STEER_LOG_RATIO:
        return CORRUPTING, ev
    if ev.under >= STEER_LOG_RATIO:
        return CLEAN, ev
    return None, ev


@dataclass(frozen=True)
class Trial:
    """One question the search asked of a subset: a check (its verdict at its own alpha, None while it
    runs) or a steering lean (role "steer", alpha 0: it only chooses what to ask next)."""

    index: int
    subset: Subset
    role: str  # "good", "bad", "steer", "candidate", "without <id>" or "deploy"
    alpha: float
    runs: tuple[tuple[int, int], ...]
    verdict: str | None
    evidence: Evidence
    attempt: int = 0
    log_threshold: float = 0.0

    @property
    def check(self) -> bool:
        return self.role != STEER


@dataclass(frozen=True)
class Need:
    """Runs a subset needs next: in which block (attempt), and for what (a check's role, or steer)."""

    subset: Subset
    block: int
    role: str


@dataclass(frozen=True)
class Search:
    """Where the search stands: the trials so far in the order asked, the subsets it needs runs of next
    (none: done), and once done the minimal set, the configuration to deploy and why it ended."""

    trials: list[Trial]
    needs: list[Need]
    minimal: Subset | None = None
    deploy: Subset | None = None
    outcome: str = ""
    steps: list[str] = field(default_factory=list)
    icc: float = 0.0


class _Need(Exception):
    def __init__(self, needs: list[Need]):
        super().__init__([sorted(n.subset) for n in needs])
        self.needs = needs


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
            # a check judges a subset on its own runs, with no other arm's ICC to borrow: two at least
            # (the sequential design's one-start rule bounds the ICC from the study's other arms)
            max(2, int(spec.stopping.min_runs_per_arm)),
            int(spec.stopping.max_runs_per_arm),
        )


# a subset's pooled runs by repetition: {repetition: (corrupted, sessions)}
RunsByRepetition = Mapping[int, tuple[int, int]]


def in_blocks(runs: RunsByRepetition, blocks: Callable[[int], bool]) -> list[tuple[int, int]]:
    """A subset's runs whose block passes `blocks`, in repetition order."""
    return [tuple(runs[r]) for r in sorted(runs) if blocks(block_of(r))]  # type: ignore[misc]


def search_icc(runs_by_subset: Mapping[Subset, RunsByRepetition], assumed: float) -> float:
    """The ICC the checks use: estimated from every subset's runs, all blocks pooled (as the other
    designs do), never below the study's assumed one."""
    return plug_in_icc([list(r.values()) for r in runs_by_subset.values()], assumed)


def checks_of(candidate: Subset, everything: Subset) -> list[tuple[Subset, str, str | None]]:
    """What an answer must show, as (subset, role, the verdict it needs; None: either is an answer): the
    candidate corrupts, it is clean without any one of its differences (each is necessary), and the
    configuration to deploy (the bad one without it), whichever it is."""
    out: list[tuple[Subset, str, str | None]] = [(candidate, "candidate", CORRUPTING)]
    out += [(candidate - {d}, f"without {d}", CLEAN) for d in sorted(candidate)]
    return [*out, (everything - candidate, "deploy", None)]


def search(
    ids: Sequence[str], runs_by_subset: Mapping[Subset, RunsByRepetition], settings: Settings
) -> Search:
    """Replay the search on the runs so far (module doc): every check's verdict and steering lean, and
    the subsets needing runs next, or the answer."""
    icc = search_icc(runs_by_subset, settings.assumed_icc)
    trials: list[Trial] = []
    steps: list[str] = []
    everything = frozenset(ids)

    def runs_of(subset: Subset) -> RunsByRepetition:
        return runs_by_subset.get(subset, {})

    def check(subset: Subset, role: str, block: int) -> Trial:
        alpha_j = test_alpha(settings.alpha, 1 + sum(t.check for t in trials))
        runs = tuple(in_blocks(runs_of(subset), lambda b: b == block))
        threshold = math.log(1 / alpha_j)
        verdict, ev = verdict_of(runs, icc, settings.ceiling, threshold, settings.min_runs, settings.max_runs)
        trial = Trial(len(trials) + 1, subset, role, alpha_j, runs, verdict, ev, block, threshold)
        trials.append(trial)
        return trial

    def said(trial: Trial) -> str:
        """A check's answer: its verdict, or when its budget is spent the way its evidence leans."""
        if trial.verdict == UNDETERMINED:
            return CORRUPTING if trial.evidence.over > trial.evidence.under else CLEAN
        return str(trial.verdict)

    def steering(attempt: int) -> Callable[[Subset], bool]:
        """The steering oracle of an attempt: a subset's lean from the runs of the failed attempts before
        it and as many of its steering runs (block 0) as the lean needs, in order, so an attempt's
        candidate never depends on runs started after it was chosen."""
        asked: dict[Subset, Trial] = {}

        def corrupts(subset: Subset) -> bool:
            if subset == everything or not subset:
                return bool(subset)  # the good and bad checks settled these
            if subset not in asked:
                earlier = in_blocks(runs_of(subset), lambda b: 1 <= b < attempt)
                own = in_blocks(runs_of(subset), lambda b: b == 0)
                lean, ev, used = None, Evidence(), 0
                for used in range(0 if earlier else 1, len(own) + 1):
                    lean, ev = steer_of(earlier + own[:used], settings.assumed_icc, settings.ceiling)
                    if lean is not None:
                        break
                if lean is None and len(own) >= settings.max_runs:
                    lean = CORRUPTING if ev.over > ev.under else CLEAN
                runs = tuple(earlier + own[:used])
                trial = Trial(len(trials) + 1, subset, STEER, 0.0, runs, lean, ev, attempt, STEER_LOG_RATIO)
                trials.append(trial)
                asked[subset] = trial
            trial = asked[subset]
            if trial.verdict is None:
                raise _Need([Need(subset, 0, STEER)])
            return trial.verdict == CORRUPTING

        return corrupts

    try:
        good = check(frozenset(), "good", 0)
        if good.verdict is None:
            raise _Need([Need(frozenset(), 0, "good")])
        if said(good) == CORRUPTING:
            return Search(
                trials, [], outcome="the good configuration corrupts too: nothing to search", icc=icc
            )
        bad = check(everything, "bad", 0)
        if bad.verdict is None:
            raise _Need([Need(everything, 0, "bad")])
        if said(bad) == CLEAN:
            return Search(
                trials, [], outcome="the bad configuration does not corrupt here: nothing to search", icc=icc
            )
        note = steps.append
        for attempt in range(1, MAX_ATTEMPTS + 1):
            steer = steering(attempt)
            candidate = frozenset(one_minimal(quickxplain(list(ids), steer, note), steer, note))
            note(f"attempt {attempt}: checking {describe_subset(candidate, ids)} on fresh runs")
            pending: list[Need] = []
            failed = ""
            deploy_said = None
            for subset, role, wanted in checks_of(candidate, everything):
                if subset in (frozenset(), everything):  # the good or bad check answers it already
                    answer = said(good if not subset else bad)
                else:
                    trial = check(subset, role, attempt)
                    if trial.verdict is None:
                        pending.append(Need(subset, attempt, role))
                        continue
                    answer = said(trial)
                if role == "deploy":
                    deploy_said = answer
                if wanted is not None and answer != wanted and not failed:
                    failed = f"{describe_subset(subset, ids)} is {answer}, not {wanted}"
            if failed:
                note(f"attempt {attempt} fails: {failed}; its runs steer the next")
                continue
            if pending:
                raise _Need(pending)
            deploy = everything - candidate
            if deploy_said == CORRUPTING:
                outcome = (
                    "minimal set found, but the bad configuration without it still corrupts: it has another "
                    "cause too (run the search again from the configuration to deploy)"
                )
            else:
                outcome = "minimal set found; the bad configuration without it is clean"
            return Search(trials, [], candidate, deploy, outcome, steps, icc)
        return Search(
            trials,
            [],
            outcome=f"no candidate held up to its checks in {MAX_ATTEMPTS} attempts: nothing shown",
            steps=steps,
            icc=icc,
        )
    except _Need as need:
        return Search(trials, need.needs, steps=steps, icc=icc)


def error_bound(result: Search) -> tuple[float, str]:
    """The chance that some check of the search is wrong (the sum of the alphas spent), and whether
    the bound covers the answer (not when a check was left undetermined)."""
    spent = sum(t.alpha for t in result.trials if t.check)
    undetermined = [t for t in result.trials if t.check and t.verdict == UNDETERMINED]
    if undetermined:
        return spent, f"not covered: {len(undetermined)} check(s) undetermined within the run budget"
    return spent, "covers the answer"


def next_repetition(started: set[int] | frozenset[int], block: int = 0) -> int:
    """The repetition a subset's next run in `block` gets: one past every one started there (finished or
    not), else the block's first."""
    mine = [r for r in started if block_of(r) == block]
    return max(mine) + 1 if mine else block * ATTEMPT_BLOCK


def runs_from_records(
    records: Sequence[Any], ids: Sequence[str], used: Callable[[Any], bool]
) -> tuple[dict[Subset, dict[int, tuple[int, int]]], dict[Subset, set[int]]]:
    """From a study's runs (`analysis.RunRecord`): per subset, the pooled runs' counts by repetition, and
    every repetition started (a killed run's too: its repetition is not run again)."""
    counts: dict[Subset, dict[int, tuple[int, int]]] = {}
    started: dict[Subset, set[int]] = {}
    for r in records:
        subset = subset_of(r.factors, ids)
        started.setdefault(subset, set()).add(r.repetition)
        if used(r):
            counts.setdefault(subset, {})[r.repetition] = (r.corrupted, r.corrupted + r.clean)
    return counts, started


@dataclass(frozen=True)
class Round:
    """The jobs of the next round: (subset, repetition, with the throughput sweep) each; empty: done."""

    jobs: list[tuple[Subset, int, bool]]
    result: Search


def next_round(
    ids: Sequence[str],
    runs: Mapping[Subset, RunsByRepetition],
    started: Mapping[Subset, set[int]],
    settings: Settings,
) -> Round:
    """What the sweeper launches next: one run of each subset the search needs, in its block. A check
    new to its block starts its first min_runs runs at once (no verdict comes sooner); the steering asks
    one run at a time. The throughput sweep rides on the good configuration's first run and on the first
    run of the configuration to deploy, beside which the good one runs again, so the ratio compares
    sweeps run side by side."""
    result = search(ids, runs, settings)
    jobs: list[tuple[Subset, int, bool]] = []
    for need in result.needs:
        first = next_repetition(started.get(need.subset, set()), need.block)
        fresh = first == need.block * ATTEMPT_BLOCK  # nothing started in its block yet
        count = max(1, settings.min_runs) if fresh and need.role != STEER else 1
        bench = need.role in ("good", "deploy")
        jobs += [(need.subset, first + i, fresh and bench and i == 0) for i in range(count)]
        if fresh and need.role == "deploy":
            jobs.append((frozenset(), next_repetition(started.get(frozenset(), set())), True))
    return Round(jobs, result)


def search_block(spec: Any, records: Sequence[Any], used: Callable[[Any], bool]) -> DdminSearch:
    """report.json's `ddmin` block: the differences, every subset tried (in order) with its runs,
    verdict and evidence against its threshold, the steps of the search, the minimal set, the
    configuration to deploy, the error bound, and the sessions spent against a one-at-a-time sweep."""
    ids = [d.id for d in spec.ddmin.differences]
    settings = Settings.of(spec)
    runs, started = runs_from_records(records, ids, used)
    result = search(ids, runs, settings)
    bound, covered = error_bound(result)
    sizes = [n for by_rep in runs.values() for _, n in by_rep.values()]
    run_size = round(sum(sizes) / len(sizes)) if sizes else 0
    share = PLANNED_CHECKS + 1
    waiting = tuple(describe_subset(need.subset, ids) for need in result.needs) or None
    return DdminSearch(
        method=(
            "adaptive group testing (QuickXplain, then ddmin's 1-minimal check) steered by one start at a "
            "time, then the answer checked on fresh runs: the candidate corrupts, it is clean without any "
            "one of its differences, and the configuration to deploy, each by anytime-valid e-values "
            "against the ceiling on beta-binomial runs; the good and bad configurations and the first "
            f"{PLANNED_CHECKS - 2} checks at alpha / {share} each, one more share of alpha / {share} spread "
            f"over any further checks as alpha / (i (i + 1)) (orchestrator/analysis/ddmin.py)"
        ),
        differences=tuple(difference_row(d) for d in spec.ddmin.differences),
        icc=result.icc,
        trials=tuple(trial_row(t, ids) for t in result.trials),
        steps=tuple(result.steps),
        done=not result.needs,
        waiting_for=waiting,
        minimal=None if result.minimal is None else in_order(result.minimal, ids),
        deploy=None if result.deploy is None else in_order(result.deploy, ids),
        outcome=result.outcome or "the search stopped before it ended",
        error_bound=bound,
        error_bound_covers=covered,
        sessions=sum(sizes),
        one_at_a_time_sessions=one_at_a_time_sessions(len(ids), run_size),
        runs_started=sum(len(s) for s in started.values()),
    )


def in_order(subset: Subset, ids: Sequence[str]) -> tuple[str, ...]:
    """A subset's differences in the study's order."""
    return tuple(d for d in ids if d in subset)


def trial_row(trial: Trial, ids: Sequence[str]) -> TrialRow:
    """One trial as the report lists it: its subset, runs and counts, verdict, and evidence to 4 places."""
    return TrialRow(
        index=trial.index,
        subset=in_order(trial.subset, ids),
        label=describe_subset(trial.subset, ids),
        role=trial.role,
        attempt=trial.attempt,
        alpha=trial.alpha,
        log_threshold=trial.log_threshold,
        runs=tuple(tuple(r) for r in trial.runs),
        corrupted=sum(k for k, _ in trial.runs),
        sessions=sum(n for _, n in trial.runs),
        verdict=trial.verdict,
        evidence=TrialEvidence(over=round(trial.evidence.over, 4), under=round(trial.evidence.under, 4)),
    )


def difference_row(difference: Any) -> DifferenceRow:
    """One difference as the report lists it: its id, description and what it sets."""
    return DifferenceRow(
        id=difference.id, description=difference.description, sets=difference_settings(difference)
    )


def difference_settings(difference: Any) -> dict[str, dict[str, Any]]:
    """What a difference sets, per role ({role: {"env NAME": value, "flag --x": value}}, free keys: a
    `DifferenceRow`'s `sets`), for reports."""
    out: dict[str, dict[str, Any]] = {}
    for role in ("prefill", "decode", "router"):
        delta = getattr(difference.roles, role)
        sets = {f"env {k}": str(v) for k, v in delta.env.items()}
        sets |= {f"flag {k}": v for k, v in delta.flags.items()}
        if sets:
            out[role] = sets
    return out
