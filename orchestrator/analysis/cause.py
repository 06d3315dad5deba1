"""The minimal cause (pure): the smallest conjunction(s) of factor levels that the arms say corruption
needs, with the evidence for each conjunct, what modulates the rate, and what the design cannot tell.

Input: the pooled arms (`analysis.pool_arms`), the study (`schema.StudyConf`: baseline, ceiling,
alpha) and the study's ICC (`analysis.between_runs`). Output: report.json's `minimal_cause` block, typed
(`result.MinimalCause`; each part built as its own type of analysis/result.py). Only
arms run under one deployment and workload (`conditions`, the baseline arm's) count, as the verdicts'.

Method, and why:
- **Each arm's state** is the study's one state for it (`analysis.states`: its beta-binomial interval
  against the ceiling at the study's confidence, the same state the hypotheses' verdicts read). The
  block does not judge arms itself, so it cannot disagree with them.
- **Conjunctions**: a set C of {factor: level} (each factor once) such that every corrupting arm has
  all of C and no clean arm has all of C; undetermined arms constrain nothing. C lies within the
  levels every corrupting arm shares, and must miss, for each clean arm, one of those shared levels
  that the clean arm lacks: the smallest such C are the minimum hitting sets of those "missed" sets,
  found exactly by bounded branching (small for any design a study runs). Every smallest C is
  reported: several mean the design cannot separate them.
- **Necessary**: shown when a corrupting arm with C and a clean arm equal to it but for that conjunct's
  factor were run (the pair removes only that level, and the corruption goes); else inferred only
  (from clean arms that differ in more than that factor). **Sufficient**: for every factor outside C,
  whether C was seen corrupting at every level of it that was run.
- **Modulators**: a factor outside C whose level changes the rate between two arms that both have C
  and differ only in it, by Newcombe's interval of the difference on effective counts, Bonferroni over
  the pairs compared.
- **Factorial effects**: where a set of two-level factors was run in all 2^k combinations with the
  other factors fixed, main effects and two-way interactions on the rate, each a linear contrast of the
  arms' rates with Price & Bonett's adjusted Wald interval (`stats.contrast_interval`, valid near 0),
  on effective counts, Bonferroni over the effects shown.
- **Limits**: what the run combinations cannot rule out, in words (`block_limits`): e.g. one factor at
  a time never changes two conjuncts together, so the conjunction is the smallest form consistent with
  the arms only if each factor acts alike whatever the others' levels.
- **Verdict** (`CAUSE_SENTENCES`): "minimal cause found" when one conjunction fits and no undetermined arm
  would change it were it on the side of the ceiling its rate lies; "undetermined" when one would (or
  nothing is shown corrupting yet), with `provisional`, the conjunctions the undetermined arms lean to:
  a pointer to what more sessions would likely show, not a finding.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from orchestrator.analysis import stats
from orchestrator.analysis.result import (
    Arm,
    ArmCounts,
    CauseArm,
    Conjunction,
    Effect,
    Factorial,
    FactorSufficiency,
    MinimalCause,
    Modulator,
    Necessity,
    Provisional,
    Sufficiency,
)
from orchestrator.analysis.states import STATES, ArmState, Item, StatePolicy, arm_states
from orchestrator.config.schema import StudyConf

__all__ = ["CAUSE_SENTENCES", "STATES", "ArmState", "minimal_cause"]

# the minimal cause's verdict, one of these sentences (the hypotheses' verdicts are `study.VERDICTS`)
CAUSE_SENTENCES = (
    "minimal cause found",
    "several conjunctions fit",
    "no single conjunction fits",
    "no level needed",
    "no corruption to explain",
    "undetermined",
)
# the most untried combinations, conjunctions and such a sentence lists before "and N more"
MAX_LISTED = 8
# branching steps of the conjunction search before it gives up (no study's arms come near it)
MAX_SEARCH_NODES = 200_000


def in_scope(arms: Sequence[Arm], conditions: Mapping[str, str] | None) -> list[Arm]:
    """The arms of one deployment and workload: `conditions`, or the conditions with most sessions."""
    if conditions is None:
        totals: dict[tuple, int] = {}
        for a in arms:
            key = tuple(sorted(a.conditions.items()))
            totals[key] = totals.get(key, 0) + a.n
        if not totals:
            return []
        conditions = dict(max(sorted(totals), key=lambda key: totals[key]))
    return [a for a in arms if a.conditions == dict(conditions)]


# --- conjunctions ----------------------------------------------------------------------------------


def shared_items(arms: Iterable[ArmState]) -> frozenset[Item]:
    """The factor levels every one of these arms has."""
    sets = [a.items for a in arms]
    return frozenset.intersection(*sets) if sets else frozenset()


def minimal_sets(sets: Iterable[frozenset[Item]]) -> list[frozenset[Item]]:
    """The sets no other set is a proper subset of (hitting those hits the rest), deduplicated."""
    unique = sorted(set(sets), key=lambda s: (len(s), sorted(s)))
    return [s for i, s in enumerate(unique) if not any(t < s for t in unique[:i])]


def smallest_hitting_sets(needs: Sequence[frozenset[Item]], max_nodes: int = MAX_SEARCH_NODES):
    """(every smallest set meeting each of `needs`, whether the search finished). Any hitting set meets
    the smallest unmet need in one of its items, so branching on those items, for sizes 0, 1, 2, ...,
    finds every smallest one."""
    nodes = 0

    def extend(chosen: frozenset[Item], budget: int, found: set[frozenset[Item]]) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            return False
        unmet = [d for d in needs if not d & chosen]
        if not unmet:
            found.add(chosen)
            return True
        if budget == 0:
            return True
        need = min(unmet, key=lambda d: (len(d), sorted(d)))
        return all(extend(chosen | {item}, budget - 1, found) for item in sorted(need))

    for size in range(len(needs) + 1):
        found: set[frozenset[Item]] = set()
        if not extend(frozenset(), size, found):
            return [], False
        if found:
            return sorted(found, key=sorted), True
    return [], True


def conjunctions(
    corrupting: Sequence[ArmState], clean: Sequence[ArmState]
) -> tuple[list[frozenset[Item]], bool]:
    """(the smallest conjunctions consistent with these arms, whether the search finished); [] when no
    conjunction is consistent or no arm is corrupting."""
    if not corrupting:
        return [], True
    shared = shared_items(corrupting)
    needs = [shared - a.items for a in clean]
    if any(not d for d in needs):
        return [], True  # a clean arm has every level the corrupting arms share
    return smallest_hitting_sets(minimal_sets(needs))


def contains(arm: ArmState, levels: frozenset[Item]) -> bool:
    return levels <= arm.items


def differs_only_in(a: ArmState, b: ArmState, factor: str) -> bool:
    """Whether two arms have the same levels of every factor but `factor`, and differ in it."""
    if a.factors.keys() != b.factors.keys() or a.factors.get(factor) == b.factors.get(factor):
        return False
    return all(a.factors[f] == b.factors[f] for f in a.factors if f != factor)


def text(levels: Iterable[Item], joiner: str = ", ") -> str:
    return joiner.join(f"{f}={v}" for f, v in sorted(levels))


def counts_of(arm: ArmState) -> ArmCounts:
    return ArmCounts(label=arm.label, counts=(arm.corrupted, arm.n), state=arm.state)


# --- evidence per conjunct -------------------------------------------------------------------------


def necessity(levels: frozenset[Item], item: Item, arms: Sequence[ArmState]) -> Necessity:
    """Whether a pair of arms shows `item` necessary to `levels`: a corrupting arm with every level of it
    and a clean arm equal to it but for the item's factor; else inferred only, with why."""
    factor, level = item
    corrupting = [a for a in arms if a.state == "corrupting" and contains(a, levels)]
    pairs = [
        (a, b)
        for a in corrupting
        for b in arms
        if b.state == "clean" and b.n and differs_only_in(a, b, factor)
    ]
    if pairs:
        a, b = max(pairs, key=lambda p: (p[0].n + p[1].n, p[0].label, p[1].label))
        return Necessity(
            level=level,
            evidence="pair",
            with_=counts_of(a),
            without=counts_of(b),
            note=f"{a.label} {a.counts()} corrupting, {b.label} {b.counts()} clean",
            pending=(),
        )
    pending = sorted(
        {
            b.label
            for a in corrupting
            for b in arms
            if b.state == "undetermined" and differs_only_in(a, b, factor)
        }
    )
    lacking = sorted(a.label for a in arms if a.state == "clean" and item not in a.items)
    note = "inferred only: no clean arm differs from a corrupting one in this factor alone"
    if lacking:
        note += f"; the clean arms without it ({', '.join(lacking)}) differ in more"
    if pending:
        note += f"; the arm that would show it ({', '.join(pending)}) is undetermined"
    return Necessity(
        level=level, evidence="inferred only", with_=None, without=None, note=note, pending=tuple(pending)
    )


