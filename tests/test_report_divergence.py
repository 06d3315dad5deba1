"""The report of a study judged by the differential oracle (workload.oracle=divergence): the oracle named in
the headline and per arm, the reference pass's cost per arm, where the first divergence falls (a table and
a plot), one example diff per arm with a diverged session; all read back from MLflow alone (the runs' stress
summaries and one diverged session's artifact per arm), and kept through report.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.analysis.divergence import AFTER_CHARS, BEFORE_CHARS, example
from orchestrator.analysis.result import StudyResult, from_json
from orchestrator.analysis.runs import RunRecord
from orchestrator.analysis.study import analyse, headline, oracle_phrase
from orchestrator.config.schema import StudyConf
from orchestrator.report import check, rebuild
from orchestrator.report.pipeline import StudyCallback
from orchestrator.report.render import DIVERGENCE_PLOT, dumps, render_markdown
from orchestrator.tracking.write import ArmTracker
from orchestrator.workload.results import SessionOutcome, StressSummary
from tests import warm
from tests.conftest import FAST_SIM, job_and_plan, orchestrator_argv

DIVERGENCE = "workload.oracle=divergence"
REFERENCE_TEXT = '\n[run_shell] {"command": "wc -l src/scheduler.py", "timeout_s": 120}'
UNDER_LOAD_TEXT = '\n[run_shell] {"command": "wc -l src/scheduler.py", "tim'


def _tracker(cfg, repetition: int, parent: str | None) -> ArmTracker:
    job, plan = job_and_plan(cfg)
    return ArmTracker.start(job.tracking, job.study, plan, repetition, parent)


def _artifact(session: str, position: int) -> dict:
    """A diverged session's artifact as the stress run writes it (workload/stress.py, divergence.py)."""
    return {
        "session_id": session,
        "round_index": 2,
        "finding": {"detector": "diverged", "family": "diverged", "reason": "turn 2: ..."},
        "difference": {"position": position, "basis": "tokens", "reference": "timeout", "under_load": "tim"},
        "request": {"messages": [{"role": "user", "content": "do the plan"}]},
        "reference": {
            "text": REFERENCE_TEXT,
            "tokens": None,
            "finish_reason": "tool_calls",
            "completion_tokens": 33,
        },
        "under_load": {
            "text": UNDER_LOAD_TEXT,
            "tokens": None,
            "finish_reason": "tool_calls",
            "completion_tokens": 27,
        },
    }


