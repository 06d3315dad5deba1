"""The SSE parser and the oracle on bodies recorded from a real server nobody here wrote
(llama-cpp-python 0.3.36 serving Gemma 3 270M: tests/workload/data/README.md says how each was made).

Each body is fed in the pieces a network gives (whole, and in 7-byte pieces), so what the parser makes
of it cannot depend on the chunking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.workload.detect import check_turn
from orchestrator.workload.results import StreamedTurn
from orchestrator.workload.sse import SSEParser
from orchestrator.workload.tasks import TOOL_SCHEMAS, make_task

DATA = Path(__file__).with_name("data")


def recorded(case: str, split: int | None = None) -> StreamedTurn:
    body = (DATA / f"llamacpp_{case}.sse").read_bytes()
    parser = SSEParser()
    pieces = [body] if split is None else [body[i : i + split] for i in range(0, len(body), split)]
    for n, piece in enumerate(pieces):
        parser.feed(piece, float(n))
    return parser.finish(float(len(pieces)))


@pytest.mark.parametrize("split", [None, 7])
def test_a_forced_call_streamed_twice_per_chunk_is_one_call(split):
    """Every chunk carries the piece as a legacy function_call and as tool_calls: one call, not two,
    and not its arguments doubled."""
    turn = recorded("forced", split)
    assert turn.done and turn.finish_reason == "tool_calls" and turn.usage is None
    (call,) = turn.tool_calls
    assert call.name == "search" and call.id.startswith("call__0_search")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"query", "max_results"}
    assert turn.chunk_times and turn.content == ""
    # the server's grammar keeps JSON and types, not the schema's maximum: a true structural finding
    finding = check_turn(turn, make_task(0, 0, 4).expected(0), check_plan=True)
    assert finding is not None and finding.detector == "schema_invalid" and finding.family == "structural"
    assert arguments["max_results"] > TOOL_SCHEMAS["search"]["properties"]["max_results"]["maximum"]


def test_the_legacy_form_alone_gives_the_same_call():
    """The same body with the tool_calls deltas removed: the legacy function_call alone is read as it."""
    lines = []
    for line in (DATA / "llamacpp_forced.sse").read_text().splitlines(keepends=True):
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for choice in event.get("choices", ()):
                choice["delta"].pop("tool_calls", None)
            line = "data: " + json.dumps(event) + "\n"
        lines.append(line)
    parser = SSEParser()
    parser.feed("".join(lines).encode(), 0.0)
    legacy = parser.finish(1.0)
    both = recorded("forced")
    assert [(c.name, c.arguments) for c in legacy.tool_calls] == [
        (c.name, c.arguments) for c in both.tool_calls
    ]


def test_a_max_tokens_cut_still_says_tool_calls_and_reads_as_malformed_json():
    turn = recorded("forced_length", 7)
    assert turn.finish_reason == "tool_calls"  # the server never says "length" here
    finding = check_turn(turn)
    assert finding is not None and finding.detector == "malformed_json"


def test_plain_chat_has_content_a_stop_and_no_usage():
    turn = recorded("plain", 7)
    assert turn.done and turn.finish_reason == "stop" and turn.content and not turn.tool_calls
    assert turn.usage is None and turn.prompt_tokens == 0  # unknown, not estimated


def test_the_first_of_two_concurrent_streams_ends_without_a_finish_reason():
    """What a second request does to the first: [DONE] with no finish_reason, then the connection is
    cut mid-chunk. The body alone would read as a truncated stream; the transport error that follows it
    is what makes the client call it `stream_cut` (tests/realserver check that end to end)."""
    turn = recorded("concurrent_first")
    meta = json.loads((DATA / "llamacpp_concurrent_first.json").read_text())
    assert turn.done and turn.finish_reason is None
    assert "TransferEncodingError" in meta["client_error"]
    second = recorded("concurrent_second", 7)
    assert second.done and second.finish_reason is not None  # the second, which waited, is whole


@pytest.mark.parametrize("case", ["auto", "required", "after_failure"])
def test_an_empty_body_is_no_turn(case):
    turn = recorded(case)
    assert not turn.done and turn.finish_reason is None and not turn.tool_calls  # stream_chat: errored
