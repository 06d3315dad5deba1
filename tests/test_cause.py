"""The minimal cause: hand-built arms through the real analysis (runs -> pool_arms -> minimal_cause), the
markdown section, the statistics it adds, and Monte Carlo studies drawn as the rehearsal draws them."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from orchestrator.analysis import RunRecord, StudySpec, cause, stats
from orchestrator.analysis.result import MinimalCause, to_json
from orchestrator.analysis.study import analyse, arm_label, between_runs, pool_arms
from orchestrator.config.schema import Hypothesis
from orchestrator.report.render import dumps, render_markdown
from orchestrator.study.rehearse import ArmTruth, draw_counts, study_runs
from tests.conftest import report_json
from tests.shared_runs import FACTORIAL_RUN

BASE = {"capture": "graph", "index_k": "bf16", "multi_stream": "on", "hicache": "on"}
CHANGES = {"capture": "eager", "index_k": "fp8", "multi_stream": "off", "hicache": "off"}
SPEC = StudySpec(
    name="t",
    baseline=BASE,
    hypotheses=[Hypothesis(f"H-{f}", f, f"needs {f}", BASE[f], t) for f, t in CHANGES.items()],
)
DSV4_CAUSE = {"capture": "graph", "index_k": "bf16", "multi_stream": "on"}
TWO_BY_TWO_CAUSE = {"capture": "graph", "multi_stream": "on"}


def runs_of(changes: dict[str, str], per_run: list[tuple[int, int]], conditions=None) -> list[RunRecord]:
    levels = {**BASE, **changes}
    label = arm_label(levels, BASE)
    return [
        RunRecord(
            run_id=f"{label}-{rep}",
            status="FINISHED",
            signature=f"sig[{label}]",
            repetition=rep,
            factors=levels,
            outcomes="complete",
            corrupted=k,
            clean=n - k,
            planned=n,
            conditions=dict(conditions or {}),
        )
        for rep, (k, n) in enumerate(per_run)
    ]


def block_of(runs: list[RunRecord], spec: StudySpec = SPEC) -> dict:
    return report_json(spec, runs)["minimal_cause"]


def levels_found(block: dict) -> list[dict[str, str]]:
    return [c["levels"] for c in block["conjunctions"]]


CLEAN4 = [(0, 60)] * 4


def dsv4_runs(multi_stream_off=CLEAN4) -> list[RunRecord]:
    """The worked example's counts (docs/examples/dsv4_corruption): one factor at a time."""
    return [
        *runs_of({}, [(7, 60), (14, 60), (6, 60), (10, 60)]),
        *runs_of({"capture": "eager"}, CLEAN4),
        *runs_of({"index_k": "fp8"}, CLEAN4),
        *runs_of({"multi_stream": "off"}, multi_stream_off),
        *runs_of({"hicache": "off"}, [(6, 60), (6, 60), (1, 60), (5, 60)]),
    ]


def two_by_two_runs(rates: dict[tuple[str, str], list[tuple[int, int]]]) -> list[RunRecord]:
    return [
        run
        for (capture, ms), per_run in rates.items()
        for run in runs_of({"capture": capture, "multi_stream": ms}, per_run)
    ]


# --- hand-built arms -------------------------------------------------------------------------------


