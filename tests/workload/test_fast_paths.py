"""The client's fast paths give exactly what the straightforward code gives.

Each fast path of issue 17 part 5 against its reference: the compiled schema checks against
jsonschema's Draft 2020-12 validator, the shared-view oracle and the repetition prefilter against the
plain definitions, the SSE parser's whole-chunk and template paths against line-by-line reading, the
incremental request body against `stream_chat`'s serialisation, the synthetic tool results and prompts
against their definitions, and the lean HTTP/1.1 path against the framings, failures and keep-alive
behaviour of real servers (aiohttp's web server on loopback, and raw sockets for what aiohttp will not
send). The old-vs-new oracle on the sim's recorded turns is tests/workload/test_oracle_equivalence.py.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import json
import random
import socket
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from conftest import call_events, sse_reply

from orchestrator.workload import client, detect, http1, stress, tasks, wire
from orchestrator.workload.client import chat_payload, open_session, stream_chat
from orchestrator.workload.results import BadTurn, SessionOutcome, StreamedToolCall, StreamedTurn
from orchestrator.workload.sse import SSEParser
from orchestrator.workload.tasks import TOOL_SCHEMAS, TOOLS, initial_messages, make_task
from orchestrator.workload.wire import RequestError

# --- compiled schema checks vs jsonschema ---------------------------------------------------------------

_VALUES = [
    None, True, False, 0, 1, -1, 5, 10, 20, 29, 30, 50, 51, 59, 60, 120, 599, 600, 601, 10**20, 2**63,
    0.0, 1.0, 1.5, 30.0, 600.0, 600.5, -0.0, float("inf"), float("nan"), 1e300,
    "", "x", "src/a.py", "ls", "https://docs.example.org/a", "http://x", "ftp://x", " https://x",
    "HTTPS://x", "é", "\udc80", "a" * 300, [], ["x"], {}, {"path": "x"},
]  # fmt: skip


def _argument_objects(schema: dict, rng: random.Random, count: int) -> list:
    """Valid, nearly valid and invalid instances for an object schema: every property with every value
    from _VALUES, required ones dropped, extra keys added, and random mixtures."""
    properties = list(schema.get("properties", {}))
    base = {name: _valid_value(sub) for name, sub in schema.get("properties", {}).items()}
    out: list = [base, {}, [], "x", None, 3, dict(base, extra=1)]
    for name in properties:
        for value in _VALUES:
            out.append({**base, name: value})
        dropped = dict(base)
        dropped.pop(name)
        out.append(dropped)
    for _ in range(count):
        instance = {}
        for name in properties:
            if rng.random() < 0.85:
                instance[name] = base[name] if rng.random() < 0.6 else rng.choice(_VALUES)
        if rng.random() < 0.15:
            instance[rng.choice(["mode", "x", "path", "timeout", ""])] = rng.choice(_VALUES)
        out.append(instance)
    return out


def _valid_value(schema: dict):
    kind = schema.get("type")
    if kind == "integer":
        return schema.get("minimum", 1)
    if kind == "string":
        return "https://x" if "pattern" in schema else "x"
    return None


EXTRA_SCHEMAS = [
    # keywords the tool schemas do not use yet, which the compiler covers
    {"type": ["string", "null"], "maxLength": 3},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 600},
    {"type": "integer", "minimum": 1.5, "maximum": 600},
    {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}},
        "additionalProperties": {"type": "string", "minLength": 1},
    },
    {"properties": {"a": {"type": "array"}}, "required": ["a"]},  # no "type": applies to objects only
    {"type": "object", "properties": {"a": True, "b": False}, "additionalProperties": True},
    {"title": "annotations only", "description": "d", "default": 1, "format": "uri"},
    # keywords it does not cover: jsonschema's own validator checks these
    {"type": "object", "properties": {"mode": {"enum": ["r", "w"]}}, "required": ["mode"]},
    {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
    {"$defs": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/$defs/n"}}},
    {"anyOf": [{"type": "string"}, {"type": "integer", "minimum": 3}]},
]


@pytest.mark.parametrize("name", sorted(TOOL_SCHEMAS))
def test_compiled_schema_agrees_with_jsonschema_on_tool_arguments(name):
    schema = TOOL_SCHEMAS[name]
    reference = jsonschema.Draft202012Validator(schema)
    assert detect._compile_schema(schema) is not None  # the tool schemas are covered, not delegated
    check = detect._schema_check(schema)
    instances = _argument_objects(schema, random.Random(name), 3000)
    assert sum(map(reference.is_valid, instances)) > 50  # valid ones too, not only broken ones
    for instance in instances:
        assert check(instance) == reference.is_valid(instance), instance
        # the detector fires exactly when Draft 2020-12 validation fails, with jsonschema's message
        turn = StreamedTurn(
            tool_calls=[StreamedToolCall(0, "c", name, json.dumps(instance, allow_nan=True))],
            finish_reason="tool_calls",
        )
        fired = detect.schema_invalid(turn)
        if isinstance(instance, dict):
            assert (fired is not None) == (not reference.is_valid(instance)), instance
            if fired is not None:
                # the message is the one the oracle always gave: best_match of its validator
                same = detect._validator(json.dumps(schema, sort_keys=True))
                error = jsonschema.exceptions.best_match(same.iter_errors(instance))
                assert error is not None and error.message[:200] in fired
        else:
            assert fired is None  # not an object: malformed_json owns it


@pytest.mark.parametrize("schema", EXTRA_SCHEMAS, ids=range(len(EXTRA_SCHEMAS)))
def test_schema_checks_agree_with_jsonschema_beyond_the_tool_schemas(schema):
    reference = jsonschema.Draft202012Validator(schema)
    check = detect._schema_check(schema)
    rng = random.Random(7)
    keys = ["a", "b", "x1", "xy", "mode", "n", ""]
    instances = list(_VALUES)
    for _ in range(2000):
        instances.append({k: rng.choice(_VALUES) for k in rng.sample(keys, rng.randint(0, 3))})
        instances.append({"a": {"b": rng.choice(_VALUES)}, "x": rng.choice(_VALUES)})
        instances.append({"mode": rng.choice(["r", "w", "x", 1])})
    for instance in instances:
        assert check(instance) == reference.is_valid(instance), (schema, instance)


def test_schema_checks_are_built_once_per_schema():
    schema = copy.deepcopy(TOOL_SCHEMAS["search"])
    assert detect._schema_check(schema) is detect._schema_check(schema)
    assert detect._schema_check(copy.deepcopy(schema)) is not detect._schema_check(schema)


# --- the oracle's shortcuts ------------------------------------------------------------------------------


def reference_periodic_run(text: str) -> tuple[int, int, int] | None:
    """The repetition search as defined: every unit length, the text compared with itself shifted."""
    n = len(text)
    if n < detect.MIN_SPAN:
        return None
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    for p in range(1, min(detect.MAX_UNIT, n // detect.MIN_REPEATS) + 1):
        need = max(p * (detect.MIN_REPEATS - 1), detect.MIN_SPAN - p)
        same = codes[p:] == codes[:-p]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.view(np.int8), [0]))))
        for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            if end - start >= need and detect._ALNUM.search(text[start : start + p]):
                return start, p, end - start + p
    return None


def test_repetition_prefilter_finds_what_the_definition_finds():
    rng = random.Random(11)
    alphabet = "ab c\n-x1\udc80é|"
    texts = [Path(detect.__file__).read_text(encoding="utf-8")[:5000], "-" * 300, "ab" * 39 + "a"]
    for _ in range(1500):
        noise = lambda k: "".join(rng.choice(alphabet) for _ in range(k))  # noqa: E731
        if rng.random() < 0.6:
            unit = noise(rng.randint(1, 210))
            body = (unit * rng.randint(3, 40))[: rng.randint(40, 3000)]
            texts.append(noise(rng.randint(0, 60)) + body + noise(rng.randint(0, 60)))
        else:
            texts.append(noise(rng.choice([79, 80, 85, 143, 144, 300, 800, 2500])))
    for text in texts:
        assert detect.periodic_run(text) == reference_periodic_run(text), text[:80]


def test_long_texts_take_the_vectorised_prefilter_in_blocks(monkeypatch):
    monkeypatch.setattr(detect, "_ROWS", detect._BLOCK * 2)  # many blocks, so block edges are crossed
    text = "filler words here " * 40 + "loop! " * 30 + "tail"
    assert detect.periodic_run(text) == reference_periodic_run(text) is not None


def reference_check_turn(turn, expected=None, check_plan=False):
    """check_turn as the plain sequence of public detectors, each on its own."""
    for name, detector in detect.STRUCTURAL:
        reason = detector(turn)
        if reason is not None:
            return detect.Finding(name, reason)
    if check_plan:
        reason = detect.wrong_call(turn, expected)
        if reason is not None:
            return detect.Finding("wrong_call", reason)
    return None


def test_shared_view_oracle_gives_the_detectors_own_verdicts():
    task = make_task(5, 1, 4)
    variants = []
    for r, step in enumerate(task.steps):
        good = json.dumps(dict(step.arguments))
        for arguments in [good, good[:-3], '{"path": ""}', "[1]", good.replace('"', "'"), "{}" * 3]:
            for content in ["", "DONE", "ok \udcff", "bell\x07", "the " * 30, '<tool_call>{"name": "x"}']:
                variants.append(
                    (
                        StreamedTurn(
                            content=content,
                            reasoning="" if r % 2 else "thinking \ufffd",
                            tool_calls=[StreamedToolCall(0, "a", step.name, arguments)],
                            finish_reason=None if content == "DONE" else "tool_calls",
                        ),
                        task.expected(r),
                    )
                )
        variants.append((StreamedTurn(content="no call", finish_reason="stop"), task.expected(r)))
    nested = "[" * 100_000 + "]" * 100_000  # too deep to parse: the same error either way
    variants.append((StreamedTurn(tool_calls=[StreamedToolCall(0, "a", "read_file", nested)]), None))
    for turn, expected in variants:
        for plan in (False, True):
            try:
                want = ("ok", reference_check_turn(turn, expected, plan))
            except RecursionError:
                want = ("raises", None)
            try:
                got = ("ok", detect.check_turn(turn, expected, plan))
            except RecursionError:
                got = ("raises", None)
            assert got == want, turn


# --- SSE parsing: whole chunks and templates vs line by line -----------------------------------------


def line_by_line(body: bytes, pieces: list[bytes]) -> StreamedTurn:
    """The parser fed byte by byte where a byte boundary forces the line-by-line path."""
    parser = SSEParser()
    for i, piece in enumerate(pieces):
        parser.feed(piece, float(i))
    return parser.finish(float(len(pieces)))


def fields(turn: StreamedTurn) -> tuple:
    return (
        turn.content,
        turn.reasoning,
        [(c.index, c.id, c.name, c.arguments) for c in turn.tool_calls],
        turn.finish_reason,
        turn.usage,
        turn.done,
        turn.raw,
        len(turn.chunk_times),
    )


def event(delta: dict, finish=None, index=0, usage=None) -> bytes:
    body = {"id": "r1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    body["choices"] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogateescape") + b"\n\n"


def args_delta(text: str, index: int = 0, name=None, call_id=None) -> dict:
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": text}}
        ]
    }


PIECES = ['{"pa', 'th": "', "src/\\", '"x\\"', "\\\\", '"}', "é", "\\u00e9", "\\ud83d\\ude00", "", "\\/", "}"]


def template_streams() -> list[list[bytes]]:
    """Streams whose argument deltas exercise the template: escapes, quotes and backslashes at the ends
    of a piece, unicode, empty pieces, the name repeated, a second call, a changed layout."""
    start = {
        "tool_calls": [
            {"index": 0, "id": "c0", "type": "function", "function": {"name": "read_file", "arguments": ""}}
        ]
    }
    streams = []
    rng = random.Random(3)
    for _ in range(60):
        events = [event({"role": "assistant", "content": ""}), event(start)]
        for _ in range(rng.randint(1, 12)):
            piece = rng.choice(PIECES)
            roll = rng.random()
            if roll < 0.1:
                events.append(event(args_delta(piece, name="read_file")))  # the name repeated
            elif roll < 0.15:
                events.append(event(args_delta(piece, index=1, call_id="c1", name="search")))
            elif roll < 0.2:
                events.append(event(args_delta(piece, index=1)))
            elif roll < 0.25:
                events.append(event(args_delta(piece), usage={"completion_tokens": 1}))  # layout changes
            elif roll < 0.3:
                events.append(event(args_delta(piece, name="_more")))  # a name piece: not a template
            else:
                events.append(event(args_delta(piece)))
        events.append(event({}, finish="tool_calls"))
        events.append(
            event({}, usage={"prompt_tokens": 3, "completion_tokens": 4}) if rng.random() < 0.8 else b""
        )
        events.append(b"data: [DONE]\n\n")
        streams.append(events)
    # raw bytes a server may send inside the arguments string: invalid UTF-8, a raw control character
    bad = [event(start), event(args_delta("ok")), event(args_delta("x")).replace(b'"x"', b'"\xff\xfe"')]
    streams.append([*bad, event(args_delta("\x01")), event({}, finish="tool_calls"), b"data: [DONE]\n\n"])
    return streams


@pytest.mark.parametrize("split", [None, 1, 7, 64, "event"])
def test_parser_fast_paths_match_line_by_line_reading(split):
    for events in template_streams():
        body = b"".join(events)
        # the reference: one byte at a time, never a whole event in a chunk (no fast path applies)
        want = line_by_line(body, [body[i : i + 1] for i in range(len(body))])
        if split is None:
            pieces = [body]
        elif split == "event":
            pieces = [e for e in events if e]
        else:
            pieces = [body[i : i + split] for i in range(0, len(body), split)]
        got = line_by_line(body, pieces)
        assert fields(got) == fields(want)


def test_template_is_learnt_and_used():
    events = [event({"role": "assistant"}), event(args_delta("", name="read_file", call_id="c0"))]
    events += [event(args_delta(piece)) for piece in ['{"path"', ': "a\\"b', '\\\\"}']]
    parser = SSEParser()
    for e in events:
        parser.feed(e, 1.0)
    assert parser._template is not None and parser._template[3] is parser._calls[0]
    turn = parser.finish(2.0)
    assert turn.tool_calls[0].arguments == '{"path": "a\\"b\\\\"}' and len(turn.chunk_times) == 4
    # streamed text has its template too
    parser = SSEParser()
    for piece in ["Hel", "lo \\", '"w"', "", "é"]:
        parser.feed(event({"content": piece}), 1.0)
    assert parser._template is not None and parser._template[2] is parser._content
    turn = parser.finish(2.0)
    assert turn.content == 'Hello \\"w"é' and len(turn.chunk_times) == 4  # the empty piece carries nothing


# --- the request body, tool results, prompts, outcome lines ----------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "required", "plan"])
def test_incremental_request_body_is_what_stream_chat_sends(mode):
    settings = stress.StressSettings(url="http://x", out_dir=Path("/tmp/x"), model="m-é", max_tokens=77)
    task = make_task(4, 2, 3)
    messages = initial_messages(task)
    body = stress.RequestBody(settings, messages)
    for r in range(4):
        choice = tasks.tool_choice_for(mode, task.expected(r))
        payload = dict(
            chat_payload("m-é", messages, TOOLS, max_tokens=77, temperature=0.0, tool_choice=choice)
        )
        payload["stream"] = True
        assert body.body(choice) == wire.dumps(payload)
        turn = StreamedTurn(
            content="x" if r else "", tool_calls=[StreamedToolCall(0, f"c{r}", "read_file", "{}")]
        )
        for message in (stress.assistant_message(turn), *stress.tool_messages(task, min(r, 2), turn)):
            messages.append(message)
            body.add(message)


def test_tool_results_and_prompts_are_their_definitions():
    for seed, index in itertools.product(range(30), range(0, 300, 37)):
        task = make_task(seed, index, 1 + index % 7)
        lines = [f"Task {task.task_id}: perform the following plan, one tool call per turn, in order."]
        for i, step in enumerate(task.steps, 1):
            lines.append(f"{i}. call {step.name} with {json.dumps(dict(step.arguments), sort_keys=True)}")
        lines.append(f"<plan>{json.dumps([s.as_json() for s in task.steps], sort_keys=True)}</plan>")
        assert tasks.user_prompt(task) == "\n".join(lines)
        for r, step in enumerate(task.steps):
            rng = random.Random(f"{task.task_id}:{r}")
            body = " ".join(rng.choice(tasks._WORDS) for _ in range(40))
            want = f"[{step.name} ok] {json.dumps(dict(step.arguments), sort_keys=True)}\n{body}"
            assert tasks.tool_result(task, r) == want
    for words, seed in itertools.product(
        [["a"], list("ab"), list("abc"), tasks._WORDS, list("x" * 33)], range(40)
    ):
        a, b = random.Random(seed), random.Random(seed)
        assert tasks._choices(a, words, 50) == [b.choice(words) for _ in range(50)]


def test_outcome_line_is_to_dict():
    noted = [BadTurn(1, "wrong_call", "r", "x", "plan_drift")]
    for outcome in [
        SessionOutcome("a", "clean", 2, 2, turn_latency_s=[0.1, 0.2], prompt_tokens=5, completion_tokens=6),
        SessionOutcome(
            "b", "corrupted", 3, 1, bad_turn=BadTurn(1, "malformed_json", "r", "raw", "structural")
        ),
        SessionOutcome("c", "errored", 2, 0, error="timeout: x", noted=noted, usage_missing_turns=1),
    ]:
        assert stress.outcome_dict(outcome) == outcome.to_dict()
        assert json.dumps(stress.outcome_dict(outcome)) == json.dumps(outcome.to_dict())


# --- the event loop and the garbage collector in the sync entry points --------------------------------


def test_sync_entry_uses_uvloop_where_installed_and_restores_the_collector(monkeypatch):
    pytest.importorskip("uvloop")

    async def loop_name() -> str:
        return type(asyncio.get_running_loop()).__module__

    before = gc.get_threshold()
    assert client.run_sync(loop_name()).startswith("uvloop")
    assert gc.get_threshold() == before
    monkeypatch.setenv(client.UVLOOP_ENV, "0")
    assert client.run_sync(loop_name()).startswith("asyncio")
    # library callers keep their own loop: nothing is installed globally
    assert not type(asyncio.new_event_loop()).__module__.startswith("uvloop")


# --- the lean HTTP/1.1 path against real servers --------------------------------------------------------


class RawServer:
    """A loopback TCP server answering each request with bytes the test gives (a list of writes, or a
    callable(sock)), for framings aiohttp's server does not produce; it closes the connection after
    each answer unless `keep_alive`, answers any GET (the client's liveness probe) with a 404, and
    counts the connections it accepted."""

    def __init__(self, replies, keep_alive: bool = False):
        self.replies = replies  # request number -> list of byte strings, or a callable(sock)
        self.keep_alive = keep_alive
        self.connections = 0
        self.requests = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn):
        with conn:
            buffer = b""
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                if head.startswith(b"GET "):
                    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    return
                lines = head.lower().split(b"\r\n")
                length = int(
                    next(line.split(b":")[1] for line in lines if line.startswith(b"content-length"))
                )
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                buffer = buffer[length:]
                reply = self.replies(self.requests)
                self.requests += 1
                if callable(reply):
                    reply(conn)
                    return
                for piece in reply:
                    conn.sendall(piece)
                if not self.keep_alive:
                    return

    def close(self):
        self.sock.close()


def sse_body(text: str = "hi") -> bytes:
    return event({"content": text}) + event({}, finish="stop") + b"data: [DONE]\n\n"


def chunked(body: bytes, sizes=(5, 40, 1000), extension: bytes = b"") -> bytes:
    out, pos, cycle = [], 0, itertools.cycle(sizes)
    while pos < len(body):
        piece = body[pos : pos + next(cycle)]
        out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
        pos += len(piece)
    return b"".join(out) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"


def one_turn(url: str, timeout: float = 10.0, turns: int = 1) -> list:
    async def run():
        out = []
        async with open_session(2) as http:
            for _ in range(turns):
                try:
                    out.append(
                        await stream_chat(
                            http, url, chat_payload("m", [{"role": "user", "content": "x"}]), timeout
                        )
                    )
                except RequestError as e:
                    out.append(e)
        return out

    return client.run_sync(run())


@pytest.mark.parametrize(
    "reply",
    [
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(sse_body()),
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(sse_body(), (3,), b";ext=1"),
        HEAD
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunked(sse_body()).replace(b"0\r\n\r\n", b"0\r\nX-Trailer: 1\r\n\r\n"),
        HEAD + b"Content-Length: %d\r\n\r\n" % len(sse_body()) + sse_body(),
        b"HTTP/1.1 100 Continue\r\n\r\n"
        + HEAD
        + b"Content-Length: %d\r\n\r\n" % len(sse_body())
        + sse_body(),
        HEAD + b"Connection: close\r\n\r\n" + sse_body(),  # until the connection closes
    ],
    ids=["chunked", "extensions", "trailers", "length", "100-continue", "until-close"],
)
@pytest.mark.parametrize("split", [None, 1, 9])
def test_lean_path_reads_every_framing_whatever_the_segments(reply, split):
    pieces = [reply] if split is None else [reply[i : i + split] for i in range(0, len(reply), split)]
    server = RawServer(lambda n: pieces)
    try:
        (turn,) = one_turn(server.url)
    finally:
        server.close()
    assert isinstance(turn, StreamedTurn), turn
    assert (turn.content, turn.finish_reason, turn.done, turn.raw) == ("hi", "stop", True, sse_body())


def test_lean_path_keeps_connections_alive_and_replaces_closed_ones():
    body = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(sse_body())
    server = RawServer(lambda n: [body], keep_alive=True)
    try:
        turns = one_turn(server.url, turns=3)
        assert all(isinstance(t, StreamedTurn) for t in turns) and server.connections == 1
    finally:
        server.close()
    closing = HEAD + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(sse_body()) + sse_body()
    server = RawServer(lambda n: [closing], keep_alive=True)
    try:
        turns = one_turn(server.url, turns=3)
        assert all(isinstance(t, StreamedTurn) for t in turns) and server.connections == 3
    finally:
        server.close()


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        ([b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 9\r\n\r\nslow down"], "http_status"),
        ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(sse_body())[:-12]], "stream_cut"),  # cut
        ([HEAD + b"Content-Length: 999\r\n\r\n" + sse_body()], "stream_cut"),  # shorter than it said
        ([b"garbage\r\n\r\n"], "stream_cut"),  # not HTTP: like aiohttp, a closed stream from a live server
        ([HEAD + b"Content-Length: 4\r\n\r\ndata"], "incomplete_stream"),
        (
            [HEAD + b"Connection: close\r\n\r\n" + b'data: {"error": {"message": "aborted"}}\n\n'],
            "server_error",
        ),
        ([HEAD + b"Connection: close\r\n\r\n" + b"data: nope\n\n"], "protocol"),
        ([], "stream_cut"),  # the connection closes before any answer
    ],
    ids=["status", "chunk-cut", "short-length", "garbage", "no-done", "error-event", "not-json", "closed"],
)
def test_lean_path_failures_are_typed_as_before(reply, kind):
    server = RawServer(lambda n: reply if reply else (lambda conn: conn.shutdown(socket.SHUT_RDWR)))
    try:
        (error,) = one_turn(server.url)
    finally:
        server.close()
    assert isinstance(error, RequestError) and error.kind == kind, error
    if kind == "http_status":
        assert error.status == 429 and "slow down" in error.message


def test_lean_path_times_out_and_refuses_like_aiohttp(unused_port):
    server = RawServer(lambda n: [HEAD + b"Transfer-Encoding: chunked\r\n\r\n"], keep_alive=True)  # silence
    try:
        (error,) = one_turn(server.url, timeout=0.3)
    finally:
        server.close()
    assert isinstance(error, RequestError) and error.kind == "timeout"
    (error,) = one_turn(f"http://127.0.0.1:{unused_port}")
    assert isinstance(error, RequestError) and error.kind == "connection_refused"


def test_lean_path_holds_at_most_the_session_limit(scripted_server):
    in_flight, peak = 0, 0

    async def slow(body, request):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        return await sse_reply(request, call_events("search", '{"query": "x", "max_results": 5}'))

    server = scripted_server(slow)

    async def run():
        async with open_session(3) as http:
            payload = chat_payload("m", [{"role": "user", "content": "x"}])
            return await asyncio.gather(*(stream_chat(http, server.url, payload, 10.0) for _ in range(12)))

    turns = client.run_sync(run())
    assert len(turns) == 12 and all(t.tool_calls for t in turns) and peak == 3


def _read_response(pieces: list[bytes], close: bool = False) -> tuple[object, bool]:
    """What http1's response reader makes of `pieces`, one read each (then a clean close, if `close`):
    the turn or the exception it ended with, and whether the connection may carry the next request."""

    async def run():
        response = http1._Response(SSEParser(), asyncio.get_running_loop().create_future())
        for piece in filter(None, pieces):  # a transport never reads 0 bytes
            response.feed(piece)
        if close:
            response.lost(None)
        future = response.future
        outcome = (future.exception() or future.result()) if future.done() else None
        return outcome, response.ended_cleanly()

    return asyncio.run(run())


@pytest.mark.parametrize(
    "reply",
    [
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(sse_body(), (7, 1, 30), b";e=1"),
        b"HTTP/1.1 100 Continue\r\n\r\n"
        + HEAD
        + b"Content-Length: %d\r\n\r\n" % len(sse_body())
        + sse_body(),
    ],
    ids=["chunked", "100-then-length"],
)
def test_lean_reader_gives_the_same_turn_at_every_split(reply):
    for at in range(len(reply) + 1):
        turn, reusable = _read_response([reply[:at], reply[at:]])
        assert isinstance(turn, StreamedTurn) and reusable, (at, turn)
        assert (turn.content, turn.finish_reason, turn.done, turn.raw) == ("hi", "stop", True, sse_body())


@pytest.mark.parametrize(
    ("pieces", "close", "status"),
    [
        ([b"HTTP/1.1 2x0 OK\r\n\r\n"], False, None),  # a status that is no number
        ([b"HTTP/2 200 OK\r\n\r\n"], False, None),
        ([HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"], False, None),  # a chunk size that is none
        ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n"], False, None),  # no CRLF after a chunk
        ([HEAD + b"X: " + b"y" * 70000], False, None),  # a head without end
        ([HEAD + b"Content-Length: 3\r\n\r\nda"], True, None),  # shorter than it said
        ([b"HTTP/1.1 200"], True, None),  # closed within the head
        ([b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\nzz"], False, 101),
        ([b"HTTP/1.1 503 Busy\r\n", b"Content-Length: 20\r\n\r\n", b"try la"], False, 503),  # its start
    ],
    ids=["status-line", "version", "chunk-size", "chunk-end", "endless-head", "cut", "no-head", "101", "503"],
)
def test_lean_reader_failures_keep_their_kinds(pieces, close, status):
    """Malformed HTTP and cuts end as `_Cut` (then probed: stream_cut or server_gone), a status that is
    not 200 as http_status with the start of its body; the connection is not reused."""
    error, reusable = _read_response(pieces, close)
    if status is None:
        assert isinstance(error, http1._Cut), error
    else:
        assert isinstance(error, RequestError) and error.kind == "http_status" and error.status == status
        assert status != 503 or error.message == "HTTP 503: try la"
    assert not reusable


def test_lean_reader_reads_until_the_close_and_reuses_only_a_clean_end():
    until_close = HEAD + b"Connection: close\r\n\r\n" + sse_body()
    turn, reusable = _read_response([until_close], close=True)
    assert isinstance(turn, StreamedTurn) and turn.raw == sse_body() and not reusable
    length = HEAD + b"Content-Length: %d\r\n\r\n" % len(sse_body()) + sse_body()
    assert _read_response([length])[1]
    assert not _read_response([length + b"HTTP/1.1 200 OK\r\n"])[1]  # bytes after the end: out of step
    assert not _read_response([length, b"x"])[1]
    assert not _read_response([length.replace(b"OK\r\n", b"OK\r\nConnection: close\r\n")])[1]
    assert not _read_response([length.replace(b"HTTP/1.1", b"HTTP/1.0")])[1]


def test_sessions_not_from_open_session_and_https_use_aiohttp(sim_server):
    import aiohttp

    async def run():
        async with aiohttp.ClientSession() as http:
            return await stream_chat(
                http, sim_server.url, chat_payload("m", initial_messages(make_task(0, 0, 1)), TOOLS), 10.0
            )

    turn = asyncio.run(run())
    assert turn.tool_calls and turn.done
    assert http1.target("https://127.0.0.1:1/v1/chat/completions") is None
    assert http1.target("http://u:p@127.0.0.1:1/v1/chat/completions") is None
    assert http1.target("http://[::1]:8/x/v1/chat/completions?a=b")[2].startswith(
        b"POST /x/v1/chat/completions?a=b HTTP/1.1\r\nHost: [::1]:8\r\n"
    )


def test_closing_the_session_closes_the_lean_connections(sim_server):
    async def run():
        async with open_session(2) as http:
            await stream_chat(
                http, sim_server.url, chat_payload("m", initial_messages(make_task(0, 0, 1)), TOOLS), 10.0
            )
            pool = http.connector.streams
            assert len(pool.open) == 1
        await asyncio.sleep(0)
        return pool

    pool = client.run_sync(run())
    assert pool.closed and all(conn.lost for conn in pool.open) and not pool.idle


# --- the watchdog ends the sessions in flight ---------------------------------------------------------


def test_server_gone_watchdog_ends_sessions_in_flight_as_errored(start_sim, tmp_path):
    server = start_sim(time_scale=0.25)  # turns take a while: sessions are in flight when it fires
    polls = []

    def gone() -> str | None:
        polls.append(1)
        return "the decode server died" if len(polls) >= 2 else None

    settings = stress.StressSettings(
        url=server.url, out_dir=tmp_path / "run", sessions=20, rounds=6, concurrency=4, model="m",
        timeout_s=60.0, progress=False, watch_interval_s=0.2,
    )  # fmt: skip
    summary = stress.run_stress_sync(settings, server_gone=gone)
    outcomes = stress.read_outcomes(tmp_path / "run" / "sessions.jsonl")
    gone_ones = [o for o in outcomes if o.error and o.error.startswith("server_gone: the decode server died")]
    assert len(gone_ones) == 4  # the four in flight, ended at once
    assert summary.partial and summary.sessions == len(outcomes) < 20  # no new session started
