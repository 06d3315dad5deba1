"""The sequential design's promises, checked by simulation through the code that judges real runs:
`rehearse.rehearse_sequential` runs each study round by round through `sequential.next_round` (what
the sweeper calls) and judges it with `analysis.analyse`, as a sequential study's report is judged."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from orchestrator import analysis
from orchestrator.analysis import sequential
from orchestrator.config.schema import StoppingConf, StudyConf
from orchestrator.study.rehearse import (
    ArmTruth,
    draw_counts,
    rehearse_sequential,
    sequential_study,
    study_arms,
)
from tests import montecarlo
from tests.test_rehearse import SEED_STORY, SPEC

# studies a batch of a Monte Carlo check (tests/montecarlo.py)
BATCH = 250


def null_batches(spec: StudyConf, arms: list[ArmTruth], seed: int, **rehearse) -> tuple[Callable, list]:
    """A Monte Carlo check's batches of `rehearse_sequential` (batch i seeded seed + 1000 i): each batch's
    studies with a false implication and its studies; and the list every batch's result is added to."""
    results: list[dict] = []

    def batch(i: int) -> tuple[int, int]:
        result = rehearse_sequential(spec, arms, sessions=60, studies=BATCH, seed=seed + 1000 * i, **rehearse)
        results.append(result)
        return round(result["family_false_implication"] * BATCH), BATCH

    return batch, results


def dsv4_spec(**stopping) -> StudyConf:
    """The dsv4 study (tests/test_rehearse.py) with these stopping settings."""
    return replace(SPEC, name="dsv4_sequential", stopping=StoppingConf(**stopping))


def truths(spec: StudyConf, rates: dict[str, float], icc: float) -> list[ArmTruth]:
    return [
        ArmTruth(label, levels, rates[label], icc if rates[label] > 0 else 0.0)
        for label, levels in study_arms(spec)
    ]


