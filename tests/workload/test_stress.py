"""The stress workload end to end against the simulated server over loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from orchestrator.workload.detect import DETECTORS
from orchestrator.workload.results import SessionOutcome, StressSummary
from orchestrator.workload.stress import StressSettings, run_stress, run_stress_sync, summarize
from orchestrator.workload.tasks import make_task

# how each corruption shape of the sim's fault model reaches the client, and the detector that must see it
SHAPE_DETECTOR = {
    "truncated_arguments": "malformed_json",
    "invalid_json": "malformed_json",
    "unknown_tool": "unknown_tool",
    "leaked_text": "leaked_tool_call",
    "repetition": "degenerate_repetition",
    "wrong_arguments": "wrong_call",
}


def read_outcomes(out: Path) -> list[SessionOutcome]:
    lines = (out / "sessions.jsonl").read_text().splitlines()
    return [SessionOutcome.from_dict(json.loads(line)) for line in lines]


def read_summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def settings(url: str, out: Path, **fields) -> StressSettings:
    """A run against `url` writing to `out`, quiet, with the given fields."""
    return StressSettings(url=url, out_dir=out, **{"model": "m", "progress": False, **fields})


def test_summarize_counts_by_status_and_detector():
    from orchestrator.workload.results import BadTurn

    outcomes = [
        SessionOutcome("a", "clean", 2, 2),
        SessionOutcome("b", "corrupted", 2, 1, bad_turn=BadTurn(1, "malformed_json", "r", "x")),
        SessionOutcome("c", "corrupted", 2, 0, bad_turn=BadTurn(0, "wrong_call", "r", "x")),
        SessionOutcome("d", "corrupted", 2, 0, bad_turn=BadTurn(0, "malformed_json", "r", "x")),
        SessionOutcome("e", "errored", 2, 0, error="timeout: x"),
        # plan drift noted twice, not counted: the session went on and stayed clean; once per family
        SessionOutcome(
            "f",
            "clean",
            2,
            2,
            noted=[BadTurn(0, "wrong_call", "r", "x", "plan_drift")] * 2,
            usage_missing_turns=2,
        ),
    ]
    summary = summarize(outcomes, planned=7, duration_s=1.5)
    assert summary == StressSummary(
        sessions=6,
        clean=2,
        corrupted=3,
        errored=1,
        planned=7,
        by_detector={"malformed_json": 2, "wrong_call": 1},
        duration_s=1.5,
        by_family={"structural": 2, "plan_drift": 2},
        usage_missing_turns=2,
    )
    assert summary.partial and summary.measured == 5


def test_settings_refuse_an_empty_run_and_resolve_concurrency(tmp_path):
    with pytest.raises(ValueError, match="sessions and rounds must be >= 1"):
        StressSettings(url="http://x", out_dir=tmp_path, sessions=0)
    assert StressSettings(url="http://x", out_dir=tmp_path, sessions=5).workers == 5  # None: all at once
    assert StressSettings(url="http://x", out_dir=tmp_path, sessions=5, concurrency=50).workers == 5


def test_healthy_sim_all_clean(sim_server, tmp_path):
    out = tmp_path / "run"
    summary = run_stress_sync(
        settings(sim_server.url, out, sessions=40, rounds=3, concurrency=20, seed=5, timeout_s=30.0)
    )
    assert (summary.sessions, summary.clean, summary.corrupted, summary.errored, summary.planned) == (
        40,
        40,
        0,
        0,
        40,
    )
    outcomes = read_outcomes(out)
    assert sorted(o.session_id for o in outcomes) == sorted(make_task(5, i, 3).task_id for i in range(40))
    for o in outcomes:
        assert o.status == "clean" and o.rounds_done == 3 and len(o.turn_latency_s) == 3
        assert o.prompt_tokens > 0 and o.completion_tokens > 0
    assert read_summary(out)["clean"] == 40 and not read_summary(out)["partial"]
    assert read_summary(out)["settings"] == {
        "url": sim_server.url,
        "sessions": 40,
        "rounds": 3,
        "concurrency": 20,
        "seed": 5,
        "model": "m",
        "timeout_s": 30.0,
        "count": ["structural", "plan_drift"],
        "tool_choice": "auto",
        "max_tokens": 1024,
    }
    assert not (out / "corrupted").exists()


def test_thousand_sessions_against_healthy_sim(sim_server, tmp_path):
    out = tmp_path / "run"
    summary = run_stress_sync(
        settings(sim_server.url, out, sessions=1000, rounds=4, concurrency=1000, seed=11, timeout_s=120.0)
    )
    assert (summary.corrupted, summary.errored, summary.clean, summary.sessions) == (0, 0, 1000, 1000)
    assert len(read_outcomes(out)) == 1000


def test_faulty_sim_corrupted_sessions_keep_evidence(start_sim, tmp_path):
    """The sim's fault model at the baseline (captured graphs, overlap, bf16 index keys, HiCache)."""
    server = start_sim(args=("--enable-hierarchical-cache",), env={"SGLANG_DSV4_BF16_INDEX_K": "1"})
    out = tmp_path / "run"
    summary = run_stress_sync(
        settings(server.url, out, sessions=60, rounds=4, concurrency=60, seed=3, timeout_s=60.0)
    )
    assert summary.errored == 0
    assert summary.corrupted > 0, server.log_tail()
    # the sim counts the turns it corrupted: the oracle must see each one, and nothing else
    with urllib.request.urlopen(server.url + "/server_info", timeout=5) as resp:
        counters = json.load(resp)["sim"]["counters"]
    assert summary.corrupted == counters["corrupted_turns"]
    expected = Counter()
    for shape, count in counters["corrupted_by_shape"].items():
        expected[SHAPE_DETECTOR[shape]] += count
    assert summary.by_detector == dict(expected)
    assert sum(summary.by_detector.values()) == summary.corrupted
    assert set(summary.by_detector) <= set(DETECTORS)
    for o in read_outcomes(out):
        if o.status != "corrupted":
            continue
        assert (
            o.bad_turn is not None
            and o.bad_turn.detector in DETECTORS
            and o.rounds_done == o.bad_turn.round_index
        )
        transcript = json.loads((out / "corrupted" / f"{o.session_id}.json").read_text())
        assert transcript["bad_turn"]["detector"] == o.bad_turn.detector
        assert transcript["bad_turn"]["raw_sse"].startswith("data: ")
        # the conversation up to the bad turn: system, user, then an assistant + tool pair per good round
        assert len(transcript["messages"]) == 2 + 2 * o.rounds_done