def test_one_factor_at_a_time_gives_the_seeds_conjunction_with_its_limits():
    block = block_of(dsv4_runs())
    assert block["verdict"] == "minimal cause found"
    assert levels_found(block) == [DSV4_CAUSE]
    states = {a["label"]: a["state"] for a in block["arms"]}
    assert states == {
        "baseline": "corrupting",
        "hicache=off": "corrupting",
        "capture=eager": "clean",
        "index_k=fp8": "clean",
        "multi_stream=off": "clean",
    }
    (conj,) = block["conjunctions"]
    # each conjunct shown necessary by the baseline and the arm that removes only it
    for factor, evidence in conj["necessary"].items():
        assert evidence["evidence"] == "pair", evidence
        assert (evidence["with"]["label"], evidence["without"]["label"]) == (
            "baseline",
            f"{factor}={CHANGES[factor]}",
        )
    # HiCache: corruption at both of its levels, with a different rate
    assert conj["sufficient"]["factors"]["hicache"]["status"] == "shown"
    (mod,) = block["modulators"]
    assert (mod["factor"], mod["levels"], [a["label"] for a in mod["arms"]]) == (
        "hicache",
        ["on", "off"],
        ["baseline", "hicache=off"],
    )
    assert mod["ci"][1] < 0 and mod["rates"] == [37 / 240, 18 / 240]
    assert block["effects"] is None and block["factorial"] is None
    # one factor at a time never changes two conjuncts together: the combinations that could change it
    (limit,) = block["limits"]
    assert "No arm changes capture and index_k" in limit
    assert (
        "capture=eager + index_k=fp8" in limit and "capture=eager + index_k=fp8 + multi_stream=off" in limit
    )
    assert "assuming each factor acts alike" in limit
    assert block["summary"].startswith("Corruption needs capture=graph AND index_k=bf16 AND multi_stream=on")
    assert "hicache modulates it" in block["summary"]
    # the study's one state per arm, at the policy's 95% (analysis/states.py), the hypotheses' confidence
    assert block["confidence"] == 0.95 and block["arm_confidence"] == pytest.approx(0.95)


def test_a_two_by_two_factorial_finds_the_interaction_and_its_effect():
    block = block_of(
        two_by_two_runs(
            {
                ("graph", "on"): [(12, 60), (9, 60), (11, 60)],
                ("graph", "off"): [(0, 60)] * 3,
                ("eager", "on"): [(0, 60)] * 3,
                ("eager", "off"): [(0, 60)] * 3,
            }
        )
    )
    assert block["verdict"] == "minimal cause found"
    assert levels_found(block) == [TWO_BY_TWO_CAUSE]
    assert block["factorial"]["factors"] == ["capture", "multi_stream"]
    assert block["factorial"]["fixed"] == {"hicache": "on", "index_k": "bf16"}
    effects = {tuple(e["factors"]): e for e in block["effects"]}
    interaction = effects[("capture", "multi_stream")]
    # the rate at (graph, on) minus the rest: (p_go - p_eo) - (p_gf - p_ef) = 32/180
    assert interaction["estimate"] == pytest.approx(32 / 180)
    assert interaction["ci"][0] > 0 and interaction["excludes_zero"]
    assert effects[("capture",)]["estimate"] == pytest.approx(16 / 180)
    assert interaction["confidence"] == pytest.approx(1 - 0.05 / 3)  # Bonferroni over 3 effects
    # nothing but the two swept factors was varied: say so
    assert any("Run at one level only (hicache=on, index_k=bf16)" in line for line in block["limits"])
    assert not any("No arm changes" in line for line in block["limits"])


def test_a_full_factorial_of_three_shows_the_cause_sufficient_across_the_third_factor():
    """2^3 over capture, multi_stream and index_k, corruption wherever capture=graph and multi_stream=on
    (index_k irrelevant): the conjunction leaves index_k out, and the cause corrupts at both its levels."""
    runs = []
    for capture in ("graph", "eager"):
        for ms in ("on", "off"):
            for index_k in ("bf16", "fp8"):
                # four starts: 0/240 is under 3% at 1 - 0.05/8, 0/180 is not
                per_run = (
                    [(9, 60), (11, 60), (10, 60), (8, 60)] if (capture, ms) == ("graph", "on") else CLEAN4
                )
                runs += runs_of({"capture": capture, "multi_stream": ms, "index_k": index_k}, per_run)
    block = block_of(runs)
    assert block["verdict"] == "minimal cause found"
    assert levels_found(block) == [TWO_BY_TWO_CAUSE]
    (conj,) = block["conjunctions"]
    assert conj["sufficient"]["factors"]["index_k"]["status"] == "shown"
    assert "sufficient across the levels tried of index_k" in conj["verdict"]
    assert block["factorial"]["factors"] == ["capture", "index_k", "multi_stream"]
    effects = {tuple(e["factors"]): e for e in block["effects"]}
    assert len(effects) == 6 and effects[("capture", "multi_stream")]["excludes_zero"]
    assert not effects[("capture", "index_k")]["excludes_zero"]
    assert not effects[("index_k",)]["excludes_zero"]