def factor_levels(arms: Sequence[ArmState]) -> dict[str, list[str]]:
    """Every factor's levels among the arms with sessions."""
    levels: dict[str, set[str]] = {}
    for a in arms:
        if a.n:
            for f, v in a.factors.items():
                levels.setdefault(f, set()).add(v)
    return {f: sorted(v) for f, v in sorted(levels.items())}


def sufficiency(levels: frozenset[Item], arms: Sequence[ArmState]) -> Sufficiency:
    """Per factor outside the conjunction: the levels at which arms with the conjunction were seen
    corrupting, those run in some arm but never with it, and a verdict over all of them."""
    inside = {f for f, _ in levels}
    seen = factor_levels(arms)
    per: dict[str, FactorSufficiency] = {}
    for factor, all_levels in seen.items():
        if factor in inside:
            continue
        with_cause = sorted(
            {a.factors[factor] for a in arms if a.state == "corrupting" and contains(a, levels)}
        )
        untried = [v for v in all_levels if v not in with_cause]
        status = "one level run" if len(all_levels) == 1 else ("shown" if not untried else "not shown")
        per[factor] = FactorSufficiency(
            levels_with_cause=tuple(with_cause), levels_not_tried_with_cause=tuple(untried), status=status
        )
    varied = {f: p for f, p in per.items() if p.status != "one level run"}
    one_level = sorted(f for f, p in per.items() if p.status == "one level run")
    if not varied:
        others = f" ({', '.join(one_level)})" if one_level else ""
        verdict = f"sufficiency not shown: every other factor{others} was run at one level only"
    elif all(p.status == "shown" for p in varied.values()):
        verdict = f"sufficient across the levels tried of {', '.join(sorted(varied))}"
    else:
        missing = [f"{f}={v}" for f, p in sorted(varied.items()) for v in p.levels_not_tried_with_cause]
        verdict = f"sufficiency not shown: never seen corrupting with {', '.join(missing)}"
    if varied and one_level:
        verdict += f" ({', '.join(one_level)} run at one level only)"
    return Sufficiency(factors=per, verdict=verdict)