def _divergence_run(out: Path, positions: list[int], clean: int, reference_s: float) -> StressSummary:
    """A divergence run's stress outputs: sessions.jsonl, summary.json with the reference pass and the
    positions, and corrupted/<session>.json per diverged session."""
    out.mkdir(parents=True, exist_ok=True)
    corrupted = len(positions)
    rows = [
        SessionOutcome(f"s{i:03d}", "corrupted" if i < corrupted else "clean", 2, 2).to_dict()
        for i in range(corrupted + clean)
    ]
    (out / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = corrupted + clean
    summary = {
        "sessions": total,
        "corrupted": corrupted,
        "clean": clean,
        "reference": {
            "duration_s": reference_s,
            "sessions": total,
            "errored": 0,
            "turns": 2 * total,
            "completion_tokens": 60 * total,
            "with_tokens": 2 * total,
        },
        "divergence": {"positions": positions, "turns": [2] * corrupted, "basis": {"tokens": corrupted}},
    }
    (out / "summary.json").write_text(json.dumps(summary))
    if positions:
        (out / "corrupted").mkdir(exist_ok=True)
        for i, position in enumerate(positions):
            (out / "corrupted" / f"s{i:03d}.json").write_text(json.dumps(_artifact(f"s{i:03d}", position)))
    return StressSummary(
        sessions=total,
        clean=clean,
        corrupted=corrupted,
        errored=0,
        planned=total,
        duration_s=reference_s + 5.0,
        by_family={"diverged": corrupted},
        oracle="divergence",
        reference_s=reference_s,
    )


def _divergence_study(compose_cfg, tmp_path: Path, baseline: list[list[int]]):
    """A quick study judged by the differential oracle, written through the tracker as arms log it: the
    baseline's runs diverge at `baseline`'s positions (one list per run), multi_stream=off never."""
    overrides = (
        f"tracking.artifact_location={tmp_path}/artifacts",
        f"hydra.sweep.dir={tmp_path}/sweep",
        DIVERGENCE,
    )
    cfg = compose_cfg(*overrides)
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    parent = callback.run_id
    arms = [((), positions, rep) for rep, positions in enumerate(baseline)]
    arms += [(("factor/multi_stream=off",), [], rep) for rep in range(len(baseline))]
    for extra, positions, rep in arms:
        with _tracker(compose_cfg(*overrides, *extra), rep, parent) as tracker:
            out = tmp_path / f"arm{len(extra)}{rep}"
            tracker.log_stress(_divergence_run(out, positions, 60 - len(positions), 40.0 + rep), out)
    callback.on_multirun_end(cfg)
    return cfg


def test_a_divergence_study_names_its_oracle_plots_and_shows_an_example_rebuilt_from_mlflow(
    compose_cfg, tmp_path
):
    cfg = _divergence_study(
        compose_cfg, tmp_path, [[24, 0, 3, 17, 24, 40, 2, 0, 9], [24, 1, 5, 30, 0, 12, 8, 0]]
    )
    target = Path(str(cfg.report.dir)) / str(cfg.study.name)
    written = (target / "report.json").read_text()
    report = json.loads(written)
    md = (target / "report.md").read_text()

    # the headline names the oracle (and the checker still reads it)
    assert report["headline"] == (
        "Implicated: H-multistream (multi_stream=off); baseline diverged from its batch-1 reference in "
        "17/120 sessions (14.2%). Fix: deploy `multi_stream=off` (throughput: no throughput data)."
    )
    assert check.schema_problems(report) == [] and check.disagreements(report) == []
    # per arm, in the oracle's words, with the reference pass's cost (summed over the arm's runs)
    assert (
        "- **baseline** diverged from its batch-1 reference in 17/120 sessions; its reference pass took "
        "1 min 21 s over 2 run(s) (89% of their stress phase)." in md
    )
    assert (
        "- **multi_stream=off** never diverged from its batch-1 reference (0/120); its reference pass" in md
    )
    base = next(a for a in report["arms"] if a["label"] == "baseline")
    assert base["divergence"]["positions"] == [24, 0, 3, 17, 24, 40, 2, 0, 9, 24, 1, 5, 30, 0, 12, 8, 0]
    assert base["divergence"]["reference_s"] == 81.0 and base["divergence"]["reference_runs"] == 2
    assert [r["reference_s"] for r in base["runs"]] == [40.0, 41.0]
    # where the first divergence falls: a table row and the plot, written and linked
    assert "| baseline | 17/120 | tokens 17 | 8 (0–40) | 11 (< 16) | 2: 17 |" in md
    assert (target / DIVERGENCE_PLOT).stat().st_size > 1000
    assert f"![first differing position per arm]({DIVERGENCE_PLOT})" in md
    # one example per arm with a diverged session: its turn, the position, both tokens, a bounded diff
    assert (
        "session `s000`, turn 2: first difference at token 24 (`diverged`): reference `'timeout'`, "
        "under load `'tim'`." in md
    )
    assert md.count("Example, **") == 1  # multi_stream=off never diverged: no example
    diff = md.split("```diff\n", 1)[1].split("\n```", 1)[0].splitlines()
    n = len(REFERENCE_TEXT)
    assert diff[0] == f"--- reference (batch 1): characters 0-{n} of {n}, finish tool_calls, 33 tokens"
    assert '-[run_shell] {"command": "wc -l src/scheduler.py", "timeout_s": 120}' in diff
    assert '+[run_shell] {"command": "wc -l src/scheduler.py", "tim' in diff

    # report.json keeps it all: rebuilt from MLflow alone, and judged again from report.json alone
    (target / "report.json").unlink()
    proc = warm.run(
        [
            sys.executable, "-m", "orchestrator.report", "--tracking-uri", str(cfg.tracking.uri),
            "--study", str(cfg.study.name), "--out", str(cfg.report.dir), "--no-plots",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (target / "report.json").read_text() == written
    result = from_json(StudyResult, report)
    assert dumps(result) == written and render_markdown(result, str(cfg.tracking.uri)) == md
    fresh = rebuild.records_from_report(report)
    again = analyse(result.study, fresh, result.context, conditions=result.context["conditions"])
    assert [a.divergence for a in again.arms] == [a.divergence for a in result.arms]


def test_a_divergence_baseline_without_divergence_says_so_in_the_oracles_words(compose_cfg, tmp_path):
    cfg = _divergence_study(compose_cfg, tmp_path, [[], []])
    target = Path(str(cfg.report.dir)) / str(cfg.study.name)
    report = json.loads((target / "report.json").read_text())
    assert report["headline"].startswith(
        "The baseline arm never diverged from its batch-1 reference (0/120, upper bound "
    )
    md = (target / "report.md").read_text()
    assert "## Where the outputs diverged" in md and "Example, **" not in md
    # nothing diverged: no plot to draw, none linked
    assert not (target / DIVERGENCE_PLOT).exists() and DIVERGENCE_PLOT not in md


def test_the_oracle_phrase_is_todays_text_for_tool_calls_and_names_the_other_oracles():
    assert oracle_phrase("tool_calls", 39, 240, "16.2%") == "corruption 39/240 (16.2%)"
    assert (
        oracle_phrase("tool_calls", 0, 240, "upper bound 1.5%")
        == "showed no corruption (0/240, upper bound 1.5%)"
    )
    assert oracle_phrase("divergence", 41, 240) == "diverged from its batch-1 reference in 41/240 sessions"
    assert oracle_phrase("divergence", 0, 240) == "never diverged from its batch-1 reference (0/240)"
    assert (
        oracle_phrase("reproducer", 3, 20, "15.0%")
        == "judged corrupted by your reproducer in 3/20 sessions (15.0%)"
    )
    spec = StudyConf.from_dict({"name": "t", "baseline": {"ms": "on"}, "hypotheses": []})
    # what the headline reads of the baseline arm
    arm = {
        "label": "baseline",
        "signature": "s",
        "factors": {"ms": "on"},
        "n": 20,
        "corrupted": 3,
        "rate": 0.15,
    }
    for oracle, words in (
        ({}, "baseline corruption 3/20 (15.0%)"),
        ({"workload.oracle": "reproducer"}, "baseline judged corrupted by your reproducer in 3/20 sessions"),
    ):
        assert words in headline(spec, [SimpleNamespace(**arm, conditions=oracle)], [], None)


def test_an_example_keeps_a_bounded_excerpt_around_the_first_difference():
    common = "word " * 400
    artifact = _artifact("s1", 400)
    artifact["reference"]["text"] = common + "alpha " * 300
    artifact["under_load"]["text"] = common + "beta " * 300
    run = RunRecord(run_id="r1", status="FINISHED", signature="x", repetition=0, factors={})
    ex = example(artifact, run)
    assert ex.at == len(common) and ex.start == len(common) - BEFORE_CHARS
    assert ex.reference.excerpt == (common + "alpha " * 300)[ex.start : len(common) + AFTER_CHARS]
    assert ex.reference.chars == len(common) + 6 * 300
    assert len(ex.under_load.excerpt) == BEFORE_CHARS + AFTER_CHARS


@pytest.mark.slow
def test_a_real_divergence_study_reports_in_the_oracles_words(tmp_path):
    """The whole path: `python -m orchestrator workload.oracle=divergence` on the embedded default."""
    # the sim's clock at FAST_SIM's: the reference pass runs its sessions one at a time (most of the
    # stress phase), and nothing here is about its pace
    argv = orchestrator_argv(
        tmp_path,
        DIVERGENCE,
        "workload.sessions=60",
        "workload.rounds=2",
        "repetition=0,1",
        "bench.enabled=false",
        *FAST_SIM,
    )
    proc = warm.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    target = tmp_path / "reports" / "quick"
    report = json.loads((target / "report.json").read_text())
    md = (target / "report.md").read_text()
    assert check.schema_problems(report) == [] and check.disagreements(report) == []
    assert "diverged from its batch-1 reference" in report["headline"]
    assert "- **baseline** " in md and "its reference pass took" in md
    base = next(a for a in report["arms"] if a["label"] == "baseline")
    assert base["divergence"]["reference_runs"] == 2 and base["divergence"]["reference_s"] > 0
    assert len(base["divergence"]["positions"]) == base["corrupted"]
    if base["corrupted"]:
        ex = base["divergence"]["example"]
        assert (target / DIVERGENCE_PLOT).exists() and DIVERGENCE_PLOT in md
        assert f"first difference at token {ex['position']}" in md or f"at word {ex['position']}" in md
        assert "```diff" in md
