"""Fixtures for the workload tests: the simulated SGLang server as a real process on loopback.

Started through `LocalTransport.start_detached` (its own process group) and always stopped with
`stop_group` in a `finally`, so no test leaves a server behind.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import server_launch, wait_healthy
from tests.conftest import free_port

# a server with no fault rule matching: eager decode (the built-in model needs captured graphs)
HEALTHY_ARGS = ("--disable-decode-cuda-graph",)


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (just released by the OS)."""
    return free_port()


@dataclass
class SimServer:
    url: str
    port: int
    pid: int
    log_path: Path
    transport: LocalTransport

    def stop(self, grace_s: float = 5.0) -> None:
        self.transport.stop_group(self.pid, grace_s=grace_s)

    def log_tail(self) -> str:
        return self.transport.read_text_tail(str(self.log_path), 4000)


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimServer]]:
    """start_sim(args=HEALTHY_ARGS, env={}, time_scale=0.0) -> a healthy SimServer; all stopped after."""
    transport = LocalTransport()
    started: list[SimServer] = []

    def _start(
        args: Sequence[str] = HEALTHY_ARGS, env: Mapping[str, str] | None = None, time_scale: float = 0.0
    ) -> SimServer:
        port = free_port()
        n = len(started)
        log_path, pid_path = tmp_path / f"sim{n}.log", tmp_path / f"sim{n}.pid"
        launch = server_launch(port, time_scale=time_scale, flags=args, env=env)
        pid = transport.start_detached(launch.argv, launch.env, str(log_path), str(pid_path))
        server = SimServer(launch.url, port, pid, log_path, transport)
        started.append(server)
        wait_healthy(server.url, alive=lambda: transport.is_alive(pid), log_tail=server.log_tail)
        return server

    try:
        yield _start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def sim_server(start_sim: Callable[..., SimServer]) -> SimServer:
    """A healthy simulated server with no modelled latency."""
    return start_sim()


# --- a scripted OpenAI-compatible server ------------------------------------------------------------


@dataclass
class ScriptedServer:
    """A real aiohttp server on loopback (in a thread of its own) whose chat replies the test scripts:
    for the protocol variants of servers nobody here wrote (legacy `function_call` deltas, no usage, a
    stream cut by a live server, errors). `requests` keeps every chat body it received."""

    url: str
    requests: list[dict]


Reply = Callable[[dict, web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
def scripted_server() -> Iterator[Callable[[Reply], ScriptedServer]]:
    """scripted_server(reply) -> a ScriptedServer whose POST /v1/chat/completions is `reply(body,
    request)` (an async function returning the response); all stopped after the test."""
    stops: list[Callable[[], None]] = []

    def _start(reply: Reply) -> ScriptedServer:
        requests: list[dict] = []
        ready = threading.Event()
        state: dict = {}

        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            requests.append(body)
            return await reply(body, request)

        async def serve() -> None:
            app = web.Application()
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            state["port"] = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            state["stop"] = asyncio.Event()
            ready.set()
            await state["stop"].wait()
            await runner.cleanup()

        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        assert ready.wait(10), "the scripted server did not start"

        def stop() -> None:
            loop.call_soon_threadsafe(state["stop"].set)
            thread.join(10)

        stops.append(stop)
        return ScriptedServer(f"http://127.0.0.1:{state['port']}", requests)

    try:
        yield _start
    finally:
        for stop in stops:
            stop()


async def sse_reply(request: web.Request, events: Sequence[dict], done: bool = True) -> web.StreamResponse:
    """Stream `events` as SSE data lines (then [DONE]) on `request`'s response."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    if done:
        await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def call_events(name: str, arguments: str, legacy_only: bool = False, usage: bool = True) -> list[dict]:
    """A one-call turn as chunks: `tool_calls` deltas with the legacy `function_call` beside (as
    llama-cpp-python streams them), or the legacy form alone; usage last unless `usage` is false."""
    function = {"name": name, "arguments": arguments}
    delta: dict = {"role": "assistant", "content": None, "function_call": function}
    if not legacy_only:
        delta["tool_calls"] = [{"index": 0, "id": "call_0", "type": "function", "function": function}]
    events: list[dict] = [
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
        },
    ]
    if usage:
        events.append(
            {
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {"prompt_tokens": 9, "completion_tokens": 5},
            }
        )
    return events
