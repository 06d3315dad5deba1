"""The oracle's detectors on literal turns: each fires on a bad one and stays quiet on a healthy one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.workload import detect
from orchestrator.workload.detect import DETECTORS, Finding, check_turn
from orchestrator.workload.results import StreamedToolCall, StreamedTurn
from orchestrator.workload.tasks import ToolCall, make_task

READ = ToolCall("read_file", {"path": "src/scheduler.py"})


def call_turn(
    name: str = "read_file",
    arguments: str = '{"path": "src/scheduler.py"}',
    content: str = "",
    reasoning: str = "",
    finish_reason: str | None = "tool_calls",
) -> StreamedTurn:
    return StreamedTurn(
        content=content,
        reasoning=reasoning,
        tool_calls=[StreamedToolCall(index=0, id="call_0", name=name, arguments=arguments)],
        finish_reason=finish_reason,
        done=True,
    )


HEALTHY = call_turn()


def healthy_turns() -> list[StreamedTurn]:
    """A healthy turn for every step of a few hundred seeded tasks, plus a plain reasoning preamble."""
    turns = []
    for i in range(200):
        for step in make_task(7, i, 4).steps:
            turns.append(
                call_turn(
                    step.name,
                    json.dumps(dict(step.arguments)),
                    reasoning=f"The plan says to call {step.name} next; "
                    f'I will call it with {{"name": "{step.name}", "arguments": ...}}.',
                )
            )
    return turns


def test_all_detectors_are_named_in_order():
    assert DETECTORS[0] == "truncated_stream" and DETECTORS[-1] == "wrong_call"
    assert len(set(DETECTORS)) == len(DETECTORS)


def test_structural_detectors_quiet_on_healthy_turns():
    turns = healthy_turns()
    findings = [check_turn(t) for t in turns]
    assert findings == [None] * len(turns)


def test_plan_check_quiet_when_calls_follow_the_plan():
    task = make_task(3, 11, 4)
    for r, step in enumerate(task.steps):
        turn = call_turn(step.name, json.dumps(dict(step.arguments)))
        assert check_turn(turn, task.expected(r), check_plan=True) is None


# --- truncated_stream ---------------------------------------------------------------------------


def test_truncated_stream_fires_without_finish_reason():
    assert detect.truncated_stream(call_turn(finish_reason=None))
    assert check_turn(call_turn(finish_reason=None)).detector == "truncated_stream"


def test_truncated_stream_quiet_with_finish_reason():
    assert detect.truncated_stream(call_turn(finish_reason="tool_calls")) is None
    assert detect.truncated_stream(call_turn(finish_reason="stop")) is None


# --- invalid_utf8 / control_chars -----------------------------------------------------------------


@pytest.mark.parametrize(
    "turn",
    [
        # bytes 0xff 0xfe kept by the client's surrogateescape decoding
        call_turn(content=b"ok \xff\xfe".decode("utf-8", "surrogateescape")),
        call_turn(content="caf\ufffd"),  # a replacement character from a failed detokenisation
        call_turn(arguments='{"path": "src/\\udc80.py"}'),  # a lone surrogate escaped in the JSON
        call_turn(reasoning="thinking \ud83d"),
    ],
)
def test_invalid_utf8_fires(turn):
    assert detect.invalid_utf8(turn)
    assert check_turn(turn).detector == "invalid_utf8"


def test_invalid_utf8_quiet_on_non_ascii_text():
    turn = call_turn(content="naïve café — 日本語 🚀", arguments='{"path": "src/ünïcode_\\u00e9.py"}')
    assert detect.invalid_utf8(turn) is None
    assert check_turn(turn) is None


@pytest.mark.parametrize(
    "turn",
    [
        call_turn(content="done\x00"),
        call_turn(content="bell\x07"),
        call_turn(content="c1 \x85 control"),
        call_turn(arguments='{"path": "src/a\\u001b[31m.py"}'),  # escape sequence hidden in a JSON value
        call_turn(name="read_file\x7f"),
    ],
)
def test_control_chars_fires(turn):
    assert detect.control_chars(turn)
    assert check_turn(turn).detector == "control_chars"


def test_control_chars_quiet_on_tabs_and_newlines():
    turn = call_turn(content="a\tb\r\nc\n", arguments=json.dumps({"path": "notes/x.md"}))
    assert detect.control_chars(turn) is None
    write = call_turn("write_file", json.dumps({"path": "notes/a.md", "content": "# t\n\tchecked: 3\r\n"}))
    assert check_turn(write) is None


# --- degenerate_repetition ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "turn",
    [
        call_turn(content="the " * 30),
        call_turn(reasoning="Let me read the file. " * 12),
        call_turn("write_file", json.dumps({"path": "notes/a.md", "content": "checked: 1\n" * 40})),
        call_turn(content="intro " + "ab" * 45),
    ],
)
def test_degenerate_repetition_fires(turn):
    assert detect.degenerate_repetition(turn)
    assert check_turn(turn).detector == "degenerate_repetition"


@pytest.mark.parametrize(
    "text",
    [
        "-" * 200,  # a rule, not a loop: the unit has no letter or digit
        " " * 100 + "x",
        "the " * 9,  # too few repeats
        "ab" * 30,  # too short a span
        "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n" * 2,
        Path(detect.__file__).read_text(encoding="utf-8")[:6000],  # ordinary prose and code
    ],
)
def test_degenerate_repetition_quiet(text):
    assert detect.degenerate_repetition(call_turn(reasoning=text)) is None


def test_repetition_prefilter_misses_no_run():
    """The k-gram prefilter is exact: every unit length up to 200 at the minimum repeat count is found."""
    for p in range(1, 201):
        unit = ("xyzw" * 60)[: p - 1] + "q"
        reps = max(detect.MIN_REPEATS, -(-detect.MIN_SPAN // p))
        text = "prefix " + unit * reps + " suffix"
        assert detect.degenerate_repetition(call_turn(content=text)), p


# --- leaked_tool_call / missing_tool_call -----------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        '{"name": "read_file", "arguments": {"path": "src/router.py"}}',
        '<tool_call>{"name": "read_file"}</tool_call>',
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>read_file",
        "[TOOL_CALLS] read_file",
    ],
)
def test_leaked_tool_call_fires(content):
    turn = StreamedTurn(content=content, finish_reason="stop", done=True)
    assert detect.leaked_tool_call(turn)
    assert check_turn(turn).detector == "leaked_tool_call"


def test_leaked_tool_call_quiet():
    assert detect.leaked_tool_call(StreamedTurn(content="DONE", finish_reason="stop")) is None
    # the reasoning may discuss the call it is about to make
    assert (
        detect.leaked_tool_call(call_turn(reasoning='next: {"name": "read_file", "arguments": {}}')) is None
    )
    assert detect.leaked_tool_call(call_turn(content='The config is {"name": "x"}.')) is None


def test_missing_tool_call_fires_on_plain_text():
    turn = StreamedTurn(content="I have read the file.", finish_reason="stop", done=True)
    assert detect.missing_tool_call(turn)
    assert check_turn(turn) == Finding("missing_tool_call", detect.missing_tool_call(turn))


def test_missing_tool_call_quiet_with_a_call():
    assert detect.missing_tool_call(HEALTHY) is None


# --- malformed_json / unknown_tool / schema_invalid ---------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    ['{"path": "src/a.py"', '{"path": src/a.py}', "", '["src/a.py"]', '{"path": "a"}}', "null"],
)
def test_malformed_json_fires(arguments):
    turn = call_turn(arguments=arguments)
    assert detect.malformed_json(turn)
    assert check_turn(turn).detector == "malformed_json"


def test_malformed_json_quiet_on_valid_object():
    assert detect.malformed_json(call_turn(arguments=' {"path" : "src/a.py"} ')) is None


@pytest.mark.parametrize("name", ["read_files", "exec", "", "Read_File"])
def test_unknown_tool_fires(name):
    turn = call_turn(name=name)
    assert detect.unknown_tool(turn)
    assert check_turn(turn).detector == "unknown_tool"


def test_unknown_tool_quiet_on_offered_tools():
    for name in ("read_file", "write_file", "run_shell", "search", "http_get"):
        assert detect.unknown_tool(call_turn(name=name)) is None


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("read_file", "{}"),  # missing required
        ("read_file", '{"path": ""}'),  # minLength
        ("read_file", '{"path": "a", "mode": "r"}'),  # additionalProperties
        ("run_shell", '{"command": "ls", "timeout_s": "30"}'),  # wrong type
        ("run_shell", '{"command": "ls", "timeout_s": 0}'),  # below minimum
        ("search", '{"query": "x", "max_results": 51}'),
        ("http_get", '{"url": "ftp://x"}'),  # pattern
    ],
)
def test_schema_invalid_fires(name, arguments):
    turn = call_turn(name, arguments)
    assert detect.schema_invalid(turn)
    assert check_turn(turn).detector == "schema_invalid"


def test_schema_invalid_quiet_on_valid_arguments():
    assert detect.schema_invalid(call_turn("run_shell", '{"command": "ls src/", "timeout_s": 60}')) is None
    assert detect.schema_invalid(call_turn("http_get", '{"url": "https://docs.example.org/a"}')) is None


# --- wrong_call ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "turn",
    [
        call_turn("search", '{"query": "x", "max_results": 5}'),  # another (valid) tool
        call_turn("read_file", '{"path": "src/router.py"}'),  # the right tool, other arguments
        StreamedTurn(
            tool_calls=[
                StreamedToolCall(0, "a", "read_file", '{"path": "src/scheduler.py"}'),
                StreamedToolCall(1, "b", "read_file", '{"path": "src/scheduler.py"}'),
            ],
            finish_reason="tool_calls",
            done=True,
        ),
    ],
)
def test_wrong_call_fires(turn):
    assert detect.wrong_call(turn, READ)
    assert check_turn(turn, READ, check_plan=True).detector == "wrong_call"
    assert check_turn(turn, READ, check_plan=False) is None  # only where the study enables it


def test_wrong_call_quiet_on_expected_call():
    same_but_reordered = call_turn("write_file", '{"content": "c", "path": "p"}')
    assert (
        detect.wrong_call(same_but_reordered, ToolCall("write_file", {"path": "p", "content": "c"})) is None
    )
    assert detect.wrong_call(HEALTHY, READ) is None
    assert detect.wrong_call(HEALTHY, None) is None  # nothing expected: nothing to compare


def test_first_firing_detector_wins():
    # no finish_reason and malformed JSON: the stream check comes first
    turn = call_turn(arguments='{"path": ', finish_reason=None)
    assert check_turn(turn).detector == "truncated_stream"


def test_the_oracle_needs_no_http_client():
    # the oracle is pure: judging a turn must not import the client (nor aiohttp, nor its transport)
    modules = {"aiohttp", *(f"orchestrator.workload.{m}" for m in ("client", "http1", "sse"))}
    code = f"import sys, orchestrator.workload.detect\nprint(sorted({modules!r} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
