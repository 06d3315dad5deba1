"""A run killed mid-way on the simulated deployment does not change the verdicts (issue 13).

Slow: real co-restarted deployments, the orchestrator's own stress runner and oracle. The baseline
(60 sessions x 4 rounds, ~15% corrupted) and multi-stream off (clean) run three times each; then one
more baseline run is cancelled part-way, as a killed job is, and its partial outcomes are recorded
the way the tracker records them (KILLED, outcomes=partial). The analysis lists it with its counts
and never pools it: a corrupted session ends at its first bad turn while a clean one needs every
round, so an interrupted run over-represents corrupted sessions.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from simkit import BASELINE, MODEL, Arm

from orchestrator.analysis import HypothesisSpec, RunRecord, StudySpec
from orchestrator.workload.stress import StressSettings, run_stress, run_stress_sync
from tests.conftest import report_json

SESSIONS, ROUNDS, RUNS = 60, 4, 3
BASE = {"multi_stream": "on"}
SPEC = StudySpec(
    name="killed",
    baseline=BASE,
    hypotheses=(HypothesisSpec("H-multistream", "multi_stream", "needs overlap", "on", "off"),),
    ceiling=0.03,
)


def record(level: str, rep: int, summary: dict, status: str = "FINISHED") -> RunRecord:
    return RunRecord(
        run_id=f"{level}-{rep}-{status}",
        status=status,
        signature=f"sig[{level}]",
        repetition=rep,
        factors={"multi_stream": level},
        outcomes="partial" if summary["partial"] else "complete",
        clean=summary["clean"],
        corrupted=summary["corrupted"],
        errored=summary["errored"],
        planned=summary["planned"],
    )


@pytest.mark.slow
def test_a_baseline_run_killed_mid_way_does_not_change_the_verdicts(cluster, tmp_path: Path):
    c = cluster(time_scale=0.05)
    runs, durations = [], []
    for level, arm in (("on", BASELINE), ("off", Arm(multi_stream=False))):
        for rep in range(RUNS):
            c.stop_all()
            c.start_all(arm)
            out = tmp_path / f"{level}-{rep}"
            settings = StressSettings(c.router_url, out, SESSIONS, ROUNDS, seed=100 + rep, model=MODEL)
            summary = run_stress_sync(settings)
            assert summary.errored == 0 and not summary.partial
            durations.append(summary.duration_s)
            runs.append(record(level, rep, json.loads((out / "summary.json").read_text())))
    before = report_json(SPEC, runs)

    # one more baseline run, killed part-way: once a few sessions have an outcome, ten sessions at a time
    # so that most are still running (a kill's moment, not a timer: the sim's speed follows the machine's)
    c.stop_all()
    c.start_all(BASELINE)
    out = tmp_path / "on-killed"
    settings = StressSettings(c.router_url, out, SESSIONS, ROUNDS, concurrency=10, seed=999, model=MODEL)

    async def killed() -> None:
        run = asyncio.ensure_future(run_stress(settings))
        jsonl = out / "sessions.jsonl"
        while not run.done() and (not jsonl.is_file() or len(jsonl.read_text().splitlines()) < 5):
            await asyncio.sleep(0.02)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(killed())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["partial"] and 0 < summary["sessions"] < SESSIONS
    interrupted = record("on", RUNS, summary, status="KILLED")
    after = report_json(SPEC, [*runs, interrupted])

    assert [h["verdict"] for h in after["hypotheses"]] == [h["verdict"] for h in before["hypotheses"]]
    assert after["hypotheses"][0]["baseline_counts"] == before["hypotheses"][0]["baseline_counts"]
    assert after["between_runs"] == before["between_runs"]
    listed = next(p for p in after["problem_runs"] if p["status"] == "KILLED")
    assert listed["used"] is False and listed["corrupted"] == summary["corrupted"]
    assert "not pooled" in listed["reason"]
