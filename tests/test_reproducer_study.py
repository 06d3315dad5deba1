"""Your own reproducer (`workload=reproducer`) through real multiruns of the quick study on the embedded
default: the example (examples/reproducer/greedy_twice.py) as a `_target_` and as a command, its outcomes
pooled and judged as the built-in oracle's; and a command that prints a bad line in one arm, which fails
that arm only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from orchestrator.analysis import VERDICTS
from tests.conftest import FAST_SIM
from tests.test_study import finish, kill_if_running, no_servers_left, orchestrator, runs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "reproducer" / "greedy_twice.py"
SESSIONS = 6
# the quick study's one hypothesis (multi_stream on -> off), two starts of each arm, no throughput sweep
QUICK = [
    "workload=reproducer",
    "factor/multi_stream=on,off",
    "repetition=0,1",
    f"workload.sessions={SESSIONS}",
    "workload.concurrency=3",
    "bench.enabled=false",
    *FAST_SIM,
]


def arm_runs(tmp_path: Path) -> list:
    return [r for r in runs(tmp_path, "quick") if "mlflow.parentRunId" in r.data.tags]


def assert_judged_and_reported(tmp_path: Path, identity: dict, out: str) -> None:
    """Every arm FINISHED with the reproducer's sessions, counted as its lines say, and the verdict the
    counts call for."""
    children = arm_runs(tmp_path)
    assert len(children) == 4 and {r.info.status for r in children} == {"FINISHED"}, out[-3000:]
    documents = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "multirun").glob("*/stress/summary.json"))
    ]
    assert len(documents) == 4
    for document in documents:
        assert document["settings"]["reproducer"] == identity
        assert (document["sessions"], document["errored"], document["partial"]) == (SESSIONS, 0, False)
    # the MLflow counts are the reproducer's lines, arm by arm
    by_metrics = sorted((r.data.metrics["arm.sessions"], r.data.metrics["arm.corrupted"]) for r in children)
    by_lines = sorted((d["clean"] + d["corrupted"], d["corrupted"]) for d in documents)
    assert by_metrics == by_lines
    for jsonl in (tmp_path / "multirun").glob("*/stress/sessions.jsonl"):
        sessions = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert len(sessions) == SESSIONS and len({s["session_id"] for s in sessions}) == SESSIONS
        assert all(s["bad_turn"]["family"] == "reproducer" for s in sessions if s["status"] == "corrupted")

    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    # both arms pool both their starts: every session the reproducer judged
    assert sorted(arm["n"] for arm in report["arms"]) == [2 * SESSIONS] * 2
    [hypothesis] = report["hypotheses"]
    assert hypothesis["id"] == "H-multistream" and hypothesis["verdict"] in VERDICTS
    corrupted = {
        level: sum(
            r.data.metrics["arm.corrupted"] for r in children if r.data.params["factor.multi_stream"] == level
        )
        for level in ("on", "off")
    }
    # a plain-chat reproducer on a sim whose race corrupts only tool calls sees no corruption anywhere:
    # nothing to explain; where it does see some, the fix is implicated only if none is left
    if corrupted["on"] == 0:
        assert hypothesis["verdict"] == "inconclusive", hypothesis
    if hypothesis["verdict"] == "implicated":
        assert corrupted["off"] == 0 < corrupted["on"]
    assert not no_servers_left(tmp_path)


@pytest.mark.slow
def test_a_study_judged_by_the_example_reproducer_as_a_callable(tmp_path):
    # the study runs in tmp_path; `examples` is found there as it is from the repo root
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    target = "examples.reproducer.greedy_twice.check_session"
    proc = orchestrator(tmp_path, "-m", *QUICK, f"+workload.call._target_={target}")
    try:
        out = finish(proc, 600)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-5000:]
    assert_judged_and_reported(tmp_path, {"call": {"_target_": target}}, out)


@pytest.mark.slow
def test_a_study_judged_by_the_example_reproducer_as_a_command(tmp_path):
    argv = [sys.executable, str(EXAMPLE)]
    proc = orchestrator(tmp_path, "-m", *QUICK, f"workload.command=[{','.join(repr(w) for w in argv)}]")
    try:
        out = finish(proc, 600)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-5000:]
    assert_judged_and_reported(tmp_path, {"command": argv}, out)


# clean sessions, but the second time it runs (the study's second arm) its third line is not an outcome
BAD_ON_SECOND_RUN = """\
import json, os, sys
count = sys.argv[1]
runs = int(open(count).read()) + 1 if os.path.exists(count) else 1
open(count, "w").write(str(runs))
for i in range(int(os.environ["HEISENHUNT_SESSIONS"])):
    if runs == 2 and i == 2:
        print("session 2: looks fine to me")
    print(json.dumps({"session": f"s{i}", "outcome": "clean"}), flush=True)
"""


@pytest.mark.slow
def test_a_reproducer_that_prints_a_bad_line_fails_its_arm_and_the_study_keeps_the_others(tmp_path):
    script = tmp_path / "bad_on_second_run.py"
    script.write_text(BAD_ON_SECOND_RUN)
    argv = [sys.executable, str(script), str(tmp_path / "runs")]
    proc = orchestrator(tmp_path, "-m", *QUICK, f"workload.command=[{','.join(repr(w) for w in argv)}]")
    try:
        out = finish(proc, 600)
    finally:
        kill_if_running(proc)
    assert (tmp_path / "runs").read_text() == "4", out[-5000:]  # every arm ran, the one after it too

    children = arm_runs(tmp_path)
    [failed] = [r for r in children if r.info.status == "FAILED"]
    assert sorted(r.info.status for r in children) == ["FAILED", "FINISHED", "FINISHED", "FINISHED"]
    assert failed.data.tags["failure_reason"] == (
        "ReproducerError: reproducer line 3: session 2: looks fine to me is not JSON (Expecting value: "
        "line 1 column 1 (char 0)); the protocol is one JSON object per session, one per line "
        "(reproducer.schema.json)"
    )
    # what it reported before the bad line is kept (partial), never pooled
    assert (failed.data.metrics["sessions_total"], failed.data.metrics["sessions_planned"]) == (2, SESSIONS)

    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    [hypothesis] = report["hypotheses"]
    # the report pools the FINISHED runs only, and lists the failed one with its reason
    pooled = {arm["factors"]["multi_stream"]: arm["run_counts"] for arm in report["arms"]}
    level = failed.data.params["factor.multi_stream"]
    assert (
        pooled[level] == [[0, SESSIONS]] and pooled[{"on": "off", "off": "on"}[level]] == [[0, SESSIONS]] * 2
    )
    [problem] = report["problem_runs"]
    assert (problem["run_id"], problem["status"], problem["used"]) == (failed.info.run_id, "FAILED", False)
    assert problem["reason"].startswith(failed.data.tags["failure_reason"])
    # all clean: nothing to explain, from the FINISHED runs alone
    assert hypothesis["verdict"] == "inconclusive", hypothesis
    assert not no_servers_left(tmp_path)
