"""An interrupted sequential study, resumed, on the embedded default: no finished run is lost or run twice,
and the looks taken before the interrupt are the same after it. (A whole sequential study end to end is
the dsv4 test, tests/test_dsv4_study.py; over SSH, tests/remote/test_ssh_study.py.)"""

from __future__ import annotations

import json
import signal

import pytest

from tests.conftest import sweep_logs
from tests.test_reliability import STUDY, interrupt_mid_stress, study  # noqa: F401 - the fixture

SEQUENTIAL = ["factor/multi_stream=on,off", "hydra.sweeper.design=sequential"]


@pytest.mark.slow
def test_an_interrupted_sequential_study_resumes_without_losing_a_finished_run(study):  # noqa: F811
    # a slow stress (one session at a time) so round 1 is surely mid-stress when the signal lands
    sweep = [
        *SEQUENTIAL,
        "workload.sessions=12",
        "workload.rounds=2",
        "workload.concurrency=1",
        "bench.enabled=false",
        # three rounds at most: the resumed sweep's rounds past the interrupted one, not six
        "study.stopping.max_runs_per_arm=3",
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
    assert "already FINISHED; skipped" in sweep_logs(study.sweep_dir)
    assert ": SKIPPED (already FINISHED: resume)" in out  # and the terminal says so
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
