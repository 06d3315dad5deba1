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

Invalid UTF-8 inside the stream is kept (decoded with `surrogateescape`, so the bad bytes show up as
lone surrogates U+DC80..U+DCFF) instead of failing the parse: invalid bytes are evidence for the
oracle, not a transport error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import yarl

from orchestrator.results import StreamedToolCall, StreamedTurn

try:  # orjson (a dependency of sglang-router) parses ~3x faster; plain json is the fallback
    import orjson

    def _loads_bytes(data: bytes) -> Any:
        return orjson.loads(data)

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


def open_session(concurrency: int, connect_timeout_s: float = 10.0) -> aiohttp.ClientSession:
    """One ClientSession for a whole run, its pool sized for `concurrency` streams at once."""
    connector = aiohttp.TCPConnector(
        limit=max(1, concurrency),
        limit_per_host=max(1, concurrency),
        ttl_dns_cache=300,
        keepalive_timeout=60.0,
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    # auto_decompress off: streams are not compressed, and raw bytes must be what the server sent
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


class SSEParser:
    """Incremental parser of an OpenAI chat-completion SSE body into a StreamedTurn.

    Feed it byte chunks as they arrive (`feed(chunk, now)`), then call `finish()`. Pure: no I/O, so
    it is tested on literal bytes.
    """

    def __init__(self, turn: StreamedTurn | None = None):
        self.turn = turn if turn is not None else StreamedTurn()
        self._buffer = b""
        self._data: list[bytes] = []  # data lines of the event being read
        self._raw: list[bytes] = []
        self._calls: dict[int, StreamedToolCall] = {}
        self._legacy: StreamedToolCall | None = None  # from `function_call` deltas

    def feed(self, chunk: bytes, now: float) -> None:
        self._raw.append(chunk)
        lines = (self._buffer + chunk).split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            self._line(line, now)

    def finish(self, now: float) -> StreamedTurn:
        """End of body: dispatch what is pending and return the turn."""
        if self._buffer:
            self._line(self._buffer, now)
            self._buffer = b""
        self._dispatch(now)
        turn = self.turn
        turn.raw = b"".join(self._raw)
        turn.tool_calls = [self._calls[i] for i in sorted(self._calls)]
        if not turn.tool_calls and self._legacy is not None:
            turn.tool_calls = [self._legacy]
        turn.ended = now
        return turn

    def _line(self, line: bytes, now: float) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line:
            self._dispatch(now)
        elif line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        # other SSE fields (event:, id:, retry:) and comments (":...") carry nothing we use

    def _dispatch(self, now: float) -> None:
        if not self._data:
            return
        data = b"\n".join(self._data)
        self._data = []
        if data.strip() == b"[DONE]":
            self.turn.done = True
            return
        try:
            event = _loads_bytes(data)
        except ValueError:
            try:  # invalid UTF-8 is evidence for the oracle: keep the bad bytes as lone surrogates
                event = json.loads(data.decode("utf-8", "surrogateescape"))
            except ValueError as e:
                raise RequestError("protocol", f"SSE data is not JSON: {data[:200]!r}") from e
        if not isinstance(event, dict):
            raise RequestError("protocol", f"SSE data is not a JSON object: {data[:200]!r}")
        self._event(event, now)

    def _event(self, event: Mapping[str, Any], now: float) -> None:
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            raise RequestError("server_error", f"error in stream: {str(error)[:300]}")
        usage = event.get("usage")
        if usage:
            self.turn.usage = dict(usage)
        choices = event.get("choices") or ()
        turn = self.turn
        for choice in choices:
            if choice.get("index", 0) != 0:
                continue  # n > 1 is not used; only the first choice is a turn
            delta = choice.get("delta") or {}
            carried = False
            content = delta.get("content")
            if content:
                turn.content += content
                carried = True
            reasoning = delta.get("reasoning_content")
            if reasoning:
                turn.reasoning += reasoning
                carried = True
            for tc in delta.get("tool_calls") or ():
                self._tool_delta(tc)
                carried = True
            legacy = delta.get("function_call")
            if legacy:
                self._legacy_delta(legacy)
                carried = True
            if carried:
                turn.chunk_times.append(now)
            finish = choice.get("finish_reason")
            if finish:
                turn.finish_reason = finish

    def _tool_delta(self, tc: Mapping[str, Any]) -> None:
        index = tc.get("index")
        if not isinstance(index, int):
            index = self._index_without_index(tc.get("id"))
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = StreamedToolCall(index=index)
        if tc.get("id"):
            call.id = tc["id"]
        _extend_call(call, tc.get("function") or {})

    def _legacy_delta(self, function: Mapping[str, Any]) -> None:
        if self._legacy is None:
            self._legacy = StreamedToolCall(index=0)
        _extend_call(self._legacy, function)

    def _index_without_index(self, call_id: str | None) -> int:
        """Some servers omit the index: a known id continues its call, a new id starts one, no id
        continues the last call."""
        for call in self._calls.values():
            if call_id and call.id == call_id:
                return call.index
        if call_id or not self._calls:
            return max(self._calls, default=-1) + 1
        return max(self._calls)


def _extend_call(call: StreamedToolCall, function: Mapping[str, Any]) -> None:
    """Add one delta of a call (`function` of a tool_calls delta, or a legacy function_call)."""
    name = function.get("name")
    # servers differ: the whole name once, the whole name repeated in every delta, or name pieces
    if name and name != call.name:
        call.name += name
    arguments = function.get("arguments")
    if arguments:
        call.arguments += arguments


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
    endpoint = url if url.rstrip("/").endswith(CHAT_PATH) else url.rstrip("/") + CHAT_PATH
    body = dict(payload)
    body["stream"] = True
    body.setdefault("stream_options", {"include_usage": True})
    data = _dumps(body)
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
    if not turn.done and turn.finish_reason is None:
        raise RequestError("incomplete_stream", f"body ended after {len(turn.raw)} bytes without [DONE]")
    return turn


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
