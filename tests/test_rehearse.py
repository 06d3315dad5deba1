"""Rehearsal: the design Monte Carlo through the analysis that judges real runs, its truth, its CLI; and
the pooling rules a rehearsal cannot see (killed runs, runs of another workload)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from orchestrator.analysis import HypothesisSpec, RunRecord, StudySpec
from orchestrator.study.rehearse import ArmTruth, draw_counts, rehearse, study_arms, truth, wrong
from tests.conftest import report_json

REPO = Path(__file__).resolve().parents[1]
BASE = {"capture": "graph", "hicache": "on", "index_k": "bf16", "multi_stream": "on"}
HYPS = (
    HypothesisSpec("H-multistream", "multi_stream", "needs multi-stream overlap", "on", "off"),
    HypothesisSpec("H-capture", "capture", "needs CUDA-graph capture", "graph", "eager"),
    HypothesisSpec("H-bf16", "index_k", "needs bf16 index keys", "bf16", "fp8"),
    HypothesisSpec("H-hicache", "hicache", "needs HiCache", "on", "off"),
)
# the dsv4 study: 5 arms x 3 runs x 60 sessions, ceiling 3%
SPEC = StudySpec(name="dsv4", baseline=BASE, hypotheses=HYPS, ceiling=0.03)
RUNS, SESSIONS = 3, 60


def arms_at(rates: dict[str, float], icc: float) -> list[ArmTruth]:
    """The study's arms with these rates (by label; missing labels: the baseline's rate)."""
    out = []
    for label, levels in study_arms(SPEC):
        rate = rates.get(label, rates["baseline"])
        out.append(ArmTruth(label, levels, rate, icc if rate > 0 else 0.0))
    return out


SEED_STORY = {
    "baseline": 0.15,
    "hicache=off": 0.05,
    "multi_stream=off": 0.0,
    "capture=eager": 0.0,
    "index_k=fp8": 0.0,
}


def test_study_arms_are_the_baseline_and_each_treatment():
    labels = [label for label, _ in study_arms(SPEC)]
    assert labels == ["baseline", "multi_stream=off", "capture=eager", "index_k=fp8", "hicache=off"]


def test_truth_and_what_counts_as_wrong():
    rows = {r["id"]: r for r in truth(SPEC, arms_at(SEED_STORY, 0.0))}
    assert rows["H-multistream"]["causal"] and rows["H-multistream"]["expected"] == "implicated"
    assert rows["H-hicache"]["causal"] and rows["H-hicache"]["expected"] == "partial"  # 5% >= ceiling
    null = {r["id"]: r for r in truth(SPEC, arms_at({"baseline": 0.15}, 0.0))}
    assert not null["H-capture"]["causal"] and null["H-capture"]["expected"] == "exonerated"
    assert wrong("partial", null["H-capture"], 0.03) and wrong("implicated", null["H-capture"], 0.03)
    assert not wrong("inconclusive", null["H-capture"], 0.03)
    assert wrong("exonerated", rows["H-hicache"], 0.03)
    assert wrong("implicated", rows["H-hicache"], 0.03)  # 5% remains: not under the ceiling
    assert not wrong("partial", rows["H-hicache"], 0.03)
    assert not wrong("implicated", rows["H-multistream"], 0.03)


@pytest.mark.parametrize(("rate", "icc"), [(0.15, 0.0), (0.15, 0.1), (0.03, 0.05)])
def test_drawn_runs_have_the_modelled_rate_and_icc(rate, icc):
    """Each run's rate is drawn from Beta(mean rate, ICC icc): the ANOVA estimate recovers both."""
    arm = ArmTruth("baseline", BASE, rate, icc)
    k = draw_counts([arm], 1, SESSIONS, 20_000, np.random.default_rng(1))[:, 0, 0]
    assert k.mean() / SESSIONS == pytest.approx(rate, rel=0.03)
    msb = SESSIONS * np.var(k / SESSIONS, ddof=1)
    msw = np.mean(k * (SESSIONS - k) / SESSIONS) / (SESSIONS - 1)
    assert (msb - msw) / (msb + (SESSIONS - 1) * msw) == pytest.approx(icc, abs=0.01)


def test_rehearsal_is_reproducible_and_counts_sessions():
    a = rehearse(SPEC, arms_at(SEED_STORY, 0.02), RUNS, SESSIONS, 30, seed=4)
    assert a == rehearse(SPEC, arms_at(SEED_STORY, 0.02), RUNS, SESSIONS, 30, seed=4)
    assert a["sessions_per_study"] == 5 * RUNS * SESSIONS
    for h in a["hypotheses"]:
        assert sum(h["verdicts"].values()) == pytest.approx(1.0)


