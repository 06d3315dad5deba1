"""The streaming client: the SSE parser on literal bytes, then real HTTP against the simulated server."""

from __future__ import annotations

import asyncio
import json

import pytest

from orchestrator.workload.client import chat_payload, open_session, stream_chat
from orchestrator.workload.results import StreamedTurn
from orchestrator.workload.sse import SSEParser
from orchestrator.workload.tasks import TOOLS, initial_messages, make_task
from orchestrator.workload.wire import ERROR_KINDS, RequestError


def sse(*events: object, done: bool = True, sep: bytes = b"\n\n") -> bytes:
    body = b"".join(b"data: " + json.dumps(e).encode() + sep for e in events)
    return body + (b"data: [DONE]" + sep if done else b"")


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    event: dict = {"object": "chat.completion.chunk", "choices": []}
    if delta is not None or finish is not None:
        event["choices"] = [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    if usage is not None:
        event["usage"] = usage
    return event


TOOL_STREAM = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Step 1 "}),
    chunk({"reasoning_content": "is read_file."}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": ""},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"name": None, "arguments": '{"path": '}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"src/a.py"}'}}]}),
    chunk({}, finish="tool_calls"),
    chunk(usage={"prompt_tokens": 321, "completion_tokens": 17, "total_tokens": 338}),
)


def parse(body: bytes, split: int | None = None) -> StreamedTurn:
    """Parse `body` fed in pieces of `split` bytes (None: one piece), clock = piece number."""
    parser = SSEParser()
    pieces = [body] if split is None else [body[i : i + split] for i in range(0, len(body), split)]
    for n, piece in enumerate(pieces):
        parser.feed(piece, float(n))
    return parser.finish(float(len(pieces)))


def test_parser_assembles_tool_call_reasoning_usage():
    turn = parse(TOOL_STREAM)
    assert turn.reasoning == "Step 1 is read_file."
    assert turn.content == ""
    assert [(c.index, c.id, c.name, c.arguments) for c in turn.tool_calls] == [
        (0, "call_a", "read_file", '{"path": "src/a.py"}')
    ]
    assert turn.finish_reason == "tool_calls" and turn.done
    assert turn.usage == {"prompt_tokens": 321, "completion_tokens": 17, "total_tokens": 338}
    assert turn.prompt_tokens == 321 and turn.completion_tokens == 17
    assert turn.raw == TOOL_STREAM


@pytest.mark.parametrize("split", [1, 2, 3, 7, 64])
def test_parser_is_incremental_whatever_the_chunking(split):
    whole = parse(TOOL_STREAM)
    pieces = parse(TOOL_STREAM, split)
    assert (pieces.content, pieces.reasoning, pieces.tool_calls, pieces.finish_reason, pieces.usage) == (
        whole.content,
        whole.reasoning,
        whole.tool_calls,
        whole.finish_reason,
        whole.usage,
    )
    # token-bearing events are timestamped when the piece completing them arrives: increasing times
    assert len(pieces.chunk_times) == 5
    assert pieces.chunk_times == sorted(pieces.chunk_times) and pieces.chunk_times[0] > 0


def test_parser_crlf_comments_and_multiline_data():
    body = (
        b": keep-alive\r\n\r\n"
        b'event: message\r\ndata: {"choices": [{"index": 0,\r\ndata: "delta": {"content": "DONE"},'
        b' "finish_reason": "stop"}]}\r\n\r\n'
        b"data:[DONE]\r\n\r\n"
    )
    turn = parse(body, 5)
    assert (turn.content, turn.finish_reason, turn.done) == ("DONE", "stop", True)


def test_parser_timestamps_and_latencies():
    parser = SSEParser(StreamedTurn(started=10.0))
    parser.feed(sse(chunk({"content": "a"}), done=False), 10.5)
    parser.feed(sse(chunk({"content": "b"}), done=False), 10.7)
    parser.feed(sse(chunk({}, finish="stop")), 10.8)
    turn = parser.finish(11.0)
    assert turn.chunk_times == [10.5, 10.7]
    assert turn.ttft_s == pytest.approx(0.5)
    assert turn.itl_s == pytest.approx([0.2])
    assert turn.latency_s == pytest.approx(1.0)


def test_parser_two_calls_and_missing_index():
    body = sse(
        chunk(
            {"tool_calls": [{"index": 0, "id": "a", "function": {"name": "read_file", "arguments": "{}"}}]}
        ),
        chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "search", "arguments": "{"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": "}"}}]}),
        # no index: a new id starts a call, no id continues the last one
        chunk({"tool_calls": [{"id": "c", "function": {"name": "http_get", "arguments": '{"u'}}]}),
        chunk({"tool_calls": [{"function": {"arguments": 'rl": 1}'}}]}),
        chunk({}, finish="tool_calls"),
    )
    calls = parse(body).tool_calls
    assert [(c.index, c.id, c.name, c.arguments) for c in calls] == [
        (0, "a", "read_file", "{}"),
        (1, "b", "search", "{}"),
        (2, "c", "http_get", '{"url": 1}'),
    ]