def test_server_killed_mid_run_errors_never_corrupts(start_sim, tmp_path):
    # real modelled latency so sessions are in flight when the server dies
    server = start_sim(time_scale=0.25)
    out = tmp_path / "run"
    sessions = 40

    async def scenario() -> tuple[StressSummary, list[SessionOutcome]]:
        run = asyncio.create_task(
            run_stress(
                settings(server.url, out, sessions=sessions, rounds=3, concurrency=8, seed=2, timeout_s=30.0)
            )
        )
        jsonl = out / "sessions.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if jsonl.exists() and len(jsonl.read_text().splitlines()) >= 8:
                break
            await asyncio.sleep(0.05)
        before = read_outcomes(out)
        # SIGKILL the whole group: streams in flight are cut, later connects refused
        os.killpg(server.pid, signal.SIGKILL)
        return await run, before

    summary, before = asyncio.run(scenario())
    after = read_outcomes(out)
    assert len(before) >= 8 and all(o.status == "clean" for o in before)
    assert after[: len(before)] == before  # finished sessions keep their outcomes, unchanged
    assert summary.corrupted == 0
    assert summary.sessions == sessions and summary.clean + summary.errored == sessions
    assert summary.errored >= sessions - len(before) - 8  # at most the in-flight ones could still finish
    kinds = read_summary(out)["by_error"]
    # the server is dead: cut streams are `server_gone` (a probe finds nobody listening), never `stream_cut`
    assert set(kinds) <= {"server_gone", "connection_refused", "incomplete_stream"}
    # sessions were in flight at the kill: some were cut mid-stream, not merely refused afterwards
    assert set(kinds) - {"connection_refused"}, kinds


def test_cancel_writes_partial_outputs(start_sim, tmp_path):
    server = start_sim(time_scale=0.25)
    out = tmp_path / "run"

    async def scenario() -> None:
        run = asyncio.create_task(
            run_stress(
                settings(server.url, out, sessions=30, rounds=3, concurrency=6, seed=4, timeout_s=30.0)
            )
        )
        jsonl = out / "sessions.jsonl"
        while not (jsonl.exists() and len(jsonl.read_text().splitlines()) >= 3):
            await asyncio.sleep(0.05)
        run.cancel()
        await run

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
    summary = read_summary(out)
    outcomes = read_outcomes(out)
    assert summary["partial"] and summary["planned"] == 30 and summary["sessions"] == len(outcomes) < 30
    assert all(o.status == "clean" for o in outcomes)  # in-flight sessions are left out, not errored


def test_cli_runs_and_ctrl_c_leaves_a_partial_summary(start_sim, tmp_path):
    server = start_sim()
    out = tmp_path / "cli"
    argv = [
        sys.executable,
        "-m",
        "orchestrator.workload.stress",
        "--url",
        server.url,
        "--sessions",
        "12",
        "--rounds",
        "2",
        "--out",
        str(out),
        "--seed",
        "9",
        "--concurrency",
        "4",
        "--timeout",
        "20",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "clean 12, corrupted 0, errored 0" in done.stdout
    assert len(read_outcomes(out)) == 12

    slow = start_sim(time_scale=0.25)
    out2 = tmp_path / "cli2"
    argv2 = [
        *argv[:4],
        slow.url,
        "--sessions",
        "40",
        "--rounds",
        "3",
        "--out",
        str(out2),
        "--concurrency",
        "4",
    ]
    # SIGINT restored to its default in the child: a background pytest (`pytest &`) starts children with
    # SIGINT ignored, and the CLI would never see the Ctrl-C this test sends
    proc = subprocess.Popen(
        argv2,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        jsonl = out2 / "sessions.jsonl"
        while not (jsonl.exists() and jsonl.read_text().count("\n") >= 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "(partial)" in stdout
    summary = read_summary(out2)
    assert summary["partial"] and summary["sessions"] == len(read_outcomes(out2)) < 40


def test_progress_display_counts(sim_server, tmp_path, capsys):
    run_stress_sync(
        settings(
            sim_server.url,
            tmp_path / "run",
            sessions=6,
            rounds=1,
            concurrency=3,
            seed=0,
            timeout_s=30.0,
            progress=True,
        )
    )
    err = capsys.readouterr().err
    assert "6/6" in err and "corrupted 0" in err and "errored 0" in err
