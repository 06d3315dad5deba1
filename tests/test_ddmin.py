"""Delta debugging with a noisy oracle (orchestrator/analysis/ddmin.py), tested by simulation through the
same pure code that judges real runs: `ddmin.next_round` (what the sweeper calls) on runs drawn
beta-binomially per server start, with killed runs, and `designs.Ddmin.report_block` (what the report
shows)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from orchestrator.analysis import RunRecord, ddmin, run_used
from orchestrator.config.schema import StudyConf
from orchestrator.study import designs
from orchestrator.study.rehearse import ArmTruth, ddmin_study, rehearse_ddmin, true_minimal

IDS = [f"d{i:02d}" for i in range(20)]


def spec_for(ids=IDS, ceiling=0.05, max_runs=10, alpha=0.05) -> StudyConf:
    return StudyConf.from_dict(
        {
            "name": "ddmin-test",
            "alpha": alpha,
            "ceiling": ceiling,
            "stopping": {"min_runs_per_arm": 2, "max_runs_per_arm": max_runs},
            "ddmin": {"differences": [{"id": d, "roles": {"decode": {"env": {f"X_{d}": "1"}}}} for d in ids]},
        }
    )


def conjunction_truth(ids, culprits, rate=0.155, icc=0.005):
    """Corruption needs every culprit (a conjunction), at `rate`; any subset without them is clean."""

    def truth_of(subset):
        return ArmTruth(
            ddmin.describe_subset(subset, ids),
            ddmin.levels_of(subset, ids),
            rate if set(culprits) <= subset else 0.0,
            icc,
        )

    return truth_of


def exact_oracle(culprits):
    asked = []

    def corrupts(subset):
        asked.append(subset)
        return set(culprits) <= subset

    return corrupts, asked


# --- the search with an exact oracle ------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_quickxplain_finds_every_conjunction_of_up_to_three_of_eight(k):
    items = [f"x{i}" for i in range(8)]
    for culprits in itertools.combinations(items, k):
        corrupts, asked = exact_oracle(culprits)
        found = ddmin.one_minimal(
            ddmin.quickxplain(items, corrupts, lambda _: None), corrupts, lambda _: None
        )
        assert set(found) == set(culprits), culprits
        # far fewer subsets than the 2^8 there are; about 2k log2(n/k) + 2k, plus the 1-minimal check
        assert len(set(asked)) <= 2 * k * 3 + 2 * k + k


def test_one_minimal_drops_a_difference_the_rest_corrupts_without():
    # not a conjunction: {a, b} corrupts, and so does {b} alone; a set found as {a, b} is reduced
    def corrupts(subset):
        return "b" in subset

    notes: list[str] = []
    assert ddmin.one_minimal(["a", "b"], corrupts, notes.append) == ["b"]
    assert any("a dropped" in n for n in notes)


def test_split_keeps_order_and_balances_sizes():
    assert ddmin.split(list("abcde"), 2) == [["a", "b", "c"], ["d", "e"]]
    assert ddmin.split(list("ab"), 4) == [["a"], ["b"]]


@pytest.mark.parametrize("n", [1, 2, 6, 7, 20, 200])
def test_the_shares_of_alpha_sum_to_at_most_alpha_over_any_number_of_checks_and_never_increase(n):
    shares = [ddmin.test_alpha(0.05, j) for j in range(1, 100_001)]
    assert sum(shares) <= 0.05 and sum(shares) == pytest.approx(0.05, rel=1e-4)
    assert all(a >= b for a, b in itertools.pairwise(shares))
    # fixed before any run: a function of (alpha, j) alone, the same at every call
    assert shares == [ddmin.test_alpha(0.05, j) for j in range(1, 100_001)]
    # the planned checks share alpha equally; past the plan, the last share spread as alpha / (i (i + 1))
    planned = ddmin.PLANNED_CHECKS
    assert ddmin.test_alpha(0.05, planned) == pytest.approx(0.05 / (planned + 1))
    assert ddmin.test_alpha(0.05, planned + n) == pytest.approx(0.05 / (planned + 1) / (n * (n + 1)))


def test_the_checks_of_an_answer_are_the_planned_ones_for_two_differences():
    everything = frozenset("abcdef")
    checks = ddmin.checks_of(frozenset("bd"), everything)
    assert [(sorted(s), role, wanted) for s, role, wanted in checks] == [
        (["b", "d"], "candidate", "corrupting"),
        (["d"], "without b", "clean"),
        (["b"], "without d", "clean"),
        (["a", "c", "e", "f"], "deploy", None),
    ]
    # with the good and bad configurations' checks, a two-difference answer spends the planned shares
    assert 2 + len(checks) == ddmin.PLANNED_CHECKS


def test_the_steering_acts_on_one_clean_or_clearly_corrupting_start_and_waits_on_an_unclear_one():
    assert ddmin.steer_of([(0, 60)], 0.0, 0.05)[0] == "clean"
    assert ddmin.steer_of([(10, 60)], 0.0, 0.05)[0] == "corrupting"
    # one corrupted session of 60 (under the ceiling, but not clearly): another start first
    assert ddmin.steer_of([(1, 60)], 0.0, 0.05)[0] is None
    assert ddmin.steer_of([(1, 60), (0, 60)], 0.0, 0.05)[0] == "clean"
    assert ddmin.steer_of([], 0.0, 0.05)[0] is None


# --- the search on runs: reuse, replay, the jobs it asks for ------------------------------------------


def run(subset, repetition, k, n=60, status="FINISHED"):
    levels = ddmin.levels_of(subset, IDS)
    return RunRecord(
        run_id=f"{sorted(subset)}-{repetition}",
        status=status,
        signature=ddmin.describe_subset(subset, IDS),
        repetition=repetition,
        factors=levels,
        outcomes="complete" if status == "FINISHED" else "partial",
        clean=n - k if status == "FINISHED" else 0,
        corrupted=k,
        planned=n,
    )


def test_the_first_round_starts_the_good_configuration_twice_with_the_bench_on_its_first_run():
    nxt = ddmin.next_round(IDS, {}, {}, ddmin.Settings.of(spec_for()))
    assert nxt.jobs == [(frozenset(), 0, True), (frozenset(), 1, False)]


def test_a_killed_run_is_not_pooled_and_its_repetition_is_not_run_again():
    records = [run(frozenset(), 0, 0), run(frozenset(), 1, 3, status="KILLED")]
    runs, started = ddmin.runs_from_records(records, IDS, run_used)
    assert runs == {frozenset(): {0: (0, 60)}} and started == {frozenset(): {0, 1}}
    nxt = ddmin.next_round(IDS, runs, started, ddmin.Settings.of(spec_for()))
    assert nxt.jobs == [(frozenset(), 2, False)]  # one more run of the good configuration, repetition 2


def test_a_candidate_that_fails_its_checks_steers_the_next_one_which_is_checked_on_runs_of_its_own():
    ids = ["a", "b"]
    a, b = frozenset("a"), frozenset("b")
    clean, dirty = (0, 60), (12, 60)
    runs = {
        frozenset(): {0: clean, 1: clean, 2: clean},
        frozenset(ids): {0: dirty, 1: dirty, 2: dirty},
        # the steering's one start each: neither corrupted (a by chance), so both look needed
        a: {0: clean},
        b: {0: clean},
    }
    settings = ddmin.Settings(alpha=0.05, ceiling=0.05)
    result = ddmin.search(ids, runs, settings)
    # attempt 1 checks the candidate {a, b} (the bad configuration: its check answers that it corrupts)
    # without each of them, on fresh runs (block 1)
    assert {(tuple(n.subset), n.block, n.role) for n in result.needs} == {
        (("b",), 1, "without a"),
        (("a",), 1, "without b"),
    }
    nxt = ddmin.next_round(ids, runs, {s: set(r) for s, r in runs.items()}, settings)
    assert sorted(nxt.jobs, key=str) == sorted(
        [(a, 1000, False), (a, 1001, False), (b, 1000, False), (b, 1001, False)], key=str
    )
    # its checks find a corrupting alone: attempt 1 fails, and attempt 2's candidate, {a}, is checked
    # on runs started after it was chosen (block 2), none of those that chose it
    runs[a] |= {1000: dirty, 1001: dirty, 1002: dirty}
    runs[b] |= {1000: clean, 1001: clean}
    result = ddmin.search(ids, runs, settings)
    assert result.minimal is None and any("attempt 1 fails: +a is corrupting" in s for s in result.steps)
    assert [(tuple(n.subset), n.block, n.role) for n in result.needs] == [
        (("a",), 2, "candidate"),
        (("b",), 2, "deploy"),
    ]
    nxt = ddmin.next_round(ids, runs, {s: set(r) for s, r in runs.items()}, settings)
    assert nxt.jobs == [
        (a, 2000, False),
        (a, 2001, False),
        (b, 2000, True),
        (b, 2001, False),
        (frozenset(), 3, True),
    ]
    runs[a] |= {2000: dirty, 2001: dirty}
    runs[b] |= {2000: clean, 2001: clean, 2002: clean}
    result = ddmin.search(ids, runs, settings)
    assert result.minimal == a and result.deploy == b
    checks = [t for t in result.trials if t.check]
    assert [(t.role, t.attempt) for t in checks] == [
        ("good", 0),
        ("bad", 0),
        ("without a", 1),
        ("without b", 1),
        ("candidate", 2),
        ("deploy", 2),
    ]
    # the candidate's check pooled its own two runs only, not the steering start nor attempt 1's three
    assert checks[4].runs == (dirty, dirty)
    # the failed attempt's checks spent their shares of alpha too
    assert ddmin.error_bound(result)[0] == pytest.approx(6 * 0.05 / 7)


def test_the_search_is_a_replay_of_the_runs_so_every_subset_is_paid_for_once():
    spec = spec_for()
    rng = np.random.default_rng(7)
    records = ddmin_study(spec, conjunction_truth(IDS, ["d07"]), 60, rng)
    by_subset: dict[frozenset, list[int]] = {}
    for r in records:
        by_subset.setdefault(ddmin.subset_of(r.factors, IDS), []).append(r.repetition)
    # every subset's runs in each block are that block's first repetitions, each once: no subset was
    # started twice over
    for reps in by_subset.values():
        for block in {ddmin.block_of(r) for r in reps}:
            mine = sorted(r for r in reps if ddmin.block_of(r) == block)
            first = block * ddmin.ATTEMPT_BLOCK
            assert mine == list(range(first, first + len(mine)))
    block = designs.Ddmin(spec).report_block(records)
    assert block.done and block.minimal == ("d07",)
    # replaying on any prefix of the runs asks only for subsets that the full search also tried
    tried = {frozenset(t.subset) for t in block.trials}
    for cut in range(0, len(records), 5):
        runs, started = ddmin.runs_from_records(records[:cut], IDS, run_used)
        nxt = ddmin.next_round(IDS, runs, started, ddmin.Settings.of(spec))
        assert {s for s, _, _ in nxt.jobs} <= tried


def test_when_the_deploy_configuration_is_first_run_the_good_one_runs_beside_it_with_the_bench():
    spec = spec_for()
    rng = np.random.default_rng(3)
    records = ddmin_study(spec, conjunction_truth(IDS, ["d03"]), 60, rng)
    block = designs.Ddmin(spec).report_block(records)
    deploy = frozenset(block.deploy)
    first_deploy = min(r.repetition for r in records if ddmin.subset_of(r.factors, IDS) == deploy)
    assert first_deploy == ddmin.ATTEMPT_BLOCK  # the first attempt's fresh runs
    # the round that started the deploy configuration also ran the good one (its last repetition)
    index = next(i for i, r in enumerate(records) if ddmin.subset_of(r.factors, IDS) == deploy)
    assert any(ddmin.subset_of(r.factors, IDS) == frozenset() for r in records[index:])


# --- Monte Carlo: the promises of the issue, >= 1,000 studies each ------------------------------------


def rehearse(culprits, studies, seed, icc=0.005, kill_rate=0.0, ids=IDS):
    spec = spec_for(ids)
    truth_of = conjunction_truth(ids, culprits, icc=icc)
    assert true_minimal(ids, truth_of) == frozenset(culprits)
    rng = np.random.default_rng(seed)
    blocks = [
        designs.Ddmin(spec).report_block(ddmin_study(spec, truth_of, 60, rng, kill_rate))
        for _ in range(studies)
    ]
    exact = sum(1 for b in blocks if b.minimal is not None and set(b.minimal) == set(culprits))
    sessions = sum(b.sessions for b in blocks) / studies
    return exact / studies, sessions, blocks


@pytest.mark.parametrize(
    ("culprits", "max_sessions"),
    [(["d07"], 1800), (["d03", "d14"], 2800)],
    ids=["1-of-20", "2-of-20 split across halves"],
)
def test_the_true_minimal_set_is_found_in_at_least_95_percent_of_studies(culprits, max_sessions):
    # restart-to-restart variation (ICC 0.02, four times the built-in model's) and 5% of runs killed;
    # 400 studies here; for 1,000: python -m orchestrator.study.rehearse +experiment=ddmin_serve_script
    exact, sessions, blocks = rehearse(culprits, 400, seed=11, icc=0.02, kill_rate=0.05)
    assert exact >= 0.95, exact
    # and at a fraction of a one-at-a-time sweep over the 20 (21 arms x 4 starts x 60 = 5,040 sessions)
    assert sessions < max_sessions, sessions
    assert blocks[0].one_at_a_time_sessions == 21 * 4 * 60


def test_two_that_corrupt_together_cost_under_0_8_of_the_one_at_a_time_sequential_study():
    # issue 33's case, side by side on the same truths (bench/bench_ddmin.py: 1,000 studies)
    truth_of = conjunction_truth(IDS, ["d03", "d14"])
    result = rehearse_ddmin(spec_for(), truth_of, 60, 200, seed=4)
    assert result["exact"] >= 0.95 and result["one_at_a_time"]["exact"] >= 0.95
    ratio = result["sessions_per_study"] / result["one_at_a_time"]["sessions_per_study"]
    assert ratio <= 0.8, ratio


def test_a_bad_configuration_that_does_not_corrupt_yields_no_minimal_set():
    spec = spec_for()
    rng = np.random.default_rng(5)
    truth_of = conjunction_truth(IDS, ["d01"], rate=0.0)
    wrong = 0
    for _ in range(300):
        block = designs.Ddmin(spec).report_block(ddmin_study(spec, truth_of, 60, rng))
        wrong += block.minimal is not None
    assert wrong / 300 <= spec.alpha


def test_the_family_wise_error_stays_under_alpha_where_every_verdict_on_a_clean_subset_is_wrong():
    # the least favourable truth: each subset without both culprits sits at the ceiling exactly, so any
    # verdict on it, clean or corrupting, is wrong; the culprits' subsets corrupt (the search goes on
    # through them), the ICC is four times the built-in model's, and the search estimates it
    ids, culprits = IDS[:8], {"d01", "d05"}
    spec = spec_for(ids, max_runs=5)

    def truth_of(subset):
        rate = 0.155 if culprits <= subset else spec.ceiling
        return ArmTruth(ddmin.describe_subset(subset, ids), ddmin.levels_of(subset, ids), rate, 0.02)

    def wrong(trial) -> bool:
        if trial.role == "steer":  # a lean that only chooses what to ask next: no verdict
            return False
        at_ceiling = not culprits <= set(trial.subset)
        return trial.verdict == "clean" or (at_ceiling and trial.verdict == "corrupting")

    rng = np.random.default_rng(1)
    studies, with_a_wrong_verdict, trials = 200, 0, 0
    for _ in range(studies):
        block = designs.Ddmin(spec).report_block(ddmin_study(spec, truth_of, 60, rng))
        with_a_wrong_verdict += any(wrong(t) for t in block.trials)
        trials += sum(t.role != "steer" for t in block.trials)
    assert trials / studies > 8  # the search went past its first checks: each had its chance
    assert with_a_wrong_verdict / studies <= spec.alpha, with_a_wrong_verdict


def test_the_error_bound_is_at_most_alpha_and_covers_decided_searches():
    _, _, blocks = rehearse(["d05"], 50, seed=2)
    for b in blocks:
        assert b.error_bound <= 0.05
        assert b.error_bound_covers == "covers the answer"


# --- the differences as the job's factors: composed, planned, refused -----------------------------------

ONE = "{id: overlap, roles: {decode: {env: {SGLANG_OPT_USE_MULTI_STREAM_OVERLAP: '1'}}}}"
TWO = "{id: nccl, roles: {prefill: {env: {NCCL_DEBUG: WARN}}}}"
OTHER = "{id: other, roles: {decode: {env: {SGLANG_OPT_USE_MULTI_STREAM_OVERLAP: '0'}}}}"


def test_a_subset_is_applied_over_the_good_configuration_and_says_where_each_setting_came_from(compose_cfg):
    from orchestrator.config.load import load_job
    from orchestrator.config.plan import plan_arm

    good_conf = ["factor/multi_stream=off", "study.hypotheses=[]", f"study.ddmin.differences=[{ONE},{TWO}]"]
    cfg = compose_cfg(*good_conf, "ddmin_subset=[overlap]")
    job = load_job(cfg)
    plan = plan_arm(job)
    decode = plan.roles["decode"]
    # the factor level says 0; the difference, applied over it, says 1 and is recorded as the origin
    assert decode.env["SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "1"
    assert decode.origin_of("env", "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP") == "difference.overlap"
    assert "NCCL_DEBUG" not in plan.roles["prefill"].env
    assert plan.factors["overlap"] == "bad" and plan.factors["nccl"] == "good"
    # the good configuration is the baseline: every difference at good, the factors as composed
    assert job.study.baseline["overlap"] == "good" and job.study.baseline["multi_stream"] == "off"
    good = plan_arm(load_job(compose_cfg(*good_conf)))
    assert good.signature != plan.signature


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [f"study.ddmin.differences=[{ONE}]", "ddmin_subset=[overlapp]"],
            "ddmin_subset: unknown difference(s) ['overlapp']; accepted: ['overlap']",
        ),
        ([f"study.ddmin.differences=[{ONE},{ONE}]"], "study.ddmin.differences[1].id: 'overlap' is also"),
        (
            ["study.ddmin.differences=[{id: capture, roles: {decode: {env: {X: '1'}}}}]"],
            "'capture' is a factor's name too",
        ),
        (["study.ddmin.differences=[{id: nothing}]"], "study.ddmin.differences[0] (nothing): sets nothing"),
        (
            [f"study.ddmin.differences=[{ONE},{OTHER}]"],
            "overlap and other both set decode env SGLANG_OPT_USE_MULTI_STREAM_OVERLAP",
        ),
        (["ddmin_subset=[a]"], "ddmin_subset: ['a'] given, but study.ddmin.differences is empty"),
        (["study.ddmin.differences=[{id: x, roles: {decod: {env: {X: '1'}}}}]"], "decod"),
        (
            [f"study.ddmin.differences=[{ONE}]", "study.stopping.max_runs_per_arm=500"],
            "study.stopping.max_runs_per_arm: 500; a ddmin study numbers each attempt's starts in blocks of "
            "1000 repetitions, so it must be under 500",
        ),
    ],
    ids=[
        "unknown id in the subset",
        "duplicate id",
        "id of a factor",
        "sets nothing",
        "two values for one setting",
        "a subset without differences",
        "misspelled role",
        "a run budget the attempts' blocks cannot hold",
    ],
)
def test_bad_differences_are_refused_naming_the_key_and_what_is_accepted(compose_cfg, overrides, message):
    from hydra.errors import HydraException

    from orchestrator.config.load import ConfigError, load_job

    with pytest.raises((ConfigError, HydraException)) as err:
        load_job(compose_cfg(*overrides))
    assert message in str(err.value), str(err.value)