def test_parser_name_repeated_in_every_delta_is_not_doubled():
    body = sse(
        chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "read_file", "arguments": "{"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "read_file", "arguments": "}"}}]}),
        chunk({}, finish="tool_calls"),
    )
    assert parse(body).tool_calls[0].name == "read_file"


def test_parser_keeps_invalid_utf8_as_evidence():
    body = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "ok \xff\xfe"}, "finish_reason": "stop"}]}\n\n'
    )
    turn = parse(body)
    assert turn.content == "ok \udcff\udcfe" and turn.finish_reason == "stop"


def test_parser_done_without_finish_reason_is_a_turn():
    turn = parse(sse(chunk({"content": "partial"})))
    assert turn.done and turn.finish_reason is None and turn.content == "partial"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (b"data: not json\n\n", "protocol"),
        (b"data: [1, 2]\n\n", "protocol"),
        (b'data: {"error": {"message": "aborted", "code": 500}}\n\n', "server_error"),
        (b'data: {"object": "error", "message": "x"}\n\n', "server_error"),
    ],
)
def test_parser_raises_request_error(body, kind):
    with pytest.raises(RequestError) as info:
        parse(body)
    assert info.value.kind == kind


def test_request_error_kinds_are_checked():
    assert RequestError("timeout", "x").kind == "timeout"
    with pytest.raises(ValueError):
        RequestError("nonsense", "x")
    assert "http_status" in ERROR_KINDS


def test_chat_payload_asks_for_streamed_usage_and_tools():
    payload = chat_payload("m", [{"role": "user", "content": "hi"}], TOOLS, max_tokens=9)
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["tools"] is TOOLS and payload["tool_choice"] == "auto" and payload["max_tokens"] == 9
    assert "tools" not in chat_payload("m", [])


# --- real HTTP over loopback -----------------------------------------------------------------------


def _run(coro):
    return asyncio.run(coro)


async def _one_turn(url: str, timeout: float = 10.0, payload: dict | None = None) -> StreamedTurn:
    task = make_task(1, 0, 2)
    payload = payload or chat_payload("m", initial_messages(task), TOOLS)
    async with open_session(4) as http:
        return await stream_chat(http, url, payload, timeout)


def test_stream_chat_against_the_sim(sim_server):
    turn = _run(_one_turn(sim_server.url))
    expected = make_task(1, 0, 2).expected(0)
    assert turn.finish_reason == "tool_calls" and turn.done
    assert len(turn.tool_calls) == 1
    assert turn.tool_calls[0].name == expected.name
    assert json.loads(turn.tool_calls[0].arguments) == dict(expected.arguments)
    assert turn.usage is not None and turn.prompt_tokens > 0 and turn.completion_tokens > 0
    assert turn.chunk_times and turn.ttft_s is not None and 0 <= turn.ttft_s <= turn.latency_s
    assert turn.raw.startswith(b"data: ")


def test_connection_refused_is_typed(unused_port):
    with pytest.raises(RequestError) as info:
        _run(_one_turn(f"http://127.0.0.1:{unused_port}"))  # nothing listens there
    assert info.value.kind == "connection_refused"


def test_http_error_status_is_typed(sim_server):
    with pytest.raises(RequestError) as info:
        _run(_one_turn(sim_server.url, payload={"messages": "not a list", "model": "m"}))
    assert info.value.kind == "http_status" and 400 <= info.value.status < 500


def test_timeout_is_typed(start_sim):
    slow = start_sim(time_scale=0.25)  # a tool-call turn takes a few hundred ms here
    with pytest.raises(RequestError) as info:
        _run(_one_turn(slow.url, timeout=0.02))
    assert info.value.kind == "timeout"