# --- modulators ------------------------------------------------------------------------------------


def level_order(factor: str, values: Iterable[str], baseline: Mapping[str, str]) -> list[str]:
    """A factor's levels with the baseline's first (where it is one of them), then sorted."""
    return sorted(values, key=lambda v: (v != baseline.get(factor), v))


def modulators(
    levels: frozenset[Item], arms: Sequence[ArmState], alpha: float, baseline: Mapping[str, str]
) -> list[Modulator]:
    """Factors outside the conjunction whose level changes the rate between two arms with the
    conjunction that differ only in it (Newcombe on effective counts, Bonferroni over the pairs)."""
    inside = {f for f, _ in levels}
    with_cause = [a for a in arms if a.n and a.state != "clean" and contains(a, levels)]
    pairs = []
    for a, b in itertools.combinations(with_cause, 2):
        changed = [f for f in a.factors if a.factors.get(f) != b.factors.get(f)]
        if len(changed) == 1 and changed[0] not in inside and differs_only_in(a, b, changed[0]):
            first = level_order(changed[0], [a.factors[changed[0]], b.factors[changed[0]]], baseline)[0]
            pairs.append((changed[0], *((a, b) if a.factors[changed[0]] == first else (b, a))))
    if not pairs:
        return []
    confidence = 1 - alpha / len(pairs)
    found = []
    for factor, a, b in sorted(pairs, key=lambda p: (p[0], p[1].label, p[2].label)):
        ka, na = stats.effective_counts(a.corrupted, a.n, a.design_effect)
        kb, nb = stats.effective_counts(b.corrupted, b.n, b.design_effect)
        lo, hi = stats.newcombe_diff(kb, nb, ka, na, confidence)
        if lo > 0 or hi < 0:
            found.append(
                Modulator(
                    factor=factor,
                    within=dict(sorted(levels)),
                    levels=(a.factors[factor], b.factors[factor]),
                    arms=(counts_of(a), counts_of(b)),
                    rates=(a.rate, b.rate),
                    difference=b.rate - a.rate,
                    ci=(lo, hi),
                    confidence=confidence,
                    pairs_compared=len(pairs),
                )
            )
    return found