@pytest.mark.parametrize(("rate", "icc"), [(0.03, 0.0), (0.03, 0.1), (0.15, 0.02), (0.15, 0.1)])
def test_null_models_keep_family_wise_false_implication_under_alpha(rate, icc):
    """Issue 13's Must-show on fewer studies: nothing matters, every arm at `rate`, runs correlated by
    `icc`; the share of studies implicating (or partially implicating) anything stays <= alpha."""
    result = rehearse(SPEC, arms_at({"baseline": rate}, icc), RUNS, SESSIONS, 400, seed=13)
    assert result["family_false_implication"] <= SPEC.alpha
    assert all(
        h["verdicts"]["exonerated"] + h["verdicts"]["inconclusive"] >= 0.95 for h in result["hypotheses"]
    )


def test_seed_story_verdicts_are_right_and_mostly_decided_at_icc_002():
    result = rehearse(SPEC, arms_at(SEED_STORY, 0.02), RUNS, SESSIONS, 400, seed=13)
    assert result["all_right"] >= 0.95
    hyps = {h["id"]: h for h in result["hypotheses"]}
    # the clean arms are found (implicated, or partial while the bound is not under the ceiling)
    for hid in ("H-multistream", "H-capture", "H-bf16"):
        found = hyps[hid]["verdicts"]["implicated"] + hyps[hid]["verdicts"]["partial"]
        assert found >= 0.75, hyps[hid]
    assert hyps["H-hicache"]["verdicts"]["exonerated"] == 0.0


def test_between_run_variation_is_what_keeps_the_rule_honest():
    """The same null studies judged as if sessions were independent (assumed, one pooled run per arm)
    implicate far more often at ICC 0.1: the run, not the session, is the replicate."""
    rng = np.random.default_rng(2)
    arms = arms_at({"baseline": 0.15}, 0.1)
    counts = draw_counts(arms, RUNS, SESSIONS, 300, rng)
    naive = 0
    for s in range(300):
        runs = [
            RunRecord(
                run_id=a.label,
                status="FINISHED",
                signature=a.label,
                repetition=0,
                factors=a.levels,
                outcomes="complete",
                corrupted=int(k.sum()),
                clean=RUNS * SESSIONS - int(k.sum()),
            )
            for a, k in zip(arms, counts[s], strict=True)
        ]
        naive += any(h["verdict"] in ("implicated", "partial") for h in report_json(SPEC, runs)["hypotheses"])
    honest = rehearse(SPEC, arms, RUNS, SESSIONS, 300, seed=2)["family_false_implication"]
    assert naive / 300 > 0.2 > SPEC.alpha >= honest


# --- what is pooled ---------------------------------------------------------------------------------


def record(label: str, levels: dict, k: int, n: int, rep: int, **kw) -> RunRecord:
    return RunRecord(
        run_id=kw.pop("run_id", f"{label}-{rep}-{kw.get('status', 'FINISHED')}"),
        status=kw.pop("status", "FINISHED"),
        signature=f"sig[{label}]",
        repetition=rep,
        factors=dict(levels),
        outcomes=kw.pop("outcomes", "complete"),
        corrupted=k,
        clean=n - k,
        **kw,
    )


def seed_story_runs(rng: np.random.Generator, conditions: dict | None = None) -> list[RunRecord]:
    runs = []
    for label, levels in study_arms(SPEC):
        for rep in range(RUNS):
            k = int(rng.binomial(SESSIONS, SEED_STORY[label]))
            runs.append(record(label, levels, k, SESSIONS, rep, conditions=dict(conditions or {})))
    return runs


def verdicts(report: dict) -> dict[str, str]:
    return {h["id"]: h["verdict"] for h in report["hypotheses"]}


def test_a_killed_run_does_not_change_the_verdicts():
    """A baseline run killed mid-way holds mostly corrupted sessions (they end at the first bad turn,
    clean ones need every round): listed with its counts, never pooled."""
    runs = seed_story_runs(np.random.default_rng(8))
    before = report_json(SPEC, runs)
    killed = record("baseline", BASE, 9, 14, 3, status="KILLED", outcomes="partial", reason="interrupted")
    after = report_json(SPEC, [*runs, killed])
    assert verdicts(after) == verdicts(before)
    assert [h["p"] for h in after["hypotheses"]] == [h["p"] for h in before["hypotheses"]]
    listed = [p for p in after["problem_runs"] if p["status"] == "KILLED"]
    assert listed and listed[0]["corrupted"] == 9 and listed[0]["used"] is False
    base = next(a for a in after["arms"] if a["label"] == "baseline")
    assert len(base["run_counts"]) == RUNS and base["partial"] is True


