"""The sequential design's promises, checked by simulation through the code that judges real runs:
`rehearse.rehearse_sequential` runs each study round by round through `sequential.next_round` (what
the sweeper calls) and judges it with `analysis.analyse`, as a sequential study's report is judged."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from orchestrator import analysis
from orchestrator.analysis import sequential
from orchestrator.config.schema import StoppingConf, StudyConf
from orchestrator.study.rehearse import ArmTruth, rehearse_sequential, sequential_study, study_arms
from tests.test_rehearse import SEED_STORY, SPEC


def dsv4_spec(**stopping) -> StudyConf:
    """The dsv4 study (tests/test_rehearse.py) with these stopping settings."""
    return replace(SPEC, name="dsv4_sequential", stopping=StoppingConf(**stopping))


def truths(spec: StudyConf, rates: dict[str, float], icc: float) -> list[ArmTruth]:
    return [
        ArmTruth(label, levels, rates[label], icc if rates[label] > 0 else 0.0)
        for label, levels in study_arms(spec)
    ]


@pytest.mark.slow
# 2,000 studies where the error is likeliest (restart ICC 0.1), 1,000 without between-run variation
@pytest.mark.parametrize(
    ("rate", "icc", "studies"), [(0.03, 0.0, 1000), (0.03, 0.1, 2000), (0.15, 0.0, 1000), (0.15, 0.1, 2000)]
)
def test_null_models_keep_family_wise_false_implication_under_alpha(rate, icc, studies):
    spec = dsv4_spec(max_runs_per_arm=4)
    arms = truths(spec, dict.fromkeys(SEED_STORY, rate), icc)
    result = rehearse_sequential(spec, arms, sessions=60, studies=studies, seed=11)
    assert result["family_false_implication"] <= spec.alpha, result["family_false_implication"]


@pytest.mark.slow
def test_many_looks_and_killed_runs_keep_the_error_under_alpha():
    """Six looks with nothing stopped for futility, a fifth of the runs killed part-way (their outcomes
    are mostly corrupted sessions, never pooled), between-run ICC 0.1: still under alpha."""
    spec = dsv4_spec(max_runs_per_arm=6, futility=False)
    arms = truths(spec, dict.fromkeys(SEED_STORY, 0.15), 0.1)
    result = rehearse_sequential(spec, arms, sessions=60, studies=1000, seed=12, kill_rate=0.2)
    assert result["rounds_per_study"] > 5  # the looks were taken
    assert result["family_false_implication"] <= spec.alpha, result


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
    assert [look.to_dict() for look in first] == [look.to_dict() for look in again]


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
    assert [look.to_dict() for look in after[: len(before)]] == [look.to_dict() for look in before]
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