# --- factorial effects -----------------------------------------------------------------------------


def full_factorials(arms: Sequence[ArmState]) -> list[tuple[frozenset[str], dict[str, str], list[ArmState]]]:
    """Every (factors F, the other factors' fixed levels, the 2^|F| arms) in which two-level factors F
    were run in all their combinations, |F| >= 2 (grown pair by pair: a full factorial's subsets are)."""
    levels = factor_levels(arms)
    two_level = [f for f, v in levels.items() if len(v) == 2]
    with_sessions = [a for a in arms if a.n]

    def contexts(factors: frozenset[str]) -> list[tuple[dict[str, str], list[ArmState]]]:
        groups: dict[tuple, dict[tuple, ArmState]] = {}
        for a in with_sessions:
            rest = tuple(sorted((f, v) for f, v in a.factors.items() if f not in factors))
            combo = tuple(a.factors.get(f) for f in sorted(factors))
            cell = groups.setdefault(rest, {})
            if combo not in cell or a.n > cell[combo].n:
                cell[combo] = a  # several arms of one combination (other deployments): the largest
        return [
            (dict(rest), sorted(cell.values(), key=lambda a: a.label))
            for rest, cell in sorted(groups.items())
            if len(cell) == 2 ** len(factors)
        ]

    found = []
    layer = [frozenset(p) for p in itertools.combinations(two_level, 2)]
    while layer:
        full = {s: contexts(s) for s in layer}
        full = {s: c for s, c in full.items() if c}
        found += [(s, rest, members) for s, cs in full.items() for rest, members in cs]
        layer = sorted({s | {f} for s in full for f in two_level if f not in s}, key=lambda s: sorted(s))
        layer = [s for s in layer if all(s - {f} in full for f in s)]
    return found


def factorial_effects(
    arms: Sequence[ArmState], alpha: float, baseline: Mapping[str, str]
) -> tuple[Factorial | None, tuple[Effect, ...] | None]:
    """(the largest full factorial run, its main effects and two-way interactions), or (None, None).
    Each effect is a difference of mean rates, the first level (the baseline's) minus the other."""
    found = full_factorials(arms)
    if not found:
        return None, None
    # the most factors, then the most sessions, then the first by name
    factors, fixed, members = min(found, key=lambda x: (-len(x[0]), -sum(a.n for a in x[2]), sorted(x[0])))
    names = sorted(factors)
    first = {f: level_order(f, {a.factors[f] for a in members}, baseline) for f in names}
    k = len(names)
    shown = k + k * (k - 1) // 2
    confidence = 1 - alpha / shown
    counts = [stats.effective_counts(a.corrupted, a.n, a.design_effect) for a in members]

    def sign(arm: ArmState, f: str) -> int:
        return 1 if arm.factors[f] == first[f][0] else -1

    def effect(kind: str, group: Sequence[str]) -> Effect:
        scale = 2 ** (k - len(group))  # arms per cell of the contrast: each mean is over them
        coefficients = [math.prod(sign(a, f) for f in group) / scale for a in members]
        estimate, lo, hi = stats.contrast_interval(counts, coefficients, confidence)
        what = " × ".join(f"{f} ({first[f][0]} vs {first[f][1]})" for f in group)
        return Effect(
            kind=kind,
            factors=tuple(group),
            levels={f: tuple(first[f]) for f in group},
            description=what,
            estimate=estimate,
            ci=(lo, hi),
            confidence=confidence,
            excludes_zero=lo > 0 or hi < 0,
        )

    effects = [effect("main", [f]) for f in names]
    effects += [effect("interaction", list(pair)) for pair in itertools.combinations(names, 2)]
    design = Factorial(
        factors=tuple(names),
        fixed=fixed,
        arms=tuple(counts_of(a) for a in members),
        method=(
            f"Price & Bonett (2004) adjusted Wald intervals of linear contrasts on effective counts, "
            f"Bonferroni over {shown} effects (each at {confidence:.2%}); main effect: the mean rate at "
            f"the first level minus at the other; interaction: the first factor's effect at the second "
            f"factor's first level minus at its other"
        ),
    )
    return design, tuple(effects)


