"""The SSE body of a streaming chat completion, parsed into a `StreamedTurn` (`SSEParser`): pure, no I/O,
fed bytes as they arrive by either transport (http1.py, or aiohttp in client.py).

Protocol variants read as the same turn: tool calls streamed as `tool_calls` deltas (with or without
`index`, the name once, repeated, or in pieces) or as the legacy `function_call` delta (OpenAI's
pre-tools form, which llama-cpp-python streams beside `tool_calls`; used only when the stream carries no
`tool_calls`, so a server sending both is not read as two calls). A stream with no usage block leaves
`usage` None: the token counts are unknown, never estimated. An error object inside the stream (SGLang's
way of reporting an abort) raises `RequestError("server_error")`; a body that is not SSE of JSON chunks,
`RequestError("protocol")`; a body that ends without `[DONE]` and without any `finish_reason`,
`RequestError("incomplete_stream")` (`complete_turn`).

Invalid UTF-8 inside the stream is kept (decoded with `surrogateescape`, so the bad bytes show up as
lone surrogates U+DC80..U+DCFF) instead of failing the parse: invalid bytes are evidence for the
oracle, not a transport error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from orchestrator.workload.results import StreamedToolCall, StreamedTurn
from orchestrator.workload.wire import RequestError, loads_bytes


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

    def feed_slice(self, data: bytes, start: int, end: int, now: float) -> None:
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
                    text = loads_bytes(data[first:last])
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
                    text = loads_bytes(payload[len(prefix) : len(payload) - len(suffix)])
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
            event = loads_bytes(payload)
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
            logprobs = choice.get("logprobs")
            if logprobs:
                _extend_tokens(turn, logprobs)
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
        if choice.get("logprobs"):  # each event's tokens differ: no template could carry them
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
            probe = loads_bytes(prefix + _PROBE_JSON + suffix)
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


def _extend_tokens(turn: StreamedTurn, logprobs: Any) -> None:
    """The tokens of an OpenAI logprobs block (`{"content": [{"token": ...}, ...]}`) onto the turn."""
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(entries, list):
        return
    if turn.tokens is None:
        turn.tokens = []
    for entry in entries:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str):
            raise RequestError("protocol", f"a logprobs entry without a token: {str(entry)[:200]}")
        turn.tokens.append(token)


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


def complete_turn(turn: StreamedTurn) -> StreamedTurn:
    """The parsed turn, unless its body ended as a killed server's does: no [DONE], no finish_reason."""
    if not turn.done and turn.finish_reason is None:
        raise RequestError("incomplete_stream", f"body ended after {len(turn.raw)} bytes without [DONE]")
    return turn
