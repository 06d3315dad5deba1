"""Record the raw SSE bodies of llama-cpp-python's server into tests/workload/data/llamacpp_<case>.sse.

Not a test (pytest does not collect it). It starts the server as the realserver tests do (same argv,
loopback, a free port; stopped with its process group after), or records from one already up:

    python -m tests.realserver.record_fixtures [--url http://127.0.0.1:PORT] [--out tests/workload/data]

Each body is written byte for byte as the server sent it (aiohttp with auto_decompress off, chunks
concatenated), with the request and what happened (status, headers, times, the client's error) beside
it in llamacpp_<case>.json, for the parser tests; tests/workload/data/README.md says what each shows.
About 1.5 minutes on 2 cores (two uncached 1,100-token prompts and the grammar-constrained calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from orchestrator.workload.tasks import TOOLS, initial_messages, make_task

DATA = Path(__file__).resolve().parents[1] / "workload" / "data"


# a plain prompt this model answers at some length (about 50 chunks; most prompts get a dozen)
TRANSLATE = (
    "Translate to French, sentence by sentence: The cat sat on the mat. The dog ran in the park. "
    "The bird sang in the tree. The fish swam in the pond. The sun rose over the hills. "
    "The rain fell on the roof."
)


def tool_request(tool_choice: Any, max_tokens: int = 128) -> dict[str, Any]:
    task = make_task(0, 0, 4)
    return {
        "model": "default",
        "messages": initial_messages(task),
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


def plain_request(max_tokens: int = 24, text: str = "Say hello in five words.") -> dict[str, Any]:
    return {
        "model": "default",
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    t0: float,
    first_byte: asyncio.Event | None = None,
) -> dict[str, Any]:
    """POST `body`, read the whole reply as raw bytes; what happened, with times from t0."""
    record: dict[str, Any] = {"sent_s": round(time.monotonic() - t0, 3)}
    chunks: list[bytes] = []
    try:
        async with http.post(
            url.rstrip("/") + "/v1/chat/completions",
            data=json.dumps(body),
            headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
        ) as resp:
            record["status"] = resp.status
            record["headers"] = {k: v for k, v in resp.headers.items() if k.lower() != "date"}
            record["headers_s"] = round(time.monotonic() - t0, 3)
            async for chunk in resp.content.iter_any():
                if not chunks:
                    record["first_byte_s"] = round(time.monotonic() - t0, 3)
                    if first_byte is not None:
                        first_byte.set()
                chunks.append(chunk)
    except aiohttp.ClientError as e:  # what a cut looks like to a client is part of the record
        record["client_error"] = f"{type(e).__name__}: {e}"
    record["ended_s"] = round(time.monotonic() - t0, 3)
    record["body"] = b"".join(chunks)
    return record


async def record_all(url: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    timeout = aiohttp.ClientTimeout(total=600)
    cases: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}

    def fresh() -> aiohttp.ClientSession:  # one connection per case: no case sees another's socket
        return aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    singles = {
        "forced": tool_request({"type": "function", "function": {"name": "search"}}),
        # http_get's schema has a pattern without "$": the grammar falls back to plain JSON
        "forced_http_get": tool_request({"type": "function", "function": {"name": "http_get"}}),
        # max_tokens cuts the arguments: what finish_reason says then
        "forced_length": tool_request({"type": "function", "function": {"name": "search"}}, max_tokens=6),
        "auto": tool_request("auto"),
        "required": tool_request("required"),
        "plain": plain_request(),
    }
    for name, body in singles.items():
        async with fresh() as http:
            t0 = time.monotonic()
            cases[name] = (body, await post(http, url, body, t0))
    # the request after a failed one on the same keep-alive connection
    async with fresh() as http:
        t0 = time.monotonic()
        await post(http, url, singles["auto"], t0)
        after = plain_request()
        cases["after_failure"] = (after, await post(http, url, after, t0))
    # concurrent: a forced call whose prompt is not cached (about 15 s of prefill on 2 cores), and a
    # plain request sent 1.5 s later, while the first is still in prefill
    first = {**tool_request({"type": "function", "function": {"name": "search"}}), "messages": None}
    first["messages"] = initial_messages(make_task(0, 1, 4))
    second = plain_request()
    async with fresh() as http_a, fresh() as http_b:
        t0 = time.monotonic()
        task_a = asyncio.create_task(post(http_a, url, first, t0))
        await asyncio.sleep(1.5)
        cases["concurrent_second"] = (second, await post(http_b, url, second, t0))
        cases["concurrent_first"] = (first, await task_a)
    # concurrent, mid-stream: the second is sent 0.3 s after the first's first byte
    first = plain_request(300, TRANSLATE)
    async with fresh() as http_a, fresh() as http_b:
        t0 = time.monotonic()
        started = asyncio.Event()
        task_a = asyncio.create_task(post(http_a, url, first, t0, started))
        await started.wait()
        await asyncio.sleep(0.3)
        cases["midstream_second"] = (second, await post(http_b, url, second, t0))
        cases["midstream_first"] = (first, await task_a)
    for name, (body, record) in cases.items():
        raw = record.pop("body")
        (out / f"llamacpp_{name}.sse").write_bytes(raw)
        meta = {"case": name, "request": body, **record}
        meta["bytes"] = len(raw)
        (out / f"llamacpp_{name}.json").write_text(json.dumps(meta, indent=1) + "\n")
        shown = {k: v for k, v in record.items() if k != "headers"}
        print(f"{name}: {len(raw)} bytes, {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a server already up (default: start one as the tests do)")
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args()
    if args.url:
        asyncio.run(record_all(args.url, args.out))
        return
    import tempfile

    import pytest

    from orchestrator.remote.local import LocalTransport
    from tests.conftest import free_port
    from tests.realserver.llamacpp_server import RealServer, model_path, require_server, server_argv

    try:
        require_server()
        model = model_path()
    except pytest.skip.Exception as e:
        raise SystemExit(str(e)) from None
    transport, port = LocalTransport(), free_port()
    with tempfile.TemporaryDirectory() as work:
        log = f"{work}/server.log"
        pid = transport.start_detached(server_argv(model, port), {}, log, f"{work}/server.pid")
        server = RealServer(f"http://127.0.0.1:{port}", pid, Path(log), model, transport)
        try:
            deadline = time.monotonic() + 120
            while not server.answers():
                if not transport.is_alive(pid) or time.monotonic() > deadline:
                    raise SystemExit(f"the server did not start:\n{server.log_tail()}")
                time.sleep(0.25)
            asyncio.run(record_all(server.url, args.out))
        finally:
            transport.stop_group(pid, grace_s=10.0)


if __name__ == "__main__":
    main()