# --- limits ----------------------------------------------------------------------------------------


def listed(names: Sequence[str], cap: int = MAX_LISTED) -> str:
    shown = ", ".join(names[:cap])
    return shown + (f" and {len(names) - cap} more" if len(names) > cap else "")


def untried_combinations(levels: frozenset[Item], arms: Sequence[ArmState]) -> list[frozenset[Item]]:
    """The combinations of the conjunct factors' levels (as run) that no arm with sessions has, each as
    the levels changed from the conjunction's."""
    factors = sorted(f for f, _ in levels)
    seen = factor_levels(arms)
    tried = {tuple(a.factors.get(f) for f in factors) for a in arms if a.n}
    cause = dict(levels)
    out = []
    for combo in itertools.product(*(seen.get(f, [cause[f]]) for f in factors)):
        if combo not in tried:
            out.append(frozenset((f, v) for f, v in zip(factors, combo, strict=True) if v != cause[f]))
    return sorted(out, key=lambda s: (len(s), sorted(s)))


def changed_together(levels: frozenset[Item], arms: Sequence[ArmState]) -> list[tuple[str, str]]:
    """The pairs of conjunct factors that no arm with sessions changes together from the conjunction."""
    cause = dict(levels)
    return [
        (f, g)
        for f, g in itertools.combinations(sorted(cause), 2)
        if not any(a.n and a.factors.get(f) != cause[f] and a.factors.get(g) != cause[g] for a in arms)
    ]


def conjunction_limits(levels: frozenset[Item], arms: Sequence[ArmState]) -> list[str]:
    """What the run combinations cannot rule out about one conjunction."""
    out = []
    never = changed_together(levels, arms)
    if never:
        pairs = listed([f"{f} and {g}" for f, g in never])
        untried = untried_combinations(levels, arms)
        combos = listed([text(c, " + ") for c in untried])
        out.append(
            f"No arm changes {pairs} together (one factor at a time), so the arms cannot rule out that an "
            f"untried combination corrupts ({combos}, the rest as in the conjunction): "
            f"{text(levels, ' AND ')} is the smallest conjunction consistent with the arms, assuming each "
            f"factor acts alike whatever the others' levels."
        )
    elif len(levels) > 1 and untried_combinations(levels, arms):
        combos = listed([text(c, " + ") for c in untried_combinations(levels, arms)])
        out.append(f"Combinations of the conjunct factors never run: {combos}.")
    suff = sufficiency(levels, arms).factors
    for factor, p in suff.items():
        if p.status == "not shown":
            out.append(
                f"{factor}={listed(p.levels_not_tried_with_cause)} never ran (or was not seen corrupting) "
                f"with {text(levels)}: whether the cause corrupts there is not shown."
            )
    seen = factor_levels(arms)
    one_level = [f"{f}={seen[f][0]}" for f, p in suff.items() if p.status == "one level run"]
    if one_level:
        out.append(
            f"Run at one level only ({', '.join(one_level)}): whether the cause also needs these levels is "
            "not shown."
        )
    return out