def test_two_separate_causes_fit_no_single_conjunction():
    """Corruption with graph capture OR multi-stream overlap: the corrupting arms share nothing a clean arm
    lacks."""
    corrupting = [(10, 60), (8, 60), (9, 60)]
    block = block_of(
        two_by_two_runs(
            {
                ("graph", "on"): corrupting,
                ("graph", "off"): corrupting,
                ("eager", "on"): corrupting,
                ("eager", "off"): [(0, 60)] * 3,
            }
        )
    )
    assert block["verdict"] == "no single conjunction fits"
    assert block["conjunctions"] == []
    assert "No single conjunction of these levels explains the arms" in block["summary"]
    assert "capture=eager" in block["summary"] and "multi_stream=off" in block["summary"]
    assert any("capture=eager,multi_stream=off have all of it" in line for line in block["limits"])


def test_all_clean_arms_leave_nothing_to_explain():
    block = block_of([*runs_of({}, [(0, 100)] * 3), *runs_of({"multi_stream": "off"}, [(0, 100)] * 3)])
    assert block["verdict"] == "no corruption to explain"
    assert block["conjunctions"] == [] and block["modulators"] == []
    assert block["summary"] == "No arm is corrupting (all 2 under the ceiling 3%): no cause to explain."


def test_an_undetermined_removal_arm_is_a_limit_of_the_design():
    """multi_stream=off ran once (0/60): not enough to put it under the ceiling, so the arms cannot tell
    multi-stream overlap needed from multi-stream overlap a modulator."""
    block = block_of(dsv4_runs(multi_stream_off=[(0, 60)]))
    arm = next(a for a in block["arms"] if a["label"] == "multi_stream=off")
    assert (arm["state"], arm["leaning"]) == ("undetermined", "clean")
    assert arm["sessions_needed"] > 60
    assert block["verdict"] == "undetermined"
    # what the classified arms show, and what the undetermined one would make of it
    assert levels_found(block) == [{"capture": "graph", "index_k": "bf16"}]
    assert block["provisional"]["conjunctions"] == [DSV4_CAUSE]
    (line,) = [line for line in block["limits"] if line.startswith("multi_stream=off is undetermined")]
    assert "cannot tell multi_stream=on needed (part of the cause) from multi_stream=on a modulator" in line
    assert f"about {arm['sessions_needed'] - 60} more sessions" in line


def test_factors_that_always_change_together_give_several_conjunctions():
    both = {"capture": "eager", "multi_stream": "off"}
    block = block_of([*runs_of({}, [(10, 60)] * 3), *runs_of(both, [(0, 60)] * 3)])
    assert block["verdict"] == "several conjunctions fit"
    assert levels_found(block) == [{"capture": "graph"}, {"multi_stream": "on"}]
    assert "cannot separate" in block["summary"]
    assert any("would tell capture=graph from multi_stream=on" in line for line in block["limits"])
    for conj in block["conjunctions"]:
        assert conj["verdict"].startswith("one of several conjunctions")
        assert all(e["evidence"] == "inferred only" for e in conj["necessary"].values())


def test_arms_of_another_workload_are_left_out():
    other = {"workload.sessions": "10"}
    runs = [*dsv4_runs(), *runs_of({"capture": "eager"}, [(5, 10)] * 3, conditions=other)]
    block = block_of(runs)
    assert len(block["arms"]) == 5 and levels_found(block) == [DSV4_CAUSE]


def test_the_report_shows_the_minimal_cause_after_the_hypotheses_sentence_first():
    report = analyse(SPEC, dsv4_runs())
    md = render_markdown(report)
    assert md.index("## Hypotheses") < md.index("## Minimal cause") < md.index("## Arms")
    section = md.split("## Minimal cause\n\n")[1].split("\n## ")[0]
    first, rest = section.split("\n\n", 1)
    assert first.startswith("**minimal cause found**: Corruption needs capture=graph AND index_k=bf16")
    assert "| `multi_stream=on` | shown | baseline 37/240 corrupting, multi_stream=off 0/240 clean |" in rest
    assert "| hicache=off | 18/240 |" in rest and "Modulator **hicache** (on → off)" in rest
    assert "What the design cannot tell:" in rest
    dumps(report)  # JSON without NaN


