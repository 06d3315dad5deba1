"""The workload against servers that are not the simulated SGLang: legacy `function_call` deltas, no usage
block, a stream cut by a server that is still up, a run where nothing could be measured, forced tool
choice, and detector families counted apart. Real HTTP: a scripted aiohttp server on loopback
(conftest.ScriptedServer) and the stress CLI as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from conftest import call_events, sse_reply

from orchestrator.workload.client import chat_payload, open_session, stream_chat
from orchestrator.workload.sse import SSEParser
from orchestrator.workload.stress import StressSettings, read_outcomes, run_stress_sync
from orchestrator.workload.tasks import (
    TOOLS,
    ToolCall,
    initial_messages,
    make_task,
    next_expected_call,
    rounds_done,
    tool_choice_for,
)
from orchestrator.workload.wire import RequestError


def parse(events: list[dict]) -> SSEParser:
    parser = SSEParser()
    for event in events:
        parser.feed(b"data: " + json.dumps(event).encode() + b"\n\n", 1.0)
    parser.feed(b"data: [DONE]\n\n", 2.0)
    return parser


def test_legacy_function_call_deltas_are_a_tool_call():
    turn = parse(call_events("search", '{"query": "x", "max_results": 5}', legacy_only=True)).finish(3.0)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [
        ("search", '{"query": "x", "max_results": 5}')
    ]
    assert turn.chunk_times, "a call-bearing event is a token-bearing event (TTFT/ITL)"


def test_legacy_function_call_beside_tool_calls_is_one_call_not_two():
    turn = parse(call_events("search", '{"query": "x", "max_results": 5}')).finish(3.0)
    assert len(turn.tool_calls) == 1 and turn.tool_calls[0].id == "call_0"


def test_tool_choice_modes():
    task = make_task(0, 0, 2)
    assert tool_choice_for("auto", task.expected(0)) == "auto"
    assert tool_choice_for("required", task.expected(0)) == "required"
    assert tool_choice_for("plan", task.expected(1)) == {
        "type": "function",
        "function": {"name": task.steps[1].name},
    }
    assert tool_choice_for("plan", None) == "auto"  # the plan is done: nothing to force
    assert chat_payload("m", [], TOOLS, tool_choice="required")["tool_choice"] == "required"
    with pytest.raises(
        ValueError, match=r"tool_choice: 'always' is not one of \['auto', 'required', 'plan'\]"
    ):
        StressSettings(url="http://x", out_dir=Path("/tmp/x"), tool_choice="always")
    with pytest.raises(
        ValueError, match=r"\['drift'\] not a detector family; accepted: \['structural', 'plan_drift', 'diver"
    ):
        StressSettings(url="http://x", out_dir=Path("/tmp/x"), count=("drift",))


def plan_follower(drift_round: int | None = None, usage: bool = True):
    """A reply that makes the plan's next call (legacy deltas beside tool_calls, as llama-cpp-python
    streams), except in round `drift_round` of every session: a well-formed, schema-valid call with
    other arguments (plan drift, as a weak model does)."""

    async def reply(body: dict, request: web.Request) -> web.StreamResponse:
        step = next_expected_call(body["messages"])
        arguments = dict(step.arguments)
        if rounds_done(body["messages"]) == drift_round:
            step = ToolCall("search", {"query": "search", "max_results": 20})
            arguments = dict(step.arguments)
        return await sse_reply(request, call_events(step.name, json.dumps(arguments), usage=usage))

    return reply


def stress(url: str, out: Path, **fields) -> StressSettings:
    return StressSettings(
        url=url, out_dir=out, **{"model": "m", "progress": False, "timeout_s": 10.0, "seed": 3, **fields}
    )


def test_plan_mode_forces_the_expected_call_by_name(scripted_server, tmp_path):
    server = scripted_server(plan_follower())
    summary = run_stress_sync(stress(server.url, tmp_path / "run", sessions=4, rounds=3, tool_choice="plan"))
    assert (summary.clean, summary.corrupted, summary.errored) == (4, 0, 0)
    forced = [r["tool_choice"] for r in server.requests]
    assert len(forced) == 12 and all(c["type"] == "function" for c in forced)
    assert {c["function"]["name"] for c in forced} <= {t["function"]["name"] for t in TOOLS}
    for body in server.requests:  # the name forced is the one the plan expects next in that conversation
        assert body["tool_choice"]["function"]["name"] == next_expected_call(body["messages"]).name
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["settings"]["tool_choice"] == "plan"


def test_plan_drift_counted_apart_goes_on_and_is_reported(scripted_server, tmp_path):
    server = scripted_server(plan_follower(drift_round=1))
    out = tmp_path / "run"
    summary = run_stress_sync(
        stress(server.url, out, sessions=6, rounds=3, count=("structural",), keep_transcripts=True)
    )
    # every session drifts in its second round: noted, not counted, and it goes on to its last round
    assert (summary.clean, summary.corrupted, summary.errored) == (6, 0, 0)
    assert summary.by_family == {"plan_drift": 6} and summary.by_detector == {}
    outcomes = read_outcomes(out / "sessions.jsonl")
    assert all(o.rounds_done == 3 and o.noted and o.noted[0].family == "plan_drift" for o in outcomes)
    document = json.loads((out / "summary.json").read_text())
    assert document["counted_families"] == ["structural"] and document["by_family"] == {"plan_drift": 6}
    transcripts = sorted((out / "transcripts").glob("*.json"))
    assert len(transcripts) == 6
    findings = [
        f for t in transcripts for turn in json.loads(t.read_text())["turns"] for f in turn["findings"]
    ]
    assert len(findings) == 6 and {f["family"] for f in findings} == {"plan_drift"}
    # the same server, counting both families (the default): a drifting session ends corrupted
    default = run_stress_sync(stress(server.url, tmp_path / "both", sessions=6, rounds=3))
    assert default.corrupted == 6 and default.by_detector == {"wrong_call": 6}


def test_missing_usage_is_flagged_and_tokens_left_unknown(scripted_server, tmp_path):
    server = scripted_server(plan_follower(usage=False))
    out = tmp_path / "run"
    summary = run_stress_sync(stress(server.url, out, sessions=3, rounds=2))
    assert summary.clean == 3 and summary.usage_missing_turns == 6
    document = json.loads((out / "summary.json").read_text())
    assert any(
        "no usage block in 6 of 6 turns" in w and "not the client's" in w for w in document["warnings"]
    )


def test_a_run_that_measured_nothing_says_so_and_exits_non_zero(scripted_server, tmp_path):
    async def refuse(body: dict, request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "tool_choice not supported"}}, status=400)

    server = scripted_server(refuse)
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.workload.stress", "--url", server.url, "--sessions", "3",
         "--rounds", "2", "--out", str(out), "--quiet", "--tool-choice", "required"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "corruption rate n/a: no session reached an outcome" in done.stdout
    assert "no session reached an outcome: all 3 errored" in done.stdout
    assert "errored by http_status: 3" in done.stdout and "corruption rate 0.0%" not in done.stdout


def test_a_stream_cut_by_a_live_server_is_not_server_gone(scripted_server):
    async def cut(body: dict, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hal')
        request.transport.close()  # the server stays up; only this stream ends
        return response

    server = scripted_server(cut)

    async def one() -> RequestError:
        async with open_session(1) as http:
            with pytest.raises(RequestError) as info:
                await stream_chat(
                    http, server.url, chat_payload("m", initial_messages(make_task(0, 0, 1))), 10.0
                )
        return info.value

    error = asyncio.run(one())
    assert error.kind == "stream_cut" and "still up" in error.message, error