def no_fit_limits(corrupting: Sequence[ArmState], clean: Sequence[ArmState]) -> list[str]:
    """Why no conjunction fits: the clean arms that have every level all corrupting arms share."""
    shared = shared_items(corrupting)
    blocking = [a.label for a in clean if shared <= a.items]
    if not blocking:
        return []
    common = text(shared) if shared else "none"
    return [
        f"The corrupting arms share only {common}, and the clean arm(s) {listed(blocking)} have all of it: "
        "no conjunction of these levels separates them."
    ]


def undetermined_line(arm: ArmState, removed: Sequence[Item], ceiling: float) -> str:
    """What one undetermined arm leaves open, and about how many sessions would classify it."""
    if not arm.n:
        return f"{arm.label}: no sessions with an outcome, so it constrains nothing."
    lo, hi = arm.bounds or (0.0, 1.0)
    why = f"{arm.label} is undetermined ({arm.counts()}, bounds {lo:.2%} to {hi:.2%} around the ceiling "
    why += f"{ceiling:.0%})"
    if removed:
        why += (
            f": the design cannot tell {text(removed)} needed (part of the cause) from "
            f"{text(removed)} a modulator (the rate moves, the corruption stays)"
        )
    if arm.sessions_needed is None:
        return why + f"; its rate ({arm.counts()}) is the ceiling's: more sessions may never classify it."
    more = max(0, arm.sessions_needed - arm.n)
    return (
        why + f"; about {more} more sessions ({arm.sessions_needed} in all) would classify it at its present "
        "rate."
    )


def undetermined_limits(
    arms: Sequence[ArmState], corrupting: Sequence[ArmState], ceiling: float
) -> list[str]:
    """A line per undetermined arm, those that remove a level every corrupting arm shares first (they
    decide whether it is needed), at most `MAX_LISTED`, then one line for the rest."""
    shared = shared_items(corrupting)

    def removed(arm: ArmState) -> list[Item]:
        return sorted(
            {
                (f, a.factors[f])
                for a in corrupting
                for f in a.factors
                if (f, a.factors[f]) in shared and differs_only_in(a, arm, f)
            }
        )

    open_arms = sorted(
        (a for a in arms if a.state == "undetermined"), key=lambda a: (not removed(a), a.n == 0, a.label)
    )
    out = [undetermined_line(a, removed(a), ceiling) for a in open_arms[:MAX_LISTED]]
    rest = open_arms[MAX_LISTED:]
    if rest:
        out.append(f"{len(rest)} more arms are undetermined: {listed([a.label for a in rest])}.")
    return out


def separating_arms(found: Sequence[frozenset[Item]]) -> str:
    """Which arm would tell the first two of several conjunctions apart."""
    a, b = found[0], found[1]
    missing = sorted(b - a)
    return (
        f"an arm with {text(a)} but not {text(missing[:1])} would tell {text(a, ' AND ')} from "
        f"{text(b, ' AND ')}"
    )


# --- the block -------------------------------------------------------------------------------------


def arm_entry(arm: ArmState) -> CauseArm:
    return CauseArm(
        label=arm.label,
        signature=arm.signature,
        factors=dict(sorted(arm.factors.items())),
        state=arm.state,
        bounds=tuple(arm.bounds) if arm.bounds else None,
        counts=(arm.corrupted, arm.n),
        confidence=arm.confidence,
        leaning=arm.leaning,
        sessions_needed=arm.sessions_needed,
    )


def conjunction_entry(
    levels: frozenset[Item], arms: Sequence[ArmState], several: bool, open_arms: int, may_change: bool
) -> Conjunction:
    """One conjunction with its evidence; `open_arms`: the undetermined arms, `may_change`: whether they
    would change the answer were they on the side of the ceiling their rates lie."""
    necessary = {f: necessity(levels, (f, v), arms) for f, v in sorted(levels)}
    shown = [f for f, e in necessary.items() if e.evidence == "pair"]
    suff = sufficiency(levels, arms)
    if not levels:
        verdict = "no level needed: every arm classified is corrupting"
    else:
        if len(shown) == len(necessary):
            need = "each conjunct shown necessary by a pair of arms"
        elif shown:
            need = f"shown necessary: {', '.join(shown)}; inferred only: " + ", ".join(
                f for f in necessary if f not in shown
            )
        else:
            need = "each conjunct's necessity inferred only"
        if several:
            head = "one of several conjunctions the design cannot separate"
        elif open_arms and may_change:
            head = f"consistent with the arms classified; {open_arms} undetermined arm(s) may change it"
        elif open_arms:
            head = (
                f"minimal cause among the arms classified (the {open_arms} undetermined, as they lean, agree)"
            )
        else:
            head = "minimal cause"
        verdict = f"{head}: {need}; {suff.verdict}"
    return Conjunction(levels=dict(sorted(levels)), necessary=necessary, sufficient=suff, verdict=verdict)