# --- the statistics it adds ------------------------------------------------------------------------


def test_sessions_to_exclude_the_ceiling():
    assert stats.sessions_to_exclude(0.0, 0.03, 0.99) == stats.sessions_for_ceiling(0.03, 0.99)
    need = stats.sessions_to_exclude(0.01, 0.03, 0.99)
    assert stats.clopper_pearson(round(0.01 * need), need, 0.99)[1] < 0.03
    assert stats.clopper_pearson(round(0.01 * (need - 1)), need - 1, 0.99)[1] >= 0.03
    assert stats.clopper_pearson(round(0.08 * stats.sessions_to_exclude(0.08, 0.03)), 1000)[0] > 0
    assert stats.sessions_to_exclude(0.03, 0.03) is None


def test_price_bonett_interval_of_an_interaction_near_zero_covers_by_simulation():
    """Three arms with no corruption and one at 3%, 150 sessions each: the adjusted Wald interval of the
    interaction keeps its 95% coverage, where the plain Wald interval (zero width at 0/n) would not."""
    rng = np.random.default_rng(11)
    rates, n, coefficients = [0.03, 0.0, 0.0, 0.0], 150, [1, -1, -1, 1]
    truth = sum(c * p for c, p in zip(coefficients, rates, strict=True))
    sims = 4000
    drawn = rng.binomial(n, rates, size=(sims, 4))
    covered = 0
    for row in drawn:
        _, lo, hi = stats.contrast_interval([(int(k), n) for k in row], coefficients, 0.95)
        covered += lo <= truth <= hi
    assert covered / sims >= 0.94, covered / sims


# --- Monte Carlo -----------------------------------------------------------------------------------


def truth_arms(changes_and_rates: list[tuple[dict[str, str], float]], icc: float) -> list[ArmTruth]:
    return [
        ArmTruth(arm_label({**BASE, **c}, BASE), {**BASE, **c}, rate, icc) for c, rate in changes_and_rates
    ]


# the built-in model's story: 15% at the baseline, 5% with HiCache off, every single-knob fix clean
DSV4_TRUTH = [({}, 0.15), ({"capture": "eager"}, 0.0), ({"index_k": "fp8"}, 0.0)]
DSV4_TRUTH += [({"multi_stream": "off"}, 0.0), ({"hicache": "off"}, 0.05)]
TWO_BY_TWO_TRUTH = [({}, 0.15), ({"capture": "eager"}, 0.0), ({"multi_stream": "off"}, 0.0)]
TWO_BY_TWO_TRUTH += [({"capture": "eager", "multi_stream": "off"}, 0.0)]
# the hardest null: every arm at the ceiling itself, none over it
NULL_TRUTH = [(c, SPEC.ceiling) for c, _ in DSV4_TRUTH]
STUDIES = 500
KILL_RATE = 0.05


def simulated_blocks(
    truth, icc: float, runs: int, sessions: int, seed: int, kill_rate: float = KILL_RATE
) -> list[MinimalCause]:
    """`STUDIES` studies drawn beta-binomially (rehearse's draws), a run killed now and then (listed,
    never pooled), each judged by the analysis' own between-run estimate, pooling and minimal cause."""
    arms = truth_arms(truth, icc)
    rng = np.random.default_rng(seed)
    counts = draw_counts(arms, runs, sessions, STUDIES, rng)
    blocks = []
    for study in range(STUDIES):
        records = [
            dataclasses.replace(r, status="KILLED", outcomes="partial", clean=0)
            if rng.random() < kill_rate
            else r
            for r in study_runs(arms, counts[study], sessions)
        ]
        between = between_runs(records, SPEC)
        blocks.append(cause.minimal_cause(pool_arms(records, SPEC, between), SPEC, between.icc))
    return blocks


