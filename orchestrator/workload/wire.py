"""What the streaming client's layers share (client.py, http1.py, sse.py): the JSON codec, and
`RequestError`, the one way a turn fails at the transport or protocol level (never corruption)."""

from __future__ import annotations

import json
from typing import Any

try:  # orjson (a dependency of sglang-router) parses ~3x faster; plain json is the fallback
    import orjson

    loads_bytes = orjson.loads

    def dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover - exercised only where orjson is missing

    def loads_bytes(data: bytes) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


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