def overall_verdict(
    corrupting: Sequence[ArmState],
    undetermined: Sequence[ArmState],
    found: Sequence[frozenset[Item]],
    provisional: Provisional | None,
) -> str:
    """One word for the block. An undetermined arm leaves the answer open when the answer would change
    were it on the side of the ceiling its rate lies (`provisional`); one that would not is a limit."""
    if not corrupting:
        return "undetermined" if undetermined else "no corruption to explain"
    if not found:
        return "undetermined" if provisional else "no single conjunction fits"
    if provisional or (undetermined and not found[0]):
        return "undetermined"
    if len(found) > 1:
        return "several conjunctions fit"
    return "no level needed" if not found[0] else "minimal cause found"


def summary(
    verdict: str,
    found: Sequence[frozenset[Item]],
    states: Sequence[ArmState],
    mods: Sequence[Modulator],
    provisional: Provisional | None,
    spec: StudyConf,
) -> str:
    """The block's opening sentence (the report's too)."""
    m = sum(1 for a in states if a.n)
    corrupting = [a.label for a in states if a.state == "corrupting"]
    undetermined = [a.label for a in states if a.state == "undetermined"]
    if verdict == "no corruption to explain":
        return f"No arm is corrupting (all {m} under the ceiling {spec.ceiling:.0%}): no cause to explain."
    if verdict == "no single conjunction fits":
        return (
            "No single conjunction of these levels explains the arms: more than one cause, or an interaction "
            f"of another form. Corrupting arms: {', '.join(corrupting)}."
        )
    if verdict == "several conjunctions fit":
        options = listed([text(c, " AND ") for c in found])
        return (
            f"{len(found)} conjunctions fit the arms equally well ({options}): the design cannot separate "
            "them."
        )
    if verdict == "no level needed":
        return (
            f"Every arm classified is corrupting ({', '.join(corrupting)}): none of the levels run is needed."
        )
    if verdict == "minimal cause found":
        (levels,) = found
        out = (
            f"Corruption needs {text(levels, ' AND ')}: the smallest conjunction of factor levels "
            f"consistent with the {m} arms (each arm's state against the ceiling {spec.ceiling:.0%} at "
            f"{1 - spec.alpha:.0%}, as the hypotheses read it)"
        )
        for mod in mods:
            out += (
                f"; {mod.factor} modulates it ({mod.levels[0]}: {mod.rates[0]:.1%}, "
                f"{mod.levels[1]}: {mod.rates[1]:.1%})"
            )
        return out + "."
    out = f"Undetermined: {len(undetermined)} of {m} arms are neither shown clean nor corrupting"
    out += f" ({listed(undetermined)})"
    if found:
        out += f"; the arms classified fit {' or '.join(text(c, ' AND ') for c in found)}"
    if provisional and provisional.conjunctions:
        out += "; as the undetermined arms' rates lean: " + " or ".join(
            text(c.items(), " AND ") or "no level needed" for c in provisional.conjunctions
        )
    return out + "."


def provisional_answer(states: Sequence[ArmState], found: Sequence[frozenset[Item]]) -> Provisional | None:
    """The smallest conjunctions were every undetermined arm on the side of the ceiling its rate lies,
    when they differ from those of the arms classified (None otherwise): a pointer, not a finding."""
    leaning = [a for a in states if a.state == "undetermined" and a.leaning]
    if not leaning:
        return None
    guessed, _ = conjunctions(
        [a for a in states if a.leaning == "corrupting"], [a for a in states if a.leaning == "clean"]
    )
    if guessed == list(found):
        return None
    return Provisional(
        conjunctions=tuple(dict(sorted(c)) for c in guessed),
        rests_on=tuple(a.label for a in leaning),
        note="as the undetermined arms' rates lean (not shown at the block's confidence)",
    )


