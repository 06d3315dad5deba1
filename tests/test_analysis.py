"""Runs -> arms -> verdicts: pooling, the arm differing in one factor, verdicts, throughput, Monte Carlo."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from orchestrator.analysis import (
    HypothesisSpec,
    LevelSample,
    RunRecord,
    StudySpec,
    analyse,
    arm_label,
    stats,
)
from orchestrator.analysis.result import MoreSessions, to_json
from orchestrator.analysis.study import judge, pool_arms
from orchestrator.report.render import dumps, render_markdown
from tests.conftest import report_json

BASE = {"capture": "graph", "hicache": "on", "index_k": "bf16", "multi_stream": "on"}
HYPS = (
    HypothesisSpec("H-multistream", "multi_stream", "needs multi-stream overlap", "on", "off"),
    HypothesisSpec("H-capture", "capture", "needs CUDA-graph capture", "graph", "eager"),
    HypothesisSpec("H-bf16", "index_k", "needs bf16 index keys", "bf16", "fp8"),
    HypothesisSpec("H-hicache", "hicache", "needs HiCache", "on", "off"),
)
SPEC = StudySpec(
    name="t", baseline=BASE, hypotheses=HYPS, alpha=0.05, min_effect=0.5, ceiling=0.03, throughput_floor=0.95
)
DELTAS = {
    "baseline": {},
    "H-multistream": {"multi_stream": "off"},
    "H-capture": {"capture": "eager"},
    "H-bf16": {"index_k": "fp8"},
    "H-hicache": {"hicache": "off"},
}


def level(c: int, tokens: list[float], latency: list[float]) -> LevelSample:
    return LevelSample(
        concurrency=c,
        tok_s=c * sum(tokens) / sum(latency),
        ttft_p50_s=0.1,
        ttft_p99_s=0.2,
        itl_p50_s=0.01,
        itl_p99_s=0.02,
        request_tokens=tuple(tokens),
        request_latency_s=tuple(latency),
    )


def run(
    delta: dict[str, str],
    corrupted: int,
    clean: int,
    rep: int = 0,
    status: str = "FINISHED",
    outcomes: str = "complete",
    errored: int = 0,
    bench: tuple[LevelSample, ...] = (),
    client_bound: bool = False,
    run_id: str | None = None,
    reason: str = "",
) -> RunRecord:
    factors = {**BASE, **delta}
    label = arm_label(factors, BASE)
    return RunRecord(
        run_id=run_id or f"{label}-{rep}-{status}",
        status=status,
        signature=f"sig[{label}]",
        repetition=rep,
        factors=factors,
        outcomes=outcomes,
        clean=clean,
        corrupted=corrupted,
        errored=errored,
        planned=corrupted + clean + errored,
        reason=reason,
        client_bound=client_bound,
        bench=bench,
        config={"decode": {"env": {"A": "1"}, "flags": "--x", "argv": "python -m srv --x"}},
    )


def by_label(report: dict) -> dict[str, dict]:
    return {a["label"]: a for a in report["arms"]}


def hyp(report: dict, hid: str) -> dict:
    return next(h for h in report["hypotheses"] if h["id"] == hid)


def test_pooling_keeps_per_run_counts_and_never_pools_interrupted_runs():
    runs = [
        run({}, 9, 49, rep=0, errored=2),
        run({}, 8, 52, rep=1),
        # interrupted, then re-run on resume: the FINISHED run replaces it
        run({}, 5, 10, rep=2, status="KILLED", outcomes="partial"),
        run({}, 10, 50, rep=2),
        # interrupted with outcomes, never re-run: listed, not pooled (biased towards corrupted
        # sessions); the arm is partial
        run({"multi_stream": "off"}, 0, 30, rep=0, status="KILLED", outcomes="partial", reason="interrupted"),
        run({"multi_stream": "off"}, 0, 60, rep=1),
        # failed before any session: nothing to count
        run({"capture": "eager"}, 0, 0, rep=0, status="FAILED", outcomes="none", reason="health timeout"),
    ]
    arms = {a.label: a for a in pool_arms(runs, SPEC)}
    base = arms["baseline"]
    assert (base.corrupted, base.n, base.errored) == (27, 27 + 151, 2)
    assert base.run_counts == ((9, 58), (8, 60), (10, 60))
    assert base.partial is False
    assert [r.used for r in base.runs] == [True, True, True, False]
    # these runs vary less than binomial: no between-run variation, the exact interval of the sessions
    assert base.design_effect == 1.0 and base.effective_n == 178
    assert base.ci == pytest.approx(stats.clopper_pearson(27, 178))
    off = arms["multi_stream=off"]
    assert (off.corrupted, off.n, off.partial) == (0, 60, True)
    eager = arms["capture=eager"]
    assert (eager.n, eager.rate, eager.ci) == (0, None, None)
    assert eager.runs[0].reason == "health timeout"
    # the report lists every run that failed, was interrupted or lost sessions to errors, with why
    problems = {(p["arm"], p["repetition"], p["status"]): p for p in report_json(SPEC, runs)["problem_runs"]}
    assert set(problems) == {
        ("baseline", 0, "FINISHED"),
        ("baseline", 2, "KILLED"),
        ("multi_stream=off", 0, "KILLED"),
        ("capture=eager", 0, "FAILED"),
    }
    assert "2 sessions errored" in problems["baseline", 0, "FINISHED"]["reason"]
    assert problems["baseline", 2, "KILLED"]["used"] is False
    killed = problems["multi_stream=off", 0, "KILLED"]
    assert killed["used"] is False and killed["clean"] == 30 and "not pooled" in killed["reason"]


def test_treatment_is_the_arm_that_differs_only_in_that_factor():
    runs = [run({}, 27, 153), run({"multi_stream": "off", "capture": "eager"}, 0, 180)]
    report = report_json(SPEC, runs)
    h = hyp(report, "H-multistream")
    assert h["treatment_arm"] is None and h["verdict"] == "inconclusive"
    assert "no arm with multi_stream=off" in h["note"]
    report = report_json(SPEC, [*runs, run({"multi_stream": "off"}, 0, 180)])
    assert hyp(report, "H-multistream")["treatment_arm"] == "sig[multi_stream=off]"


def test_original_investigation_verdicts_and_deploy_choice():
    def bench(speed: float) -> tuple[LevelSample, ...]:
        rng = np.random.default_rng(int(speed * 100))
        return tuple(
            level(c, list(rng.integers(60, 68, 40).astype(float)), list(rng.uniform(1, 1.2, 40) / speed))
            for c in (1, 8, 32)
        )

    runs = []
    counts = {"baseline": 9, "H-multistream": 0, "H-capture": 0, "H-bf16": 0, "H-hicache": 3}
    speed = {"baseline": 1.0, "H-multistream": 1.0, "H-capture": 0.5, "H-bf16": 0.97, "H-hicache": 1.0}
    for name, delta in DELTAS.items():
        for rep in range(3):
            runs.append(run(delta, counts[name], 60 - counts[name], rep=rep, bench=bench(speed[name])))
    report = report_json(SPEC, runs, {"parent_run_id": "p"})
    verdicts = {h["id"]: h["verdict"] for h in report["hypotheses"]}
    assert verdicts == {
        "H-multistream": "implicated",
        "H-capture": "implicated",
        "H-bf16": "implicated",
        "H-hicache": "partial",
    }
    tput = {t["label"]: t for t in report["throughput"]}
    assert tput["capture=eager"]["verdict"] == "regression"
    assert tput["multi_stream=off"]["verdict"] == "no regression"
    for lv in tput["multi_stream=off"]["levels"]:
        assert lv["method"] == "requests" and lv["ci"][0] <= lv["ratio"] <= lv["ci"][1]
    # multi-stream off removes it at no cost, eager halves throughput: deploy multi-stream off
    assert report["deploy"]["label"] == "multi_stream=off"
    assert report["deploy"]["throughput_verdict"] == "no regression"
    assert "H-multistream" in report["headline"] and "multi_stream=off" in report["headline"]
    # Holm: adjusted p never below the raw one; the smallest is multiplied by the family size
    ps = [h["p"] for h in report["hypotheses"]]
    assert [h["p_holm"] for h in report["hypotheses"]] == pytest.approx(stats.holm(ps))
    assert min(h["p_holm"] for h in report["hypotheses"]) == pytest.approx(min(1.0, 4 * min(ps)))


def test_client_bound_arm_gets_no_throughput_verdict():
    lv = (level(8, [64.0] * 20, [1.0] * 20),)
    runs = [run({}, 9, 51, bench=lv), run({"multi_stream": "off"}, 0, 60, bench=lv, client_bound=True)]
    t = report_json(SPEC, runs)["throughput"][0]
    assert t["levels"][0]["clears_floor"] is True
    assert t["verdict"] == "no verdict (client-bound)"


def test_a_server_that_sent_no_usage_gets_no_throughput_verdict_naming_it():
    lv = (level(8, [64.0] * 20, [1.0] * 20),)
    base = run({}, 9, 51, bench=lv)
    arm = dataclasses.replace(run({"multi_stream": "off"}, 0, 60, bench=lv), missing_usage=3)
    t = report_json(SPEC, [base, arm])["throughput"][0]
    assert not t["client_bound"] and t["verdict"] == "no verdict (the server sent no usage)"


def test_families_per_arm_counted_and_noted_beside():
    base = dataclasses.replace(
        run({}, 9, 51),
        families={"structural": 9, "plan_drift": 4},
        conditions={"workload.count": "structural"},
    )
    fix = dataclasses.replace(
        run({"multi_stream": "off"}, 0, 60),
        families={"plan_drift": 5},
        conditions={"workload.count": "structural"},
    )
    result = analyse(SPEC, [base, fix])
    block = to_json(result)["families"]
    assert block["counted"] == ["structural"] and block["same_in_every_arm"]
    rows = {r["label"]: r for r in block["by_arm"]}
    assert rows["baseline"]["counted"] == {"structural": 9} and rows["baseline"]["noted"] == {"plan_drift": 4}
    assert rows["multi_stream=off"]["counted"] == {"structural": 0} and rows["multi_stream=off"]["noted"] == {
        "plan_drift": 5
    }
    text = render_markdown(result)
    assert "## Detector families" in text and "plan_drift (not counted)" in text
    assert "| baseline | 60 | 9 | 4 |" in text


def test_throughput_falls_back_to_per_run_tok_s():
    def lv(tok_s: float) -> tuple[LevelSample, ...]:
        return (LevelSample(concurrency=8, tok_s=tok_s),)

    runs = [run({}, 9, 51, rep=r, bench=lv(400 + r)) for r in range(3)]
    runs += [run({"multi_stream": "off"}, 0, 60, rep=r, bench=lv(200 + r)) for r in range(3)]
    t = report_json(SPEC, runs)["throughput"][0]
    assert t["levels"][0]["method"] == "runs"
    assert t["levels"][0]["ratio"] == pytest.approx(201 / 401)
    assert t["verdict"] == "regression"


@pytest.mark.parametrize(
    "counts,p_holm,verdict,text",
    [
        ((27, 180, 0, 180), 1e-8, "implicated", "corruption gone"),
        ((27, 180, 6, 180), 1e-3, "partial", "corruption remains: 6/180"),
        # none seen, but 60 sessions cannot bound the rate under 3%
        ((27, 180, 0, 60), 1e-3, "partial", "122 treatment sessions"),
        ((150, 1000, 152, 1000), 0.9, "exonerated", "within ±7.5%"),
        ((9, 60, 7, 60), 0.8, "inconclusive", "sessions per arm would find a difference of 7.5%"),
        # no corruption with the change is never "no effect", however few the sessions
        ((2, 60, 0, 60), 0.5, "inconclusive", "never exonerated"),
        ((0, 600, 0, 600), 1.0, "inconclusive", "nothing to explain"),
        ((5, 180, 30, 180), 1e-5, "inconclusive", "rose"),
        ((0, 0, 3, 60), 1.0, "inconclusive", "baseline arm"),
    ],
)
def test_judge(counts, p_holm, verdict, text):
    out = judge(*counts, p_holm, SPEC, family_size=4)
    assert out.verdict == verdict
    assert text in out.note


def test_inconclusive_reports_sessions_needed_at_the_baseline_rate():
    out = judge(9, 60, 7, 60, 0.8, SPEC, family_size=4)
    need = stats.sessions_needed(9 / 60, SPEC.min_effect * 9 / 60, SPEC.alpha / 4, 0.8)
    assert out.sessions_needed_per_arm == need
    assert out.more_sessions == MoreSessions(baseline=need - 60, treatment=need - 60)
    # correlated runs: the same counts need more sessions, and the bound is wider
    wide = judge(9, 60, 7, 60, 0.8, SPEC, family_size=4, deff=(2.0, 2.0))
    assert wide.sessions_needed_per_arm == stats.sessions_needed(0.15, 0.075, SPEC.alpha / 4, 0.8, 2.0)
    assert wide.sessions_needed_per_arm >= 2 * need - 1


def test_exoneration_is_relative_to_the_bug():
    """A true cause of a 2-3% bug: an absolute 5-point margin exonerated it; half the baseline's rate
    does not, while a 15% bug with a truly unchanged rate can be exonerated with enough sessions."""
    absolute = StudySpec(name="a", baseline=BASE, hypotheses=HYPS, min_effect=0.05, min_effect_relative=False)
    assert judge(4, 180, 2, 180, 0.7, absolute, 4).verdict == "exonerated"
    assert judge(4, 180, 2, 180, 0.7, SPEC, 4).verdict == "inconclusive"
    assert judge(600, 4000, 610, 4000, 0.8, SPEC, 4).verdict == "exonerated"


def test_analysis_is_deterministic_and_order_free():
    lv = (level(8, [64.0, 60.0, 66.0] * 10, [1.0, 1.1, 0.9] * 10),)
    runs = [
        run(delta, 3 if not delta else 1, 57, rep=r, bench=lv) for delta in DELTAS.values() for r in range(2)
    ]
    a = dumps(analyse(SPEC, runs))
    b = dumps(analyse(SPEC, list(reversed(runs))))
    assert a == b


def _null_study(rng: np.random.Generator, rate: float, n: int) -> list[RunRecord]:
    runs = []
    for delta in DELTAS.values():
        for rep in range(3):
            k = int(rng.binomial(n, rate))
            runs.append(run(delta, k, n - k, rep=rep))
    return runs


@pytest.mark.parametrize("rate,ceiling", [(0.15, 0.03), (0.02, 0.06)])
def test_monte_carlo_no_factor_effect_implicates_at_most_alpha(rate, ceiling):
    """No factor changes the corruption rate: the share of studies in which any hypothesis is implicated
    (and, stricter, any comparison is significant after Holm) stays at or under alpha."""
    spec = StudySpec(name="mc", baseline=BASE, hypotheses=HYPS, alpha=0.05, ceiling=ceiling)
    rng = np.random.default_rng(20240611)
    sims = 300
    implicated = significant = unadjusted = 0
    for _ in range(sims):
        report = report_json(spec, _null_study(rng, rate, 60))
        implicated += any(h["verdict"] == "implicated" for h in report["hypotheses"])
        significant += any(h["p_holm"] < spec.alpha for h in report["hypotheses"])
        unadjusted += any(h["p"] < spec.alpha for h in report["hypotheses"])
    assert implicated / sims <= spec.alpha
    assert significant / sims <= spec.alpha
    # the family is what Holm protects: raw p-values alone would flag more studies
    assert unadjusted > significant


def test_monte_carlo_real_effect_is_found():
    """The same machinery has power: with multi-stream off truly clean, it is implicated nearly always."""
    rng = np.random.default_rng(5)
    sims, found = 60, 0
    for _ in range(sims):
        runs = []
        for name, delta in DELTAS.items():
            for rep in range(3):
                k = 0 if name == "H-multistream" else int(rng.binomial(60, 0.15))
                runs.append(run(delta, k, 60 - k, rep=rep))
        found += hyp(report_json(SPEC, runs), "H-multistream")["verdict"] == "implicated"
    assert found / sims >= 0.95