# runs per arm at each restart ICC: the starts a study needs there (at ICC 0.1 a start of 60 sessions with
# none corrupted says little, so a clean arm needs about two dozen starts to be shown under 3%)
@pytest.mark.parametrize(
    "name,truth,expected,icc,runs,sessions",
    [
        ("dsv4", DSV4_TRUTH, DSV4_CAUSE, 0.02, 10, 60),
        ("dsv4", DSV4_TRUTH, DSV4_CAUSE, 0.1, 24, 60),
        ("2x2", TWO_BY_TWO_TRUTH, TWO_BY_TWO_CAUSE, 0.02, 10, 60),
        ("2x2", TWO_BY_TWO_TRUTH, TWO_BY_TWO_CAUSE, 0.1, 24, 30),
    ],
)
def test_monte_carlo_reports_exactly_the_true_conjunction(name, truth, expected, icc, runs, sessions):
    blocks = simulated_blocks(truth, icc, runs, sessions, seed=int(icc * 1000) + len(truth))
    assert {b.verdict for b in blocks} <= set(cause.CAUSE_SENTENCES)
    assert {a.state for b in blocks for a in b.arms} <= set(cause.STATES)
    found = [[c.levels for c in b.conjunctions] for b in blocks]
    exact = sum(levels == [expected] for levels in found) / STUDIES
    wrong = sum(bool(levels) and levels != [expected] for levels in found) / STUDIES
    assert exact >= 0.95, (name, icc, exact)
    assert wrong <= 0.03, (name, icc, wrong)


@pytest.mark.parametrize("icc,runs", [(0.02, 8), (0.1, 16)])
def test_monte_carlo_null_reports_a_conjunction_at_most_alpha(icc, runs):
    """No arm corrupting (every one at the ceiling, the boundary): the block's conclusions stay under
    alpha. Its arms are the study's states, each at 95% one arm at a time (analysis/states.py: the policy
    the hypotheses judge "corruption gone" by), so some one of the five is misread more often, as
    intervals at 95% each are (at most 2.5% an arm on the side that is wrong here, plus the ICC plug-in)."""
    blocks = simulated_blocks(NULL_TRUTH, icc, runs, 60, seed=7 + runs)
    reported = sum(bool(b.conjunctions) for b in blocks) / STUDIES
    found = sum(b.verdict == "minimal cause found" for b in blocks) / STUDIES
    assert found <= reported <= SPEC.alpha, (icc, found, reported)
    misread = sum(any(a.state == "corrupting" for a in b.arms) for b in blocks) / STUDIES
    arms = len(NULL_TRUTH)
    assert misread <= 1 - (1 - 0.025) ** arms + 0.05, (icc, misread)  # ~12% for five arms, MC error
    assert all(a.confidence == 1 - SPEC.alpha for b in blocks for a in b.arms)
    json.dumps(to_json(blocks[0]), allow_nan=False)


# --- end to end ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group(FACTORIAL_RUN)
def test_a_factorial_sweep_on_the_embedded_default_reports_the_conjunction(factorial_run):
    """Issue 16's must-show, as the README runs it: a fault model where corruption needs capture=graph AND
    multi_stream=on (experiments/graph_and_multistream.yaml), a 2x2 sweep on the command line, one start
    per arm (tests/shared_runs.py; test_study.py judges the same multirun)."""
    from tests.test_study import no_servers_left

    tmp_path, out = factorial_run.root, factorial_run.out
    assert factorial_run.returncode == 0, out[-5000:]
    study = tmp_path / "reports" / "sweep-capture-multi_stream"
    block = json.loads((study / "report.json").read_text())["minimal_cause"]
    assert block["verdict"] == "minimal cause found", (block["summary"], out[-3000:])
    assert levels_found(block) == [TWO_BY_TWO_CAUSE]
    assert {a["label"]: a["state"] for a in block["arms"]} == {
        "baseline": "corrupting",
        "capture=eager": "clean",
        "multi_stream=off": "clean",
        "capture=eager,multi_stream=off": "clean",
    }
    interaction = next(e for e in block["effects"] if e["kind"] == "interaction")
    assert interaction["factors"] == ["capture", "multi_stream"] and interaction["ci"][0] > 0
    md = (study / "report.md").read_text()
    assert "**minimal cause found**: Corruption needs capture=graph AND multi_stream=on" in md
    assert not no_servers_left(tmp_path)