def block_limits(
    found: Sequence[frozenset[Item]],
    states: Sequence[ArmState],
    complete: bool,
    spec: StudyConf,
    design: str | None,
    provisional: Sequence[frozenset[Item]] = (),
) -> list[str]:
    """The design's limits, in words: per conjunction (those found, else those the undetermined arms lean
    to), then why none fits, several fit, which arms are undetermined, and how the arms were run."""
    corrupting = [a for a in states if a.state == "corrupting"]
    out: list[str] = []
    for c in found or provisional:
        out += [x for x in conjunction_limits(c, states) if x not in out]
    if corrupting and not found:
        out += no_fit_limits(corrupting, [a for a in states if a.state == "clean"])
    if len(found) > 1:
        out.append(f"{len(found)} conjunctions fit: {separating_arms(found)}.")
    out += undetermined_limits(states, corrupting, spec.ceiling)
    if not complete:
        out.append("The conjunction search stopped before it finished: too many ways to combine the levels.")
    if design in ("sequential", "ddmin"):  # both stop an arm once its evidence decides
        out.append(
            "The arms ran in rounds that stopped when the evidence decided; these bounds are fixed-design "
            "bounds, which do not account for the looks."
        )
    return out


def minimal_cause(
    arms: Sequence[Arm],
    spec: StudyConf,
    icc: float,
    conditions: Mapping[str, str] | None = None,
    design: str | None = None,
    states: Mapping[str, ArmState] | None = None,
    policy: StatePolicy | None = None,
) -> MinimalCause:
    """report.json's `minimal_cause` block (see the module doc), from the arms run under `conditions`
    (default: the conditions with most sessions) and their one state each (`states`, by signature;
    default: judged now under `policy`, the study's); `design`: the sweep's, for its limits."""
    policy = policy or StatePolicy.of(spec.alpha)
    in_conditions = in_scope(arms, conditions)
    if states is None:
        states = arm_states(in_conditions, icc, spec.ceiling, policy)
    scoped = [states[a.signature] for a in in_conditions]
    corrupting = [a for a in scoped if a.state == "corrupting"]
    undetermined = [a for a in scoped if a.state == "undetermined"]
    found, complete = conjunctions(corrupting, [a for a in scoped if a.state == "clean"])
    if found == [frozenset()] and undetermined:
        found = []  # "no level needed" only when every arm is classified: here nothing is shown needed
    provisional = provisional_answer(scoped, found)
    verdict = overall_verdict(corrupting, undetermined, found, provisional)
    # the conjunctions the undetermined arms lean to: their limits and modulators are worth stating too
    leaned = [frozenset(c.items()) for c in provisional.conjunctions if c] if provisional else []
    mods: list[Modulator] = []
    for c in found or leaned:
        mods += [x for x in modulators(c, scoped, spec.alpha, spec.baseline) if x not in mods]
    factorial, effects = factorial_effects(scoped, spec.alpha, spec.baseline)
    several = len(found) > 1
    return MinimalCause(
        confidence=policy.confidence,
        arm_confidence=policy.confidence,
        method=(
            "a conjunction: every corrupting arm has all of it, no clean arm has all of it; "
            "undetermined arms constrain nothing"
        ),
        ceiling=spec.ceiling,
        arms=tuple(arm_entry(a) for a in scoped),
        conjunctions=tuple(
            conjunction_entry(
                c, scoped, several, sum(1 for a in undetermined if a.n), provisional is not None
            )
            for c in found
        ),
        provisional=provisional,
        modulators=tuple(mods),
        factorial=factorial,
        effects=effects,
        limits=tuple(block_limits(found, scoped, complete, spec, design, leaned)),
        verdict=verdict,
        summary=summary(verdict, found, scoped, mods, provisional, spec),
    )
