"""GPU time (orchestrator/analysis/cost.py): the cost model and where its figures come from, the run size
that buys the most evidence per GPU-second, runs of several sizes pooled as one arm, and the sequential
design that sizes its runs, checked by simulation through the code that judges real runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from orchestrator.analysis import RunRecord, cost, stats
from orchestrator.analysis.runs import identity
from orchestrator.config.plan import arm_conditions, measurement_conditions
from orchestrator.config.schema import CostConf, StoppingConf, StressConf
from orchestrator.report.console import SweepView, gpu_hours_held, progress_lines
from orchestrator.report.render import render_markdown
from orchestrator.run.progress import ArmProgress
from orchestrator.study.rehearse import rehearse_sequential, sequential_design, sequential_study
from tests.conftest import report_json
from tests.test_rehearse import SEED_STORY, SPEC
from tests.test_sequential import truths

# the real cluster: a DeepSeek-V4 PD restart 8 min on 8 GPUs, a session 1 s at full load
REAL = cost.CostModel(restart_s=480, session_s=1.0, bench_s=300, gpus=8)
# the embedded default's own (conf/deployment/sim_dsv4.yaml)
EMBEDDED = cost.CostModel(restart_s=5, session_s=0.06, bench_s=3, gpus=8)


def run(k: int, n: int, rep: int = 0, **extra) -> RunRecord:
    fields = {"factors": {"ms": "on"}, "outcomes": "complete", "planned": n, **extra}
    return RunRecord(f"r{rep}-{n}", "FINISHED", "sig", rep, clean=n - k, corrupted=k, **fields)


# --- run size ------------------------------------------------------------------------------------------


def test_the_run_size_buys_the_most_evidence_per_gpu_second_of_every_whole_number_of_waves():
    for model, icc in ((REAL, 0.02), (REAL, 0.1), (EMBEDDED, 0.02), (REAL, 0.0)):
        chosen = cost.run_size(model, icc, load=60, smallest=60, largest=600)
        assert chosen % 60 == 0 and 60 <= chosen <= 600

        def worth(n: int, model=model, icc=icc) -> float:
            rho = max(icc, cost.SIZING_ICC_FLOOR)
            return cost.effective_sessions(n, rho) / model.run_s(n)

        assert all(worth(chosen) >= worth(n) - 1e-12 for n in range(60, 601, 60)), (model, icc, chosen)


def test_dear_restarts_make_runs_longer_and_restart_variation_makes_them_shorter():
    # restarts of 8 min: ~sqrt(480 * 49) = 153 sessions is the optimum, 180 the nearest whole wave above
    assert cost.run_size(REAL, 0.02, 60, 60, 600) == 180
    # restarts of seconds: the workload's own size
    assert cost.run_size(EMBEDDED, 0.02, 60, 60, 600) == 60
    # a large ICC: a start is worth little past a few dozen sessions, so more starts
    assert cost.run_size(REAL, 0.3, 60, 60, 600) == 60
    # no bound above the smallest: the workload's size, untouched
    assert cost.run_size(REAL, 0.02, 60, 60, 60) == 60


# --- the cost model ------------------------------------------------------------------------------------


def test_each_figure_comes_from_the_study_else_the_runs_else_the_deployment_and_says_which():
    deployment = {"restart_s": 480, "session_s": 1.0, "bench_s": 300, "gpus": 8}
    alone = cost.cost_model(CostConf(), deployment)
    assert (alone.restart_s, alone.session_s, alone.gpus) == (480, 1.0, 8)
    assert set(alone.sources.values()) == {"deployment.cost"}
    # three finished runs: 60 sessions in 6 s of stress, held 26 s (a restart of 20 s); one with a sweep
    runs = [
        run(3, 60, 0, wall_s=26.0, stress_s=6.0),
        run(2, 60, 1, wall_s=28.0, stress_s=6.0),
        run(4, 60, 2, wall_s=36.0, stress_s=6.0, bench=("level",)),
    ]
    measured = cost.cost_model(CostConf(gpus=2), deployment, runs)
    assert measured.session_s == pytest.approx(0.1)
    assert measured.restart_s == pytest.approx(21.0)  # the median of 20 and 22
    assert measured.bench_s == pytest.approx(30.0 - 21.0)
    assert measured.gpus == 2 and measured.sources["gpus"] == "study.cost"
    assert measured.sources["restart_s"].startswith("measured")
    # a run not FINISHED, or one without its times, measures nothing
    assert cost.measured([replace(runs[0], status="FAILED"), replace(runs[1], wall_s=None)]) == {}


def test_gpu_time_spent_counts_every_run_measured_where_known_and_modelled_where_not():
    runs = [
        run(3, 60, 0, wall_s=540.0, stress_s=60.0),
        replace(run(0, 60, 1), status="FAILED", outcomes="none", clean=0, wall_s=300.0),  # held GPUs too
        run(1, 120, 2),  # no wall time: the model's 480 + 120
    ]
    spent = cost.spent(runs, REAL)
    assert spent.starts == 3 and spent.modelled_runs == 1
    assert spent.wall_s == pytest.approx(540 + 300 + 600)
    assert spent.gpu_hours == pytest.approx(8 * 1440 / 3600)
    assert spent.model_hours == pytest.approx(8 * (540 + 540 + 600) / 3600)  # the failed run: 60 planned


# --- runs of several sizes: one arm -------------------------------------------------------------------


def test_the_number_of_sessions_is_no_part_of_an_arm_but_its_load_is():
    sixty = measurement_conditions(StressConf(sessions=60, concurrency=None))
    larger = measurement_conditions(StressConf(sessions=180, concurrency=60))
    assert sixty == larger and "workload.sessions" not in sixty
    assert measurement_conditions(StressConf(sessions=180, concurrency=None)) != sixty  # 180 at once
    # a run logged before: its sessions and "None" for all at once read as today's identity
    old = {"workload.sessions": "60", "workload.rounds": "4", "workload.concurrency": "None"}
    assert arm_conditions(old) == {"workload.rounds": "4", "workload.concurrency": "60"}
    a = run(3, 60, 0, conditions=arm_conditions(old))
    b = run(
        9,
        180,
        1,
        conditions={k: v for k, v in larger.items() if k in ("workload.rounds", "workload.concurrency")},
    )
    assert identity(a) == identity(b)


def test_pooled_runs_of_several_sizes_have_the_design_effect_of_their_pooled_rate():
    """By simulation: runs of 60 and 180 sessions at ICC 0.05, the variance of the pooled rate over 40,000
    arms against p (1 - p) D / N with D from `stats.pooled_run_size` (the mean size would say 1 + 119 rho)."""
    rng = np.random.default_rng(7)
    p, icc, sizes = 0.15, 0.05, np.array([60, 180])
    scale = (1 - icc) / icc
    rates = rng.beta(p * scale, (1 - p) * scale, size=(40_000, 2))
    pooled = rng.binomial(sizes, rates).sum(axis=1) / sizes.sum()
    deff = stats.design_effect(icc, stats.pooled_run_size(list(sizes)))
    assert pooled.var() == pytest.approx(p * (1 - p) * deff / sizes.sum(), rel=0.05)
    assert stats.design_effect(icc, sizes.mean()) < deff * 0.85  # the mean size understates it
    assert stats.pooled_run_size([60, 60, 60]) == 60


# --- the sequential design sizes its runs ------------------------------------------------------------


def sized_spec(largest: int | None, model: cost.CostModel, **stopping):
    return replace(
        SPEC,
        name="dsv4_sequential",
        stopping=StoppingConf(max_runs_per_arm=4, max_run_sessions=largest, **stopping),
        cost=CostConf(model.restart_s, model.session_s, model.bench_s, model.gpus),
    )


def test_the_design_sizes_each_start_by_the_cost_model_and_pins_the_load():
    spec = sized_spec(600, REAL)
    arms = truths(spec, SEED_STORY, 0.02)
    runs = sequential_study(spec, arms, 60, np.random.default_rng(1))
    assert {r.planned for r in runs} == {180}
    job = sequential_design(spec, arms, 60).next_round([], -1).jobs[0]
    assert "workload.sessions=180" in job.overrides and "workload.concurrency=60" in job.overrides
    cheap = sequential_study(sized_spec(600, EMBEDDED), arms, 60, np.random.default_rng(1))
    assert {r.planned for r in cheap} == {60}
    unsized = sequential_study(sized_spec(None, REAL), arms, 60, np.random.default_rng(1))
    assert {r.planned for r in unsized} == {60}


@pytest.mark.slow
# where the error is likeliest: restart ICC 0.1 (the 2,000-study cells: bench/rehearse_table.py)
@pytest.mark.parametrize(("rate", "icc"), [(0.03, 0.1), (0.15, 0.1)])
def test_sized_runs_keep_family_wise_false_implication_under_alpha(rate, icc):
    """Null models with the runs sized for a real cluster (180 sessions a start while the ICC is unknown),
    a fifth of the runs killed part-way: the sizing looks only at the past, so the evidence stays a test
    martingale."""
    spec = sized_spec(600, REAL)
    arms = truths(spec, dict.fromkeys(SEED_STORY, rate), icc)
    result = rehearse_sequential(spec, arms, 60, studies=600, seed=21, kill_rate=0.2, cost_model=REAL)
    assert result["family_false_implication"] <= spec.alpha, result["family_false_implication"]


def test_the_rehearsal_states_gpu_hours_beside_the_fixed_design():
    spec = sized_spec(None, REAL)
    result = rehearse_sequential(
        spec, truths(spec, SEED_STORY, 0.02), 60, studies=60, seed=3, cost_model=REAL
    )
    # the fixed dsv4 design: 5 arms x 4 starts of (480 + 60) s on 8 GPUs
    assert result["fixed_design_gpu_hours"] == pytest.approx(5 * 4 * 540 * 8 / 3600)
    per_start = REAL.gpu_hours(REAL.run_s(60))
    assert result["gpu_hours_per_study"] == pytest.approx(result["starts_per_study"] * per_start)
    assert result["starts_per_study"] >= 10  # two starts per arm at least (min_runs_per_arm)


# --- where GPU time is shown ---------------------------------------------------------------------------


def test_the_report_states_gpu_time_spent_and_the_model_behind_it():
    runs = [
        run(9, 60, rep, wall_s=30.0, stress_s=6.0, factors=levels)
        for rep in range(2)
        for levels in ({"ms": "on"}, {"ms": "off"})
    ]
    from orchestrator.analysis import HypothesisSpec, StudySpec, analyse

    spec = StudySpec(
        name="t", baseline={"ms": "on"}, hypotheses=(HypothesisSpec("H", "ms", "s", "on", "off"),)
    )
    report = report_json(spec, runs, {"deployment_cost": {"restart_s": 400, "gpus": 4}})
    block = report["cost"]
    assert block["starts"] == 4 and block["gpu_hours"] == pytest.approx(4 * 4 * 30 / 3600, abs=1e-4)
    assert block["model"]["restart_s"] == pytest.approx(24.0)  # measured, not the deployment's 400
    assert block["model"]["sources"]["gpus"] == "deployment.cost"
    text = render_markdown(analyse(spec, runs, {"deployment_cost": {"gpus": 4}}))
    assert "## GPU time" in text and "0.13 GPU hours: 4 server starts" in text


def test_the_progress_display_states_gpu_time_held_and_left():
    arms = (
        ArmProgress(0, "baseline", 0, phase="done", status="FINISHED", started=0.0, updated=900.0),
        ArmProgress(1, "ms=off", 0, phase="stress", started=900.0, updated=1000.0),
    )
    view = SweepView("s", planned=4, started=0.0, arms=arms, gpus=8)
    assert gpu_hours_held(view, now=1800.0) == pytest.approx(8 * (900 + 900) / 3600)
    line = progress_lines(view, now=1800.0)[-1]
    assert "GPU time 4.00 h on 8 GPU(s)" in line and "h more" in line
    assert "GPU time" not in progress_lines(replace(view, gpus=0), now=1800.0)[-1]


def test_an_interrupted_sequential_study_states_the_most_gpu_time_it_may_still_spend():
    from orchestrator.study.designs import analyse_study

    spec = sized_spec(None, REAL)  # 4 starts per arm at most
    arms = truths(spec, SEED_STORY, 0.02)
    runs = [r for r in sequential_study(spec, arms, 60, np.random.default_rng(2)) if r.repetition == 0]
    block = report_json(spec, runs)["cost"]  # no design named: a fixed study's report, no budget
    assert block["remaining_gpu_hours"] is None
    result = analyse_study(spec, runs, {"design": "sequential"})
    # one round of five arms: nothing decided before two; four hypotheses open, five arms, three rounds left
    assert result.cost.remaining_gpu_hours == pytest.approx(REAL.gpu_hours(5 * 3 * REAL.run_s(60)), abs=1e-3)
    assert result.cost.fixed_design_gpu_hours == pytest.approx(
        REAL.gpu_hours(5 * 4 * REAL.run_s(60)), abs=1e-3
    )
    assert "at most 18.00 GPU hours more" in render_markdown(result)
