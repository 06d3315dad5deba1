"""The streaming chat client shared by the stress workload and the throughput bench.

One `aiohttp.ClientSession` per run (build it with `open_session(concurrency)`), one call of
`stream_chat` per assistant turn. `stream_chat` POSTs an OpenAI-compatible chat request with
`stream=True` and `stream_options.include_usage`, parses the SSE body incrementally as it arrives
(no buffering of the whole body before parsing, no tokenisation) and returns a `StreamedTurn`: the
content, the reasoning text, the tool calls assembled from their deltas, the finish reason, the
usage block, the raw body and the arrival time of every token-bearing event (for TTFT/ITL).

Transport failures are raised as `RequestError` with a `kind` (see `ERROR_KINDS`); they are never
returned as a turn, so a caller can keep "the server failed" (errored) apart from "the server said
something wrong" (the oracle's business). The rules that keep a dying server out of the corruption
counts:
- a non-200 status, a timeout, a refused/reset connection, a body cut off mid-transfer, or an error
  object inside the stream (SGLang's way of reporting an abort) raise `RequestError`;
- a connection closed or reset mid-request is `server_gone` only if the server no longer accepts a
  connection (probed once, right then); a server that is up and cut the stream (a one-request-at-a-time
  server given a second request, a proxy's idle timeout) is `stream_cut`;
- a body that ends without `[DONE]` and without any `finish_reason` raises `RequestError`
  ("incomplete_stream"): that is what a killed server looks like on the wire;
- a body that ends with `[DONE]` but no `finish_reason` is returned (`done=True`,
  `finish_reason=None`): the server closed the stream normally yet never finished the turn, which
  the oracle calls a truncated stream.

Protocol variants read as the same turn: tool calls streamed as `tool_calls` deltas (with or without
`index`, the name once, repeated, or in pieces) or as the legacy `function_call` delta (OpenAI's
pre-tools form, which llama-cpp-python streams beside `tool_calls`; used only when the stream carries no
`tool_calls`, so a server sending both is not read as two calls). A stream with no usage block leaves
`usage` None: the token counts are unknown, never estimated.

Lifecycle:
    async with open_session(concurrency=64) as session:
        turn = await stream_chat(session, "http://127.0.0.1:8000", payload, timeout=120.0)

The HTTP path. A session from `open_session` carries a lean HTTP/1.1 client of its own (`_Pool`, one
`asyncio.Protocol` per keep-alive connection) that `stream_chat` uses for plain `http://` URLs: the
response head, the chunked (or length- or close-delimited) body and the SSE events are parsed right in
`data_received`, and the waiting task wakes once per turn, not once per network read. That is where
aiohttp spent most of the client's CPU (a request object, a StreamReader, a future and a task step
for every read). It keeps aiohttp's semantics: the same error kinds for the same failures (a refused
connection, a connection that closes before the response ends, a timeout, a non-200 status with the
start of its body), keep-alive connections reused up to `keepalive_timeout`, at most `concurrency`
requests at once, no retry of a POST. Any other session, and https URLs, go through aiohttp as before.
`loop_factory()` gives uvloop's event loop where it is installed (the sync entry points use it;
library callers keep whatever loop they run).

Invalid UTF-8 inside the stream is kept (decoded with `surrogateescape`, so the bad bytes show up as
lone surrogates U+DC80..U+DCFF) instead of failing the parse: invalid bytes are evidence for the
oracle, not a transport error.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import gc
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import aiohttp
import yarl

from orchestrator.workload.results import StreamedToolCall, StreamedTurn

try:  # uvloop's event loop, for the sync entry points only (loop_factory)
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - exercised only where uvloop is missing
    _uvloop = None

try:  # orjson (a dependency of sglang-router) parses ~3x faster; plain json is the fallback
    import orjson

    _loads_bytes = orjson.loads

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - exercised only where orjson is missing

    def _loads_bytes(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


CHAT_PATH = "/v1/chat/completions"

#: The kinds of RequestError, i.e. the ways a turn can be `errored`.
ERROR_KINDS = (
    "http_status",  # the server answered with a non-200 status
    "timeout",  # no complete answer within the turn's timeout
    "connection_refused",  # nothing listening (server not up, or gone before the request)
    "server_gone",  # the connection closed or reset, and the server no longer accepts connections
    "stream_cut",  # the server closed or reset the stream, yet still accepts connections
    "incomplete_stream",  # the body ended without [DONE] and without a finish_reason
    "server_error",  # an error object inside the stream (e.g. an abort)
    "protocol",  # the body is not an SSE stream of JSON chunks
)


class RequestError(Exception):
    """A turn that failed at the transport or protocol level (never corruption)."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown RequestError kind {kind!r}")
        self.kind = kind
        self.status = status
        self.message = message
        super().__init__(f"{kind}: {message}")


