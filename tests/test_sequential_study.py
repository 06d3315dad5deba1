"""`hydra.sweeper.design=sequential` end to end on the embedded default: rounds launched through Hydra's
launcher, evidence read back from a real MLflow store, a report with its stopping trace, and an
interrupted study resumed without losing a finished run."""

from __future__ import annotations

import json
import signal

import pytest

from tests.test_reliability import STUDY, interrupt_mid_stress, study  # noqa: F401 - the fixture

SEQUENTIAL = ["factor/multi_stream=on,off", "hydra.sweeper.design=sequential"]


def parent_run(s):
    client = s.client()
    exp = client.get_experiment_by_name(STUDY)
    [parent] = client.search_runs(
        [exp.experiment_id], "tags.`heisenhunt.kind` = 'study'", order_by=["attributes.start_time DESC"]
    )[:1]
    return parent


@pytest.mark.slow
def test_a_sequential_study_stops_when_the_evidence_decides(study):  # noqa: F811
    rc, out = study.run(*SEQUENTIAL)
    assert rc == 0, out[-4000:]
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    [h] = report["hypotheses"]
    assert h["verdict"] == "implicated", (h, out[-3000:])
    stop = report["stopping"]
    # two rounds (study.stopping.min_runs_per_arm), not the fixed design's three starts per arm
    assert stop["rounds"] == 2 and [t["round"] for t in stop["trace"]] == [0, 1]
    assert stop["trace"][0]["hypotheses"][h["id"]]["verdict"] is None
    assert stop["trace"][-1]["hypotheses"][h["id"]]["verdict"] == "implicated"
    assert stop["sessions"] == 2 * 2 * 80 < 3 * 2 * 80
    # the throughput sweep ran once per arm, side by side in the round after the first look
    assert stop["benched"] == ["baseline", "multi_stream=off"]
    runs = {(a["label"], r["repetition"]) for a in report["arms"] for r in a["runs"]}
    assert runs == {("baseline", 0), ("baseline", 1), ("multi_stream=off", 0), ("multi_stream=off", 1)}
    fix = next(t for t in report["throughput"] if t["label"] == "multi_stream=off")
    assert fix["levels"], fix
    # the evidence per round is in MLflow, a metric with the round as its step (the UI plots it)
    history = study.client().get_metric_history(
        parent_run(study).info.run_id, f"evidence.{h['id']}.reduction"
    )
    assert [m.step for m in history] == [0, 1] and history[1].value > history[0].value
    md = (study.reports / STUDY / "report.md").read_text()
    assert "## Stopping trace" in md and "fixed-design" not in md.split("## Stopping trace")[0]
    assert "round 1 evidence" in out  # the terminal shows it as the study goes
    assert not study.live_servers() and not study.listening()


@pytest.mark.slow
def test_an_interrupted_sequential_study_resumes_without_losing_a_finished_run(study):  # noqa: F811
    # a slow stress (one session at a time) so round 1 is surely mid-stress when the signal lands
    sweep = [
        *SEQUENTIAL,
        "workload.sessions=12",
        "workload.rounds=2",
        "workload.concurrency=1",
        "bench.enabled=false",
    ]
    proc = study.start(*sweep)
    out = interrupt_mid_stress(study, proc, 2, signal.SIGTERM)  # job 2: round 1's first arm
    assert proc.returncode != 0, out[-3000:]
    before = {(r.data.params["factor.multi_stream"], r.data.tags["repetition"]): r for r in study.arm_runs()}
    finished = {k: r.info.run_id for k, r in before.items() if r.info.status == "FINISHED"}
    assert set(finished) == {("on", "0"), ("off", "0")}, {k: r.info.status for k, r in before.items()}
    interrupted = study.report_cli()["stopping"]

    rc, out = study.run(*sweep, "resume=true")
    assert rc == 0, out[-4000:]
    assert "already FINISHED; skipped" in out
    report = json.loads((study.reports / STUDY / "report.json").read_text())
    used = {r["run_id"] for a in report["arms"] for r in a["runs"] if r["used"]}
    assert set(finished.values()) <= used  # round 0 counts, not run twice
    pooled = [(a["label"], r["repetition"]) for a in report["arms"] for r in a["runs"] if r["used"]]
    assert len(pooled) == len(set(pooled))  # one pooled run per arm and round
    # the evidence of the rounds both saw is the same: looks taken before the interrupt are not lost
    # or re-drawn, so the guarantee (over every look, whenever it stops) holds across the resume
    assert report["stopping"]["trace"][0] == interrupted["trace"][0]
    assert report["stopping"]["rounds"] >= 2
    assert not study.live_servers() and not study.listening() and not study.pid_files()