@pytest.mark.slow
# up to 2,000 studies where the error is likeliest (restart ICC 0.1), 1,000 without between-run variation,
# in batches of 250 that stop once the error's exact upper bound is under alpha (tests/montecarlo.py)
@pytest.mark.parametrize(
    ("rate", "icc", "studies"), [(0.03, 0.0, 1000), (0.03, 0.1, 2000), (0.15, 0.0, 1000), (0.15, 0.1, 2000)]
)
def test_null_models_keep_family_wise_false_implication_under_alpha(rate, icc, studies):
    spec = dsv4_spec(max_runs_per_arm=4)
    arms = truths(spec, dict.fromkeys(SEED_STORY, rate), icc)
    batch, _ = null_batches(spec, arms, seed=11)
    check = montecarlo.rate_at_most(batch, spec.alpha, max_batches=studies // BATCH)
    assert check.rate <= spec.alpha, str(check)


@pytest.mark.slow
def test_many_looks_and_killed_runs_keep_the_error_under_alpha():
    """Six looks with nothing stopped for futility, a fifth of the runs killed part-way (their outcomes
    are mostly corrupted sessions, never pooled), between-run ICC 0.1: still under alpha (up to 1,000
    studies)."""
    spec = dsv4_spec(max_runs_per_arm=6, futility=False)
    arms = truths(spec, dict.fromkeys(SEED_STORY, 0.15), 0.1)
    batch, results = null_batches(spec, arms, seed=12, kill_rate=0.2)
    check = montecarlo.rate_at_most(batch, spec.alpha, max_batches=1000 // BATCH)
    assert sum(r["rounds_per_study"] for r in results) / len(results) > 5  # the looks were taken
    assert check.rate <= spec.alpha, str(check)


@pytest.mark.slow
def test_seed_story_is_judged_right_with_fewer_sessions_than_the_fixed_design():
    spec = dsv4_spec(max_runs_per_arm=4)
    result = rehearse_sequential(spec, truths(spec, SEED_STORY, 0.02), sessions=60, studies=2000, seed=13)
    assert result["all_right"] >= 0.95, result
    by_id = {h["id"]: h for h in result["hypotheses"]}
    for fix in ("H-multistream", "H-capture", "H-bf16"):
        assert by_id[fix]["verdicts"]["implicated"] >= 0.85, by_id[fix]
    # the fixed dsv4 design: 5 arms x 4 starts x 60 sessions
    assert result["sessions_per_study"] <= 0.7 * 1200, result["sessions_per_study"]


def test_a_clean_arm_is_bounded_under_the_ceiling_as_the_exact_bound_allows():
    """With sessions independent, 0/n clears a ceiling c when the mixture of "gone" and rates under c
    outweighs (1 - c)^n twenty-fold: between the exact one-sided bound's 99 sessions and the few more
    the mixture costs."""
    ev = [sequential.evidence([], [[0, n]], 0.0, 0.03, 0.5).under for n in (90, 99, 120, 150)]
    assert ev == sorted(ev)
    assert ev[0] < math.log(20) < ev[-1]
    # any corrupted session costs evidence; more between-run variation costs evidence
    assert sequential.evidence([], [[1, 150]], 0.0, 0.03, 0.5).under < ev[-1]
    assert sequential.evidence([], [[0, 75], [0, 75]], 0.05, 0.03, 0.5).under < ev[-1]


def test_evidence_points_the_right_way():
    drop = sequential.evidence([[9, 60], [10, 60]], [[0, 60], [0, 60]], 0.0, 0.03, 0.5)
    same = sequential.evidence([[9, 60], [10, 60]], [[10, 60], [9, 60]], 0.0, 0.03, 0.5)
    rise = sequential.evidence([[1, 60], [0, 60]], [[12, 60], [10, 60]], 0.0, 0.03, 0.5)
    assert drop.reduction > math.log(80) and drop.increase < 0  # below 0: the data lean the other way
    assert same.reduction < 1 and same.increase < 1
    assert rise.increase > math.log(80) and rise.reduction < 0


def test_ville_one_arm_at_the_ceiling_never_crosses_more_often_than_alpha():
    """A single arm whose true rate is the ceiling, looked at after every run for 20 runs: the share of
    paths whose `under` e-value ever reaches 1/alpha stays under alpha (Ville's inequality)."""
    rng = np.random.default_rng(5)
    crossed = 0
    paths = 400
    for _ in range(paths):
        runs = []
        for _ in range(20):
            runs.append([int(rng.binomial(30, 0.03)), 30])
            if sequential.evidence([], runs, 0.0, 0.03, 0.5).under >= math.log(20):
                crossed += 1
                break
    assert crossed / paths <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / paths), crossed


def test_the_trace_depends_on_the_runs_only_not_on_when_they_were_read():
    """A resumed study reads its earlier runs back from MLflow in another order, next to others: the
    trace, hence every decision, is the same as the uninterrupted study's."""
    spec = dsv4_spec(max_runs_per_arm=4)
    arms = truths(spec, SEED_STORY, 0.02)
    runs = sequential_study(spec, arms, 60, np.random.default_rng(3))
    shuffled = [runs[i] for i in np.random.default_rng(4).permutation(len(runs))]
    hyps = sequential.study_hypotheses(spec)
    first = sequential.trace(spec, hyps, sequential.arm_runs(runs, spec, analysis.run_used))
    again = sequential.trace(spec, hyps, sequential.arm_runs(shuffled, spec, analysis.run_used))
    assert [look.as_result() for look in first] == [look.as_result() for look in again]


def test_a_killed_run_is_listed_but_not_pooled_and_its_round_is_rerun_next():
    spec = dsv4_spec(max_runs_per_arm=4)
    run = analysis.RunRecord(
        run_id="k",
        status="KILLED",
        signature="s",
        repetition=0,
        factors=dict(spec.baseline),
        outcomes="partial",
        clean=0,
        corrupted=9,
        planned=60,
    )
    arms = sequential.arm_runs([run], spec, analysis.run_used)
    assert arms["baseline"].counts == {} and arms["baseline"].started == {0}


def test_budget_and_minimum_runs_bound_the_rounds():
    spec = dsv4_spec(min_runs_per_arm=3, max_runs_per_arm=3)
    runs = sequential_study(spec, truths(spec, SEED_STORY, 0.0), 60, np.random.default_rng(1))
    assert {r.repetition for r in runs} == {0, 1, 2}  # three rounds: nothing decided before, nothing after
    capped = replace(spec, stopping=StoppingConf(max_runs_per_arm=6, max_sessions=600))
    runs = sequential_study(capped, truths(capped, SEED_STORY, 0.0), 60, np.random.default_rng(1))
    assert sum(r.clean + r.corrupted for r in runs) <= 600


def test_extending_a_finished_study_continues_its_rounds_with_the_same_evidence():
    """A study that spent its budget (2 starts per arm) is extended to 5: the new rounds follow the old
    ones, the looks both took are the same, and only arms still open get more starts."""
    small, large = dsv4_spec(max_runs_per_arm=2, futility=False), dsv4_spec(max_runs_per_arm=5)
    arms = truths(small, SEED_STORY, 0.02)
    first = sequential_study(small, arms, 60, np.random.default_rng(8))
    assert {r.repetition for r in first} == {0, 1}
    extended = sequential_study(large, arms, 60, np.random.default_rng(9), earlier=first)
    assert extended[: len(first)] == first
    hyps = sequential.study_hypotheses(large)
    before = sequential.trace(large, hyps, sequential.arm_runs(first, large, analysis.run_used))
    after = sequential.trace(large, hyps, sequential.arm_runs(extended, large, analysis.run_used))
    assert [look.as_result() for look in after[: len(before)]] == [look.as_result() for look in before]
    decided = {h.treatment for h in hyps if before[-1].decisions[h.id].verdict is not None}
    added = {analysis.arm_label(r.factors, large.baseline) for r in extended[len(first) :]}
    assert decided and not decided & added  # what the evidence had settled gets no more starts


def test_the_closed_testing_means_are_every_prefix_s_log_mean_exp_without_overflow():
    """`closed` takes, per hypothesis, the smallest mean over its weakest companions, from one running
    log-sum-exp: each prefix's value is log(mean(exp(prefix))), also where exp() of a value overflows."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        logs = list(rng.choice([-50.0, 0.0, 3.0], size=rng.integers(1, 8)) + rng.uniform(-5, 5, 1))
        got = sequential._prefix_log_mean_exps(logs)
        want = [float(np.log(np.mean(np.exp(np.array(logs[:k]))))) for k in range(1, len(logs) + 1)]
        assert np.allclose(got, want, rtol=0, atol=1e-9), (logs, got, want)
    assert sequential._prefix_log_mean_exps([800.0, 1000.0]) == pytest.approx([800.0, 1000.0 - math.log(2)])
    # e-Holm: a lone strong hypothesis is pulled down by the weak ones, to the mean with all of them
    closed = sequential.closed(
        {"a": sequential.Evidence(reduction=10.0), "b": sequential.Evidence(), "c": sequential.Evidence()}
    )
    assert closed["a"].reduction == pytest.approx(math.log((math.exp(10.0) + 2) / 3), abs=1e-4)
    assert closed["b"].reduction == pytest.approx(0.0, abs=1e-4)


def _beta_binomial(rng: np.random.Generator, p: float, icc: float, n: int, shape) -> np.ndarray:
    """Corrupted sessions of `shape` (studies, rounds) starts of n sessions, as the rehearsal draws them."""
    studies, rounds = shape
    return draw_counts([ArmTruth("arm", {}, p, icc)], rounds, n, studies, rng)[:, 0, :]


@pytest.mark.parametrize(("rate", "icc"), [(0.03, 0.0), (0.2, 0.0), (0.05, 0.02), (0.15, 0.1)])
def test_the_paired_reduction_crosses_under_no_effect_less_often_than_alpha_over_ten_looks(rate, icc):
    """Both arms at the same rate, starts varying by the restart ICC (the e-value judged at that ICC),
    looked at after every round for ten rounds: the share of studies whose reduction e-value ever reaches
    1/alpha stays under alpha (Ville's inequality, here through the effective-count approximation)."""
    rng = np.random.default_rng(17)
    studies, rounds, n = 600, 10, 60
    base = _beta_binomial(rng, rate, icc, n, (studies, rounds))
    treat = _beta_binomial(rng, rate, icc, n, (studies, rounds))
    crossed = 0
    for b, t in zip(base, treat, strict=True):
        pairs = []
        for r in range(rounds):
            pairs.append(((int(b[r]), n), (int(t[r]), n)))
            if sequential.paired_reduction(pairs, icc, 0.5) >= math.log(20):
                crossed += 1
                break
    assert crossed / studies <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / studies), crossed


def test_the_paired_reduction_conditions_the_baseline_away_and_grows_with_a_real_effect():
    """15% -> 5% at the restart ICC 0.02: the evidence grows about linearly with the rounds (the Wald
    drift of the design alternative), and a round the treatment lacks adds nothing."""
    rng = np.random.default_rng(3)
    b = _beta_binomial(rng, 0.15, 0.02, 120, (400, 6))
    t = _beta_binomial(rng, 0.05, 0.02, 120, (400, 6))
    after = {
        r: np.mean(
            [
                sequential.paired_reduction(
                    [((int(x[i]), 120), (int(y[i]), 120)) for i in range(r)], 0.02, 0.5
                )
                for x, y in zip(b, t, strict=True)
            ]
        )
        for r in (2, 4, 6)
    }
    assert 0 < after[2] < after[4] < after[6]
    assert after[6] - after[4] == pytest.approx(after[4] - after[2], rel=0.35)
    # the pace at the effect seen is about the growth (within what the prior's weight off the effect
    # costs), and a round on a low rate sees few corrupted sessions, so it is worth less
    paces = [
        sequential.reduction_pace([((int(x[i]), 120), (int(y[i]), 120)) for i in range(6)], 0.02, 0.5)
        for x, y in zip(b, t, strict=True)
    ]
    assert np.mean(paces) == pytest.approx((after[6] - after[2]) / 4, rel=0.5)
    # a clean treatment's pace is what "removed" would add, far above the design effect's
    gone = sequential.reduction_pace([((18, 120), (0, 120))] * 2, 0.02, 0.5)
    assert gone > 3 * sequential.reduction_pace([((18, 120), (9, 120))] * 2, 0.02, 0.5)
    low = sequential.reduction_pace([((4, 120), (4, 120))] * 3, 0.02, 0.5)
    assert low < 0.5 * sequential.reduction_pace([((18, 120), (18, 120))] * 3, 0.02, 0.5)
    pairs = [((18, 120), (5, 120))]
    assert sequential.evidence(
        [[18, 120], [20, 120]], [[5, 120]], 0.02, 0.03, 0.5, pairs=pairs
    ).reduction == (sequential.paired_reduction(pairs, 0.02, 0.5))


def test_an_arm_with_one_start_waits_for_the_icc_then_is_judged_at_its_upper_bound():
    """Round 0, every arm one start: nothing shows how much starts vary, so nothing is decided, however
    clean the fix looks. Once two arms have two starts, the one-start arm is judged at the ICC's upper
    bound, which is above the plug-in estimate (weaker evidence than the plug-in would give)."""
    spec = dsv4_spec(min_runs_per_arm=1, max_runs_per_arm=6)
    hyps = sequential.study_hypotheses(spec)
    clean = {"capture=eager", "index_k=fp8", "multi_stream=off"}
    counts = {"baseline": {0: (30, 180)}, "hicache=off": {0: (9, 180)}, **{c: {0: (0, 180)} for c in clean}}
    arms = {k: sequential.ArmRuns(k, v, frozenset(v)) for k, v in counts.items()}
    first = sequential.trace(spec, hyps, arms)[-1]
    assert all(d.verdict is None for d in first.decisions.values())
    assert "ICC" in first.decisions["H-multistream"].reason
    counts["baseline"][1], counts["hicache=off"][1] = (20, 180), (14, 180)
    arms = {k: sequential.ArmRuns(k, v, frozenset(v)) for k, v in counts.items()}
    runs = [list(a.upto(1)) for a in arms.values()]
    plug_in = sequential.plug_in_icc(runs, 0.0)
    bound = sequential.icc_upper_bound(runs, 0.0, 0.8)
    assert bound is not None and bound > plug_in
    second = sequential.trace(spec, hyps, arms)[-1]
    at_plug_in = sequential.evidence([[30, 180], [20, 180]], [[0, 180]], plug_in, 0.03, 0.5)
    assert second.evidence["H-multistream"].under < at_plug_in.under
    assert sequential.icc_upper_bound([[[5, 60]], [[0, 60], [0, 60]]], 0.0, 0.8) is None


def test_an_arm_judged_at_an_icc_bound_of_one_gets_the_evidence_of_the_ceiling_not_the_floor():
    """Runs that vary as much as they can (0/60 and 60/60) put the ICC's upper bound at 1, where the
    beta-binomial's formula is inf - inf: a one-start arm is judged at ICC_CEILING, just below it, with
    finite evidence that is weaker than at a lower ICC, never NaN (which the floor turned into -50,
    "decisively against", before)."""
    bound = sequential.icc_upper_bound([[[0, 60], [60, 60]], [[30, 60]]], 0.0, 0.8)
    assert bound == 1.0
    assert sequential.round_icc(bound) == sequential.ICC_CEILING < 1
    at_bound = sequential.evidence([[30, 60]], [[0, 60]], bound, 0.03, 0.5)
    assert at_bound == sequential.evidence([[30, 60]], [[0, 60]], sequential.ICC_CEILING, 0.03, 0.5)
    lower = sequential.evidence([[30, 60]], [[0, 60]], 0.5, 0.03, 0.5)
    for claim in sequential.CLAIMS:
        value = getattr(at_bound, claim)
        assert sequential.LOG_E_FLOOR < value < math.inf, (claim, value)
        assert abs(value) <= abs(getattr(lower, claim)), claim


def test_a_log_e_value_that_cannot_be_computed_is_no_evidence_not_the_floor():
    assert sequential.floored_log_e(-120.0) == sequential.LOG_E_FLOOR
    assert sequential.floored_log_e(2.5) == 2.5
    with pytest.warns(RuntimeWarning, match="NaN"):
        assert sequential.floored_log_e(math.nan) == 0.0


def test_a_mixture_weighs_a_baseline_no_treatment_rate_explains_as_zero():
    """A row of the paired mixture whose every allowed treatment rate has likelihood 0 adds 0 to the
    mixture and keeps its share of the prior; one finite row is not lost to exp(-inf - -inf)."""
    pair = np.array([np.log([0.2, 0.4]), [-np.inf, -np.inf], np.log([0.1, 0.3])])
    allowed, rows = np.ones_like(pair, dtype=bool), np.ones(3, dtype=bool)
    with np.errstate(all="raise"):
        mixed = sequential._pair_mix(pair, allowed, rows)
        assert mixed == pytest.approx(math.log((0.3 + 0 + 0.2) / 3))
        assert (
            sequential._pair_mix(np.full((2, 2), -np.inf), np.ones((2, 2), bool), np.ones(2, bool))
            == -math.inf
        )
        assert sequential._mix(np.full(3, -np.inf), np.ones(3, bool)) == -math.inf


def test_a_reduction_on_its_way_is_not_stopped_for_futility_because_the_ceiling_cannot_settle():
    """HiCache's 15% -> 5% against a 3% ceiling: the ceiling may never settle, but "partial" is a verdict,
    so a reduction growing at a pace that reaches its threshold within the budget keeps the arm running;
    one fallen to Wald's acceptance boundary stops it, and so does one whose rounds see so few corrupted
    sessions that the design effect's pace would not carry it over its threshold in the rounds left."""
    th = sequential.Thresholds.of(0.05)
    growing = sequential.Evidence(reduction=1.2, under=-0.5, over=0.2, reduction_pace=0.4)
    assert sequential.reachable(growing, th, rounds_done=2, max_runs=6)
    # a slow start is no verdict yet: the prior's weight off the design effect costs a little at first
    slow = sequential.Evidence(reduction=-0.4, under=-0.5, over=0.0, reduction_pace=0.5)
    assert sequential.reachable(slow, th, rounds_done=2, max_runs=6)
    # a round on a low rate sees few corrupted sessions: at that pace the rounds left cannot show it
    sparse = sequential.Evidence(reduction=0.2, under=-0.5, over=0.0, reduction_pace=0.05)
    assert not sequential.reachable(sparse, th, rounds_done=2, max_runs=6)
    # shown, with the ceiling out of reach: stop, "partial" is in hand
    shown = sequential.Evidence(reduction=3.5, under=-0.5, over=0.1)
    assert not sequential.reachable(shown, th, rounds_done=3, max_runs=6)
    fallen = sequential.Evidence(
        reduction=sequential.REDUCTION_OUT_OF_REACH - 0.1, under=-0.5, over=0.2, reduction_pace=0.4
    )
    assert not sequential.reachable(fallen, th, rounds_done=2, max_runs=6)