#: set to 0 to run the sync entry points on asyncio's own loop even where uvloop is installed
UVLOOP_ENV = "HEISENHUNT_UVLOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the sync entry points run on: uvloop's where it is installed (and not turned off
    with HEISENHUNT_UVLOOP=0), else None (asyncio's default). For `asyncio.Runner(loop_factory=...)`;
    never installed as a global policy, so library callers keep the loop they chose."""
    if _uvloop is None or os.environ.get(UVLOOP_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return _uvloop.new_event_loop


#: the youngest generation's threshold while `run_sync` runs: a thousand sessions keep many containers
#: alive (conversations, turns), and at Python's default (700 net allocations) a young collection would
#: walk them every few turns; 5-7% of the client's CPU at 1,000 sessions (bench/README.md)
GC_YOUNG_THRESHOLD = 20_000


#: the signals `run_sync` turns into a cancellation of its main task (when a Python handler wants them)
INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt_handlers() -> dict[int, Callable[..., Any]]:
    """The interrupt signals whose current handler is Python code (the arm's teardown handler, or
    Python's own KeyboardInterrupt for SIGINT), by number. Signals left at the default or ignored are
    not touched: they keep doing what they did. Only the main thread may install signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {sig: signal.getsignal(sig) for sig in INTERRUPT_SIGNALS}
    return {int(sig): h for sig, h in handlers.items() if callable(h)}


def run_sync(coro: Any) -> Any:
    """`asyncio.run(coro)` on `loop_factory()`'s loop: a fresh loop, closed after. While it runs, the
    garbage collector's youngest threshold is raised to GC_YOUNG_THRESHOLD (where collection is on).

    Interrupts: a SIGINT or SIGTERM whose handler is Python code cancels the main task (so the coroutine
    writes what it has, as run_stress does), then that handler is called as the signal would have
    called it, so it raises KeyboardInterrupt as the caller expects. Why not let the handler raise in
    the loop: it raises in whatever code runs at that moment, and uvloop, unlike asyncio, turns an
    exception raised inside a protocol callback into that one connection's loss and carries on, so the
    interrupt ended a single session and the run went on."""
    thresholds = gc.get_threshold()
    if gc.isenabled() and 0 < thresholds[0] < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
    handlers = _interrupt_handlers()
    received: list[int] = []
    main: list[asyncio.Task] = []

    async def _main() -> Any:
        main.append(asyncio.current_task())  # type: ignore[arg-type]
        return await coro

    def _on_signal(signum: int) -> None:
        received.append(signum)
        if main:
            main[0].cancel()

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            loop = runner.get_loop()
            for signum in handlers:
                loop.add_signal_handler(signum, _on_signal, signum)
            try:
                result = runner.run(_main())
            except asyncio.CancelledError:
                if not received:
                    raise
            finally:
                for signum, handler in handlers.items():
                    loop.remove_signal_handler(signum)
                    signal.signal(signum, handler)
        if not received:
            return result
        handlers[received[0]](received[0], None)  # raises KeyboardInterrupt, as the signal would have
        raise KeyboardInterrupt(f"signal {received[0]}")  # a handler that returned: still interrupted
    finally:
        gc.set_threshold(*thresholds)


def open_session(concurrency: int, connect_timeout_s: float = 10.0) -> aiohttp.ClientSession:
    """One ClientSession for a whole run, its pool sized for `concurrency` streams at once."""
    keepalive_s = 60.0
    connector = _Connector(
        _Pool(max(1, concurrency), connect_timeout_s, keepalive_s),
        limit=max(1, concurrency),
        limit_per_host=max(1, concurrency),
        ttl_dns_cache=300,
        keepalive_timeout=keepalive_s,
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    # auto_decompress off: streams are not compressed, and raw bytes must be what the server sent
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector (for the aiohttp path) that carries the lean path's pool and closes it with
    itself, so `async with open_session(...)` closes every connection of both."""

    def __init__(self, streams: _Pool, **kwargs: Any):
        super().__init__(**kwargs)
        self.streams = streams

    def close(self, *args: Any, **kwargs: Any) -> Any:
        self.streams.close()
        return super().close(*args, **kwargs)


class SSEParser:
    """Incremental parser of an OpenAI chat-completion SSE body into a StreamedTurn.

    Feed it byte chunks as they arrive (`feed(chunk, now)`), then call `finish()`. Pure: no I/O, so
    it is tested on literal bytes. Each event is parsed once, as it completes; streamed text is
    gathered in lists and joined once in `finish` (so `turn.content` and the calls' `arguments` are
    complete only then). A chunk made of whole events (what servers send) takes a short path: split at
    the blank lines, one JSON parse per event; anything else is read line by line, with the same result.
    An event that only adds text (content, reasoning, or a call's arguments) becomes a template once a
    probe proves it (`_learn`): the events after it that differ from it only in that string are read by
    parsing the string alone (tests/workload/test_fast_paths.py, test_oracle_equivalence.py).
    """

    def __init__(self, turn: StreamedTurn | None = None):
        self.turn = turn if turn is not None else StreamedTurn()
        self._buffer = b""
        self._data: list[bytes] = []  # data lines of the event being read
        self._raw: list[bytes] = []
        self._content: list[str] = [self.turn.content] if self.turn.content else []
        self._reasoning: list[str] = [self.turn.reasoning] if self.turn.reasoning else []
        self._calls: dict[int, StreamedToolCall] = {}
        self._arguments: dict[int, list[str]] = {}  # argument pieces per call index
        self._legacy: StreamedToolCall | None = None  # from `function_call` deltas
        self._legacy_arguments: list[str] = []
        # (bytes before the string, bytes after it, where its text goes, the call or None, its name)
        self._template: tuple[bytes, bytes, list[str], StreamedToolCall | None, Any] | None = None
        self._learns = 0  # templates tried this turn (see _learn)

    def feed(self, chunk: bytes, now: float) -> None:
        self._raw.append(chunk)
        if self._buffer or self._data or b"\r" in chunk:
            pass  # a partial line or event pending, or CR line ends: line by line
        elif chunk.find(b"\n") == len(chunk) - 2 and chunk[-1:] == b"\n" and chunk[:6] == b"data: ":
            self._event_data(chunk[6:-2], now)  # the most common chunk: one event of one data line
            return
        elif chunk[-2:] == b"\n\n":
            # whole events: each block between blank lines is one event, usually a single data line
            for block in chunk[:-2].split(b"\n\n"):
                if block[:6] == b"data: " and b"\n" not in block:
                    self._event_data(block[6:], now)
                else:
                    for line in block.split(b"\n"):
                        self._line(line, now)
                    self._dispatch(now)
            return
        if self._buffer:
            chunk = self._buffer + chunk
        lines = chunk.split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            self._line(line, now)

    def _feed_slice(self, data: bytes, start: int, end: int, now: float) -> None:
        """`feed(data[start:end], now)`, reading the most common piece in place: one event of one data
        line (`data: X` LF LF) that the template covers (see `_event_data`), sliced once for the raw
        body and once for its string."""
        template = self._template
        if (
            template is not None
            and not self._buffer
            and not self._data
            and data.startswith(b"data: ", start)
            and data.find(b"\n", start, end) == end - 2
            and data[end - 1] == 10
            and data[end - 3] != 13  # a CR before the LFs is a line end (general path)
        ):
            prefix, suffix, sink, call, name = template
            first, last = start + 6 + len(prefix), end - 2 - len(suffix)
            if (
                first < last
                and data.startswith(prefix, start + 6)
                and data.endswith(suffix, first, end - 2)
                and (call is None or not name or name == call.name)
            ):
                try:
                    text = _loads_bytes(data[first:last])
                except ValueError:
                    text = None
                if type(text) is str:
                    self._raw.append(data[start:end])
                    if text:
                        sink.append(text)
                        self.turn.chunk_times.append(now)
                    elif call is not None:  # a tool_calls delta carries, even with no new text
                        self.turn.chunk_times.append(now)
                    return
        self.feed(data[start:end], now)

    def finish(self, now: float) -> StreamedTurn:
        """End of body: dispatch what is pending and return the turn."""
        if self._buffer:  # the last line, without a newline, ends here
            self._line(self._buffer, now)
            self._buffer = b""
        self._dispatch(now)
        turn = self.turn
        turn.raw = b"".join(self._raw)
        turn.content = "".join(self._content)
        turn.reasoning = "".join(self._reasoning)
        for index, pieces in self._arguments.items():
            self._calls[index].arguments = "".join(pieces)
        turn.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        if not turn.tool_calls and self._legacy is not None:
            self._legacy.arguments = "".join(self._legacy_arguments)
            turn.tool_calls = [self._legacy]
        turn.ended = now
        return turn

    def _line(self, line: bytes, now: float) -> None:
        if line[-1:] == b"\r":
            line = line[:-1]
        if not line:
            self._dispatch(now)
        elif line[:5] == b"data:":
            self._data.append(line[6:] if line[5:6] == b" " else line[5:])
        # other SSE fields (event:, id:, retry:) and comments (":...") carry nothing we use

    def _dispatch(self, now: float) -> None:
        data = self._data
        if data:
            payload = data[0] if len(data) == 1 else b"\n".join(data)
            data.clear()
            self._event_data(payload, now)

    def _event_data(self, payload: bytes, now: float) -> None:
        """One event's data: [DONE], or a JSON chunk read into the turn."""
        template = self._template
        if template is not None:
            # the same event layout around another string (see _learn): only the string is parsed
            prefix, suffix, sink, call, name = template
            if (
                payload.startswith(prefix)
                and payload.endswith(suffix)
                and len(payload) > len(prefix) + len(suffix)
                and (call is None or not name or name == call.name)
            ):
                try:
                    text = _loads_bytes(payload[len(prefix) : len(payload) - len(suffix)])
                except ValueError:
                    text = None
                if type(text) is str:
                    if text:
                        sink.append(text)
                        self.turn.chunk_times.append(now)
                    elif call is not None:  # a tool_calls delta carries, even with no new text
                        self.turn.chunk_times.append(now)
                    return
        if b"[DONE]" in payload and payload.strip() == b"[DONE]":
            self.turn.done = True
            return
        try:
            event = _loads_bytes(payload)
        except ValueError:
            try:  # invalid UTF-8 is evidence for the oracle: keep the bad bytes as lone surrogates
                event = json.loads(payload.decode("utf-8", "surrogateescape"))
            except ValueError as e:
                raise RequestError("protocol", f"SSE data is not JSON: {payload[:200]!r}") from e
        if not isinstance(event, dict):
            raise RequestError("protocol", f"SSE data is not a JSON object: {payload[:200]!r}")
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            raise RequestError("server_error", f"error in stream: {str(error)[:300]}")
        turn = self.turn
        usage = event.get("usage")
        if usage:
            turn.usage = dict(usage)
        choices = event.get("choices")
        if not choices:
            return
        for choice in choices:
            if choice.get("index", 0) != 0:
                continue  # n > 1 is not used; only the first choice is a turn
            delta = choice.get("delta")
            if delta:
                carried = False
                content = delta.get("content")
                if content:
                    if type(content) is not str:
                        _check_text(content)
                    self._content.append(content)
                    carried = True
                reasoning = delta.get("reasoning_content")
                if reasoning:
                    if type(reasoning) is not str:
                        _check_text(reasoning)
                    self._reasoning.append(reasoning)
                    carried = True
                tool_calls = delta.get("tool_calls")
                if tool_calls:
                    calls = self._calls
                    for tc in tool_calls:
                        index = tc.get("index")
                        call = calls.get(index) if type(index) is int else None
                        function = tc.get("function")
                        if call is None or tc.get("id") or not function or type(function) is not dict:
                            self._tool_delta(tc)  # a new call, an id, no index: the careful path
                            continue
                        # the common delta: more of a known call's arguments (and maybe its name again)
                        name = function.get("name")
                        if name and name != call.name:
                            call.name += name
                        arguments = function.get("arguments")
                        if arguments:
                            if type(arguments) is not str:
                                _check_text(arguments)
                            self._arguments[index].append(arguments)
                    carried = True
                legacy = delta.get("function_call")
                if legacy:
                    if self._legacy is None:
                        self._legacy = StreamedToolCall(index=0)
                    _extend_call(self._legacy, self._legacy_arguments, legacy)
                    carried = True
                if carried:
                    turn.chunk_times.append(now)
            finish = choice.get("finish_reason")
            if finish:
                turn.finish_reason = finish
        if self._learns < _MAX_LEARNS:
            self._learn(payload, event)

    def _learn(self, payload: bytes, event: dict[str, Any]) -> None:
        """If `event` only adds text to the turn (content, reasoning, or a known call's arguments),
        keep its bytes around that string as a template: a later event that is the same bytes around
        another JSON string is then the same event with that text (JSON is read token by token: a
        string literal in the same place changes that value only), read with one small parse instead
        of a whole one. A probe parse proves the template: the bytes with a sentinel string in the place
        found must parse to this very event with the sentinel as that value. At most _MAX_LEARNS
        templates per turn (a server whose events all differ costs a few probes, no more)."""
        choices = event.get("choices")
        if event.get("usage") or type(choices) is not list or len(choices) != 1:
            return
        choice = choices[0]
        if type(choice) is not dict or choice.get("index", 0) != 0 or choice.get("finish_reason"):
            return
        delta = choice.get("delta")
        if type(delta) is not dict or delta.get("function_call"):
            return
        content, reasoning, calls = (
            delta.get("content"),
            delta.get("reasoning_content"),
            delta.get("tool_calls"),
        )
        call = None
        if calls and not content and not reasoning:
            if type(calls) is not list or len(calls) != 1 or type(calls[0]) is not dict or calls[0].get("id"):
                return
            index, holder = calls[0].get("index"), calls[0].get("function")
            if type(index) is not int or index not in self._calls or type(holder) is not dict:
                return
            key, field, sink, call = b'"arguments"', "arguments", self._arguments[index], self._calls[index]
        elif content and not reasoning and not calls:
            key, field, holder, sink = b'"content"', "content", delta, self._content
        elif reasoning and not content and not calls:
            key, field, holder, sink = b'"reasoning_content"', "reasoning_content", delta, self._reasoning
        else:
            return
        value = holder.get(field)
        span = _string_span(payload, key) if type(value) is str and value != _PROBE else None
        if span is None:
            return
        self._learns += 1
        prefix, suffix = payload[: span[0]], payload[span[1] :]
        try:
            probe = _loads_bytes(prefix + _PROBE_JSON + suffix)
        except ValueError:
            return
        holder[field] = _PROBE  # the event as the probe must read (it was already applied)
        if probe == event:
            self._template = (prefix, suffix, sink, call, holder.get("name") if call else None)

    def _tool_delta(self, tc: Mapping[str, Any]) -> None:
        index = tc.get("index")
        if not isinstance(index, int):
            index = self._index_without_index(tc.get("id"))
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = StreamedToolCall(index=index)
            self._arguments[index] = []
        call_id = tc.get("id")
        if call_id:
            call.id = call_id
        function = tc.get("function")
        if function:
            name = function.get("name")
            # servers differ: the whole name once, the whole name repeated in every delta, or pieces
            if name and name != call.name:
                call.name += name
            arguments = function.get("arguments")
            if arguments:
                if type(arguments) is not str:
                    _check_text(arguments)
                self._arguments[index].append(arguments)

    def _index_without_index(self, call_id: str | None) -> int:
        """Some servers omit the index: a known id continues its call, a new id starts one, no id
        continues the last call."""
        for call in self._calls.values():
            if call_id and call.id == call_id:
                return call.index
        if call_id or not self._calls:
            return max(self._calls, default=-1) + 1
        return max(self._calls)


_MAX_LEARNS = 4
_PROBE = "heisenhunt template probe"
_PROBE_JSON = b'"heisenhunt template probe"'
_JSON_SPACE = b" \t\r\n"


def _string_span(payload: bytes, key: bytes) -> tuple[int, int] | None:
    """(start, end) of the JSON string literal that is the value of `key` (a quoted name) in
    `payload`, where the key occurs exactly once; None otherwise."""
    at = payload.find(key)
    if at < 0 or payload.find(key, at + 1) >= 0:
        return None
    i, n = at + len(key), len(payload)
    while i < n and payload[i] in _JSON_SPACE:
        i += 1
    if payload[i : i + 1] != b":":
        return None
    i += 1
    while i < n and payload[i] in _JSON_SPACE:
        i += 1
    if payload[i : i + 1] != b'"':
        return None
    end = i + 1
    while True:  # the closing quote: the first one not escaped by an odd run of backslashes
        end = payload.find(b'"', end)
        if end < 0:
            return None
        slashes = 0
        while payload[end - 1 - slashes] == 0x5C:
            slashes += 1
        if slashes % 2 == 0:
            return i, end + 1
        end += 1


def _check_text(text: Any) -> None:
    """Streamed text is gathered and joined once: a piece that is not a string fails here, as adding
    it to the text did before (TypeError)."""
    if not isinstance(text, str):
        raise TypeError(f"can only concatenate str (not {type(text).__name__!r}) to str")


def _extend_call(call: StreamedToolCall, arguments_parts: list[str], function: Mapping[str, Any]) -> None:
    """Add one delta of a call (`function` of a tool_calls delta, or a legacy function_call)."""
    name = function.get("name")
    # servers differ: the whole name once, the whole name repeated in every delta, or name pieces
    if name and name != call.name:
        call.name += name
    arguments = function.get("arguments")
    if arguments:
        if type(arguments) is not str:
            _check_text(arguments)
        arguments_parts.append(arguments)


def chat_payload(
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    max_tokens: int = 1024,
    temperature: float = 0.0,
    tool_choice: Any = "auto",
    **extra: Any,
) -> dict[str, Any]:
    """A streaming chat request body with usage in the stream (`tool_choice` is sent with tools)."""
    payload: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": temperature,
    }
    if tools:
        payload["tools"] = tools
        payload["tool_choice"] = tool_choice
    payload.update(extra)
    return payload


async def stream_chat(
    session: aiohttp.ClientSession, url: str, payload: Mapping[str, Any], timeout: float
) -> StreamedTurn:
    """POST `payload` to `url` + /v1/chat/completions (stream forced on) and parse the SSE reply.

    `url` is the server's base URL (a full .../v1/chat/completions URL is accepted too). `timeout`
    bounds the whole turn, first byte to last. Raises RequestError on any transport failure.
    """
    body = dict(payload)
    body["stream"] = True
    body.setdefault("stream_options", {"include_usage": True})
    return await stream_body(session, url, _dumps(body), timeout)


async def stream_body(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> StreamedTurn:
    """`stream_chat` for a request already serialised to JSON bytes (a streaming chat request: `stream`
    and `stream_options` set, as `chat_payload` gives them); the stress workload builds its growing
    conversations' bodies incrementally and sends them through here."""
    endpoint = _endpoint(url)
    pool = getattr(session.connector, "streams", None)
    target = _target(endpoint) if isinstance(pool, _Pool) and not session.closed else None
    if target is None:
        return await _stream_aiohttp(session, endpoint, body, timeout)
    return await _stream_lean(pool, endpoint, target, body, timeout)


@lru_cache(maxsize=256)
def _endpoint(url: str) -> str:
    return url if url.rstrip("/").endswith(CHAT_PATH) else url.rstrip("/") + CHAT_PATH


async def _stream_aiohttp(
    session: aiohttp.ClientSession, endpoint: str, data: bytes, timeout: float
) -> StreamedTurn:
    """The turn through aiohttp: for sessions not made by `open_session`, and for https."""
    started = time.monotonic()
    parser = SSEParser(StreamedTurn(started=started))
    try:
        async with asyncio.timeout(timeout):
            async with session.post(
                endpoint,
                data=data,
                headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
            ) as resp:
                if resp.status != 200:
                    text = (await resp.content.read(2000)).decode("utf-8", "replace")
                    raise RequestError(
                        "http_status", f"HTTP {resp.status}: {text.strip()[:300]}", resp.status
                    )
                async for chunk in resp.content.iter_any():
                    parser.feed(chunk, time.monotonic())
                turn = parser.finish(time.monotonic())
    except RequestError:
        raise
    except TimeoutError as e:
        raise RequestError("timeout", f"no complete answer within {timeout:g}s") from e
    except aiohttp.ClientConnectorError as e:
        kind = "connection_refused" if _errno(e) == errno.ECONNREFUSED else "server_gone"
        raise RequestError(kind, str(e)) from e
    except aiohttp.ServerDisconnectedError as e:
        raise await _closed(endpoint, f"server disconnected: {e}") from e
    except aiohttp.ClientPayloadError as e:
        raise await _closed(endpoint, f"response body cut off: {e}") from e
    except (ConnectionResetError, BrokenPipeError, aiohttp.ClientOSError) as e:
        raise await _closed(endpoint, f"{type(e).__name__}: {e}") from e
    except aiohttp.ClientError as e:
        raise await _closed(endpoint, f"{type(e).__name__}: {e}") from e
    return _complete(turn)


def _complete(turn: StreamedTurn) -> StreamedTurn:
    if not turn.done and turn.finish_reason is None:
        raise RequestError("incomplete_stream", f"body ended after {len(turn.raw)} bytes without [DONE]")
    return turn


# --- the lean HTTP/1.1 path ------------------------------------------------------------------------


class _Cut(Exception):
    """The connection closed (or the response could not be read as HTTP) before the response ended:
    `stream_chat` probes the server to tell `stream_cut` from `server_gone`."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@lru_cache(maxsize=256)
def _target(endpoint: str) -> tuple[str, int, bytes] | None:
    """(host, port, the request head up to the Content-Length value) for a plain http URL; None for
    any other (https, credentials in the URL: aiohttp's business)."""
    url = yarl.URL(endpoint)
    if url.scheme != "http" or not url.raw_host or url.user is not None or url.password is not None:
        return None
    host, port = url.raw_host, url.port or 80
    netloc = f"[{host}]" if ":" in host else host
    if port != 80:
        netloc += f":{port}"
    target = url.raw_path + (f"?{url.raw_query_string}" if url.raw_query_string else "")
    head = (
        f"POST {target} HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nUser-Agent: heisenhunt\r\nContent-Length: "
    )
    return host, port, head.encode("ascii")


async def _stream_lean(
    pool: _Pool, endpoint: str, target: tuple[str, int, bytes], data: bytes, timeout: float
) -> StreamedTurn:
    host, port, head = target
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout  # the whole turn: waiting for a slot, connecting, the response
    parser = SSEParser(StreamedTurn(started=time.monotonic()))
    conn: _Connection | None = None
    slot = False
    try:
        if not pool.take_slot():
            async with asyncio.timeout_at(deadline):
                await pool.wait_slot()
        slot = True
        conn = pool.idle_connection(host, port)
        if conn is None:
            async with asyncio.timeout_at(deadline):
                conn = await pool.new_connection(host, port)
        turn = await conn.request(b"%s%d\r\n\r\n%s" % (head, len(data), data), parser, deadline)
    except RequestError:
        raise
    except TimeoutError as e:
        raise RequestError("timeout", f"no complete answer within {timeout:g}s") from e
    except _Cut as e:
        raise await _closed(endpoint, e.message) from None
    except OSError as e:  # connecting failed (the request itself reports through _Cut)
        kind = "connection_refused" if _errno(e) == errno.ECONNREFUSED else "server_gone"
        raise RequestError(kind, f"Cannot connect to host {host}:{port} [{e}]") from e
    finally:
        if conn is not None:
            pool.release(conn)
        if slot:
            pool.give_slot()
    return _complete(turn)


class _Pool:
    """The keep-alive HTTP/1.1 connections of one `open_session`, per (host, port); at most `limit`
    requests at once (further ones wait in order, as aiohttp's connector limit makes them)."""

    def __init__(self, limit: int, connect_timeout_s: float, keepalive_s: float):
        self.limit = limit
        self.active = 0  # requests holding a slot
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[str, int], list[_Connection]] = {}
        self.open: set[_Connection] = set()
        self.closed = False

    def take_slot(self) -> bool:
        """A slot at once if one is free (and nobody waits for one)."""
        if self.active < self.limit and not self.waiting:
            self.active += 1
            return True
        return False

    async def wait_slot(self) -> None:
        """Wait for a slot in order; a slot handed over to a waiter that is cancelled goes on."""
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.give_slot()  # handed over just as we were cancelled
            raise

    def give_slot(self) -> None:
        while self.waiting:  # hand it over to the first waiter still waiting
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def idle_connection(self, host: str, port: int) -> _Connection | None:
        """An idle connection to (host, port) that is still open and not idle too long, if any."""
        idle = self.idle.get((host, port))
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if not conn.lost and now - conn.idle_since < self.keepalive_s:
                    return conn
                conn.close()
        return None

    async def new_connection(self, host: str, port: int) -> _Connection:
        if self.closed:
            raise RuntimeError("Session is closed")
        async with asyncio.timeout(self.connect_timeout_s):
            conn = await _connect(host, port)
        conn.key, conn.pool = (host, port), self
        self.open.add(conn)
        return conn

    def release(self, conn: _Connection) -> None:
        """Back to the idle list if its response ended cleanly and it may be reused; else closed."""
        response = conn.response
        conn.response = None
        if response is not None and response.ended_cleanly() and not conn.lost and not self.closed:
            conn.idle_since = time.monotonic()
            self.idle.setdefault(conn.key, []).append(conn)
            return
        if response is not None:
            response.abandon()
        conn.close()

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)

    def close(self) -> None:
        self.closed = True
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


async def _connect(host: str, port: int) -> _Connection:
    """A TCP connection to the first address of (host, port) that accepts (TCP_NODELAY on)."""
    loop = asyncio.get_running_loop()
    try:
        _literal_family(host)
    except ValueError:
        found = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        infos = [(family, address) for family, _, _, _, address in found]
    else:  # one address: the loop connects it (TCP_NODELAY on, as asyncio and uvloop set it for TCP)
        _, conn = await loop.create_connection(_Connection, host, port)
        return conn
    errors: list[OSError] = []
    for family, address in infos:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except OSError as e:
            sock.close()
            errors.append(e)
            continue
        except BaseException:
            sock.close()
            raise
        _, conn = await loop.create_connection(_Connection, sock=sock)
        return conn
    if len(errors) == 1:
        raise errors[0]
    numbers = {e.errno for e in errors}
    raise OSError(numbers.pop() if len(numbers) == 1 else None, f"Multiple exceptions: {errors}")


def _literal_family(host: str) -> int:
    """The address family of an IP literal; ValueError for a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    raise ValueError(host)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; the response being read gets every byte as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.response: _Response | None = None
        self.lost = False
        self.idle_since = 0.0
        self.key: tuple[str, int] = ("", 0)
        self.pool: _Pool | None = None

    async def request(self, data: bytes, parser: SSEParser, deadline: float) -> StreamedTurn:
        """Send one request and wait for its turn, at most until `deadline` (loop time): then the
        turn fails with TimeoutError (one timer per turn, no cancellation scope)."""
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        self.response = response = _Response(parser, loop.create_future())
        timer = loop.call_at(deadline, response.expire)
        try:
            self.transport.write(data)
            return await response.future
        finally:
            timer.cancel()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # bytes on an idle connection: not a response to anything; never reuse it
            self.close()
            return
        if response.state == _CHUNK_SIZE and response.status == 200 and not response.buffer:
            # the common reads, inline: whole chunks of the streamed body (size CRLF data CRLF), each
            # usually one SSE event, fed to the parser one by one; anything else (a chunk cut by the
            # read, the last chunk, extensions, garbage) goes on through the general path
            parser, now = response.parser, time.monotonic()
            pos, size = 0, len(data)
            try:
                while True:
                    eol = data.find(b"\r\n", pos, pos + 18)
                    if eol <= pos:
                        break
                    try:
                        length = int(data[pos:eol], 16)
                    except ValueError:
                        break
                    end = eol + 2 + length
                    if length <= 0 or end + 2 > size or not data.startswith(b"\r\n", end):
                        break
                    parser._feed_slice(data, eol + 2, end, now)
                    pos = end + 2
                    if pos == size:
                        return
            except Exception as e:  # a malformed event: the caller gets it
                response._fail(e)
                return
            if pos:
                data = data[pos:]
        response.feed(data)

    def eof_received(self) -> bool:
        self.lost = True
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.pool is not None:
            self.pool.forget(self)
        if self.response is not None:
            self.response.lost(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


# response states
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)
_MAX_HEAD = 65536


class _Response:
    """One HTTP/1.1 response read incrementally: the head, then the body (chunked, Content-Length or
    until the connection closes), each de-framed piece fed to the SSE parser with its arrival time.
    Its future gets the turn, or the exception the turn ended with."""

    __slots__ = ("buffer", "future", "left", "parser", "reusable", "state", "status")

    def __init__(self, parser: SSEParser, future: asyncio.Future[StreamedTurn]):
        self.parser = parser
        self.future = future
        self.state = _HEAD
        self.buffer = b""
        self.status = 0
        self.left = 0  # bytes left in the current chunk, or in a Content-Length body
        self.reusable = False

    def feed(self, data: bytes) -> None:
        if self.state == _DONE:
            self.reusable = False  # bytes after the end: the connection is out of step
            return
        now = time.monotonic()
        try:
            if self.state == _HEAD:
                data = self._head(data)
                if not data and self.state != _DONE:
                    return
            if self.state == _CHUNK_DATA and len(data) < self.left:  # the middle of a chunk
                self.left -= len(data)
                body = data
            elif self.state < _LENGTH:
                body = self._chunked(data)
            elif self.state == _LENGTH:
                body = data[: self.left]
                self.left -= len(body)
                if self.left == 0:
                    self.state = _DONE
                    self.reusable = self.reusable and len(data) == len(body)
            elif self.state == _UNTIL_CLOSE:
                body = data
            else:
                body = b""
            if body:
                self._body(body, now)
            if self.state == _DONE and not self.future.done():
                self._end(now)
        except Exception as e:  # RequestError, _Cut, or a malformed event: the caller gets it, as before
            self._fail(e)

    def _head(self, data: bytes) -> bytes:
        """Read the status line and headers (skipping 1xx interim responses); the rest is body."""
        buffer = self.buffer + data if self.buffer else data
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    raise _Cut(f"malformed HTTP response: no end of the head in {len(buffer)} bytes")
                self.buffer = buffer
                return b""
            head, buffer = buffer[:end].decode("latin-1"), buffer[end + 4 :]
            lines = head.split("\r\n")
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise _Cut(f"malformed HTTP response: status line {lines[0][:100]!r}")
            status = int(code)
            if 100 <= status < 200 and status != 101:
                continue  # 100 Continue, 103 Early Hints: the real response follows
            break
        self.buffer = b""
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.status = status
        connection = headers.get("connection", "").lower()
        self.reusable = version == "HTTP/1.1" and "close" not in connection
        if status in (204, 304):
            self.state = _DONE
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNK_SIZE
        elif "content-length" in headers:
            try:
                self.left = int(headers["content-length"])
            except ValueError:
                raise _Cut(f"malformed HTTP response: Content-Length {headers['content-length']!r}") from None
            self.state = _LENGTH if self.left > 0 else _DONE
        else:
            self.state = _UNTIL_CLOSE
            self.reusable = False
        if status != 200 and self.state == _DONE:
            self._http_error(b"")
        return buffer

    def _chunked(self, data: bytes) -> bytes:
        """De-frame chunked transfer encoding; the payload bytes in `data`."""
        if self.buffer:
            data, self.buffer = self.buffer + data, b""
        out: list[bytes] = []
        pos, size, state = 0, len(data), self.state
        while pos < size:
            if state == _CHUNK_DATA:
                take = self.left
                if size - pos <= take:
                    out.append(data[pos:] if pos else data)
                    self.left = take - (size - pos)
                    pos = size
                    if self.left == 0:
                        state = _CHUNK_END
                    break
                out.append(data[pos : pos + take])
                pos += take
                self.left = 0
                state = _CHUNK_END
            elif state == _CHUNK_END:
                if size - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise _Cut("malformed chunked body: no CRLF after a chunk")
                pos += 2
                state = _CHUNK_SIZE
            else:  # _CHUNK_SIZE or _TRAILER: a line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > _MAX_HEAD:
                        raise _Cut("malformed chunked body: a chunk-size line without end")
                    break
                if state == _TRAILER:  # trailer fields, up to an empty line
                    empty = eol == pos
                    pos = eol + 2
                    if empty:
                        state = _DONE
                        break
                    continue
                line = data[pos:eol]
                semicolon = line.find(b";")
                try:
                    length = int(line if semicolon < 0 else line[:semicolon], 16)
                except ValueError:
                    raise _Cut(f"malformed chunked body: chunk size {line[:40]!r}") from None
                pos = eol + 2
                if length:
                    self.left = length
                    state = _CHUNK_DATA
                else:
                    state = _TRAILER
        self.state = state
        if pos < size:
            if state == _DONE:
                self.reusable = False  # bytes after the end of the response
            else:
                self.buffer = data[pos:]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def _body(self, body: bytes, now: float) -> None:
        if self.status == 200:
            self.parser.feed(body, now)
        else:
            self._http_error(body)

    def _http_error(self, body: bytes) -> None:
        """A non-200 answer: the status and the start of its body, as soon as some of it is here."""
        text = body[:2000].decode("utf-8", "replace")
        self.reusable = False
        self.state = _DONE
        self._fail(RequestError("http_status", f"HTTP {self.status}: {text.strip()[:300]}", self.status))

    def _end(self, now: float) -> None:
        self.future.set_result(self.parser.finish(now))

    def _fail(self, error: BaseException) -> None:
        self.state = _DONE
        self.reusable = False
        if not self.future.done():
            self.future.set_exception(error)

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of a body read until close, otherwise a cut."""
        self.reusable = False
        if self.future.done():
            return
        if self.state == _HEAD:
            message = "server disconnected before the response head"
        elif self.status != 200:
            self._http_error(b"")
            return
        elif self.state == _UNTIL_CLOSE and exc is None:
            self.state = _DONE
            try:
                self._end(time.monotonic())
            except Exception as e:
                self._fail(e)
            return
        else:
            message = "response body cut off: the connection closed before the response ended"
        if exc is not None:
            message += f" ({type(exc).__name__}: {exc})"
        self._fail(_Cut(message))

    def expire(self) -> None:
        """The turn's deadline passed before the response ended."""
        if not self.future.done():
            self._fail(TimeoutError())

    def ended_cleanly(self) -> bool:
        """The whole response was read, it ended the turn without an error, and the connection may
        carry the next request."""
        future = self.future
        return (
            self.reusable
            and self.state == _DONE
            and future.done()
            and not future.cancelled()
            and future.exception() is None
        )

    def abandon(self) -> None:
        """The caller stopped waiting (a timeout, a cancellation, an error): nothing more is reported,
        and an exception already set counts as retrieved."""
        self.state = _DONE
        self.reusable = False
        future = self.future
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()


#: how long the probe after a closed stream waits for the server's answer
PROBE_TIMEOUT_S = 5.0


async def _closed(endpoint: str, message: str) -> RequestError:
    """A connection that closed mid-request: `stream_cut` if the server still answers HTTP, else
    `server_gone`. An answer is needed, not just a connection: the kernel completes a TCP handshake on
    a listening socket by itself, so a dying server's port still accepts for a moment."""
    if await _answers_http(yarl.URL(endpoint)):
        return RequestError("stream_cut", f"{message}; the server is still up (it cut the stream)")
    return RequestError("server_gone", f"{message}; the server no longer answers")


async def _answers_http(url: yarl.URL) -> bool:
    """Whether `url`'s server sends an HTTP status line (any status) to a GET within PROBE_TIMEOUT_S."""
    writer = None
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(url.host, url.port)
            writer.write(f"GET / HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n\r\n".encode())
            return (await reader.readline()).startswith(b"HTTP/")
    except (OSError, TimeoutError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _errno(error: BaseException) -> int | None:
    """The OS errno behind an aiohttp connection error, looking through its causes."""
    seen: BaseException | None = error
    for _ in range(5):
        if seen is None:
            return None
        number = getattr(seen, "errno", None) or getattr(getattr(seen, "os_error", None), "errno", None)
        if number:
            return number
        seen = seen.__cause__ or seen.__context__
    return None
