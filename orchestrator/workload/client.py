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

Lifecycle:
    async with open_session(concurrency=64) as session:
        turn = await stream_chat(session, "http://127.0.0.1:8000", payload, timeout=120.0)

The layers: this module is the API (sessions, requests, the sync runner); the body is parsed by
`sse.SSEParser` (the protocol variants read as one turn, invalid UTF-8 kept as evidence); a session from
`open_session` carries the lean HTTP/1.1 client of `http1.py`, which `stream_chat` uses for plain
`http://` URLs. Any other session, and https URLs, go through aiohttp with the same error kinds for the
same failures. `RequestError` and the JSON codec are `wire.py`'s. `loop_factory()` gives uvloop's event
loop where it is installed (the sync entry points use it; library callers keep whatever loop they run).
"""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import aiohttp

from orchestrator.workload import http1
from orchestrator.workload.results import StreamedTurn
from orchestrator.workload.sse import SSEParser, complete_turn
from orchestrator.workload.wire import RequestError, dumps

try:  # uvloop's event loop, for the sync entry points only (loop_factory)
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - exercised only where uvloop is missing
    _uvloop = None


CHAT_PATH = "/v1/chat/completions"


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
        http1.Pool(max(1, concurrency), connect_timeout_s, keepalive_s),
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

    def __init__(self, streams: http1.Pool, **kwargs: Any):
        super().__init__(**kwargs)
        self.streams = streams

    def close(self, *args: Any, **kwargs: Any) -> Any:
        self.streams.close()
        return super().close(*args, **kwargs)


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
    return await stream_body(session, url, dumps(body), timeout)


async def stream_body(session: aiohttp.ClientSession, url: str, body: bytes, timeout: float) -> StreamedTurn:
    """`stream_chat` for a request already serialised to JSON bytes (a streaming chat request: `stream`
    and `stream_options` set, as `chat_payload` gives them); the stress workload builds its growing
    conversations' bodies incrementally and sends them through here."""
    endpoint = _endpoint(url)
    pool = getattr(session.connector, "streams", None)
    target = http1.target(endpoint) if isinstance(pool, http1.Pool) and not session.closed else None
    if target is None:
        return await _stream_aiohttp(session, endpoint, body, timeout)
    return await http1.stream(pool, endpoint, target, body, timeout)


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
        kind = "connection_refused" if http1.errno_of(e) == errno.ECONNREFUSED else "server_gone"
        raise RequestError(kind, str(e)) from e
    except aiohttp.ServerDisconnectedError as e:
        raise await http1.closed_error(endpoint, f"server disconnected: {e}") from e
    except aiohttp.ClientPayloadError as e:
        raise await http1.closed_error(endpoint, f"response body cut off: {e}") from e
    except (ConnectionResetError, BrokenPipeError, aiohttp.ClientOSError) as e:
        raise await http1.closed_error(endpoint, f"{type(e).__name__}: {e}") from e
    except aiohttp.ClientError as e:
        raise await http1.closed_error(endpoint, f"{type(e).__name__}: {e}") from e
    return complete_turn(turn)