def test_runs_of_another_workload_are_another_arm():
    """An earlier sweep at 8 sessions x 1 round (rare corruption) is not pooled into today's arms: each
    hypothesis compares today's baseline with today's treatment."""
    today = {"workload.sessions": "60", "workload.rounds": "4"}
    earlier = {"workload.sessions": "8", "workload.rounds": "1"}
    rng = np.random.default_rng(3)
    runs_today = seed_story_runs(rng, today)
    runs_earlier = [
        record(label, levels, 0, 8, rep, conditions=earlier, run_id=f"old-{label}-{rep}")
        for label, levels in study_arms(SPEC)
        for rep in range(6)
    ]
    alone = report_json(SPEC, runs_today, conditions=today)
    mixed = report_json(SPEC, [*runs_today, *runs_earlier], conditions=today)
    assert verdicts(mixed) == verdicts(alone)
    assert [h["baseline_counts"] for h in mixed["hypotheses"]] == [
        h["baseline_counts"] for h in alone["hypotheses"]
    ]
    assert len(mixed["arms"]) == 2 * len(alone["arms"])  # the earlier arms are listed, apart
    base_ids = {h["baseline_arm"] for h in mixed["hypotheses"]}
    assert base_ids == {
        next(a["signature"] for a in mixed["arms"] if a["conditions"] == today and a["label"] == "baseline")
    }
    # without today's conditions the baseline with most sessions is chosen, and its own treatments
    assert verdicts(report_json(SPEC, [*runs_today, *runs_earlier])) == verdicts(alone)


def test_report_shows_per_run_counts_icc_and_design_effect():
    runs = seed_story_runs(np.random.default_rng(5))
    report = report_json(SPEC, runs)
    between = report["between_runs"]
    assert between["estimated"] and between["df"] == 4  # baseline and hicache=off: 2 runs of freedom each
    base = next(a for a in report["arms"] if a["label"] == "baseline")
    assert len(base["run_counts"]) == RUNS and sum(k for k, _ in base["run_counts"]) == base["corrupted"]
    assert base["design_effect"] == pytest.approx(1 + (SESSIONS - 1) * between["icc"])
    assert base["effective_n"] == round(base["n"] / base["design_effect"])
    h = report["hypotheses"][0]
    assert h["baseline_runs"] == base["run_counts"] and len(h["effective_counts"]) == 2
    # one run per arm: the ICC cannot be estimated, the report says what it assumed
    single = report_json(SPEC, [r for r in runs if r.repetition == 0])
    assert not single["between_runs"]["estimated"] and "assumed ICC 0" in single["between_runs"]["note"]


# --- the command ------------------------------------------------------------------------------------


def test_command_line_interface_writes_the_documented_json(tmp_path: Path):
    out = tmp_path / "r.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.study.rehearse",
            "+experiment=dsv4_corruption",
            "rehearse.studies=40",
            "rehearse.seed=3",
            f"rehearse.json={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "family-wise false implication" in done.stdout
    result = json.loads(out.read_text())
    for key in ("family_false_implication", "all_right", "sessions_per_study", "hypotheses"):
        assert key in result
    assert result["studies"] == 40 and result["sessions_per_study"] == 5 * 4 * 60
    hyps = {h["id"]: h for h in result["hypotheses"]}
    assert set(hyps) == {"H-multistream", "H-capture", "H-bf16", "H-hicache"}
    assert all(h["causal"] for h in hyps.values())  # the built-in model: every factor matters
    assert set(hyps["H-capture"]["verdicts"]) == {"implicated", "partial", "exonerated", "inconclusive"}
    arms = {a["label"]: a for a in result["design"]["arms"]}
    assert arms["baseline"]["rule"] == "overlap-race-hicache" and arms["capture=eager"]["rate"] == 0.0
    assert 0.13 <= arms["baseline"]["rate"] <= 0.18 and 0.03 <= arms["hicache=off"]["rate"] <= 0.07


def test_unknown_option_is_refused():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.study.rehearse",
            "+experiment=dsv4_corruption",
            "rehearse.sims=5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode != 0 and "rehearse.studies" in done.stderr


def test_a_repetition_sweep_on_the_command_line_sets_the_runs_per_arm():
    from orchestrator.study.rehearse import sweep_overrides

    plain, sweeps = sweep_overrides(
        ["+experiment=dsv4_corruption", "repetition=0,1,2,3", "workload.rounds=2"]
    )
    assert plain == ["+experiment=dsv4_corruption", "workload.rounds=2"] and sweeps == {"repetition": 4}


def test_assumed_icc_is_a_floor_under_the_estimate():
    runs = seed_story_runs(np.random.default_rng(5))
    plain = report_json(SPEC, runs)
    floored = report_json(StudySpec(**{**vars(SPEC), "assumed_icc": 0.05}), runs)
    assert plain["between_runs"]["icc"] < 0.05 == floored["between_runs"]["icc"]
    assert "floor" in floored["between_runs"]["note"]
    base = next(a for a in floored["arms"] if a["label"] == "baseline")
    assert base["design_effect"] == pytest.approx(1 + 59 * 0.05)
