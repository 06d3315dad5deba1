"""Test kit for the simulated PD deployment: start/stop real processes (prefill, decode, the real
sglang-router), each in a session of its own with its output in a log as LocalTransport starts a role,
but forked from the test process's warm zygote (tests/warm.py); the study's factor levels as env/flags
per role (the launch contract of the lead's planner), and a small async session driver with an
exact-match oracle.

The driver mirrors orchestrator/workload/stress.py (R streamed rounds per session, whole
conversation resent each round, max_tokens 1024); it judges a turn corrupted unless it is exactly
the call the plan expects, and errored on any transport/HTTP failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import router_launch, server_launch, wait_healthy
from orchestrator.workload import tasks
from orchestrator.workload.stress import StressSettings, run_stress_sync
from tests import warm
from tests.conftest import free_port

MODEL = "deepseek-ai/DeepSeek-V4-Flash"
# both roles, as the orchestrator's sim_dsv4 deployment sets them
DEPLOYMENT_FLAGS = ("--disable-overlap-schedule", "--tool-call-parser", "deepseekv4", "--enable-metrics")
REPO = Path(__file__).resolve().parents[2]


# --- the study's factors -> env/flags per role (what the planner emits) ---------------------------


@dataclass(frozen=True)
class Arm:
    capture: bool = True  # decode captures CUDA graphs (else --disable-decode-cuda-graph)
    bf16_index_k: bool = True  # SGLANG_DSV4_BF16_INDEX_K on both roles
    multi_stream: bool = True  # SGLANG_OPT_USE_MULTI_STREAM_OVERLAP on decode
    hicache: bool = True  # --enable-hierarchical-cache on prefill

    def prefill_env(self) -> dict[str, str]:
        return {"SGLANG_DSV4_BF16_INDEX_K": "1" if self.bf16_index_k else "0"}

    def decode_env(self) -> dict[str, str]:
        return {
            "SGLANG_DSV4_BF16_INDEX_K": "1" if self.bf16_index_k else "0",
            "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "1" if self.multi_stream else "0",
        }

    def prefill_flags(self) -> list[str]:
        return ["--enable-hierarchical-cache", "--hicache-ratio", "2.0"] if self.hicache else []

    def decode_flags(self) -> list[str]:
        return [] if self.capture else ["--disable-decode-cuda-graph"]


BASELINE = Arm()
FIXED = Arm(multi_stream=False)


# --- processes ---------------------------------------------------------------------------------


@dataclass
class Proc:
    role: str
    log_path: Path
    url: str
    started: Any  # the Popen or warm.WarmProcess: reaped, and its exit status read, once stopped

    @property
    def pid(self) -> int:
        return self.started.pid


@dataclass
class Cluster:
    """One simulated PD deployment on loopback. Every process it starts is stopped by `stop_all`."""

    work: Path
    time_scale: float = 0.05
    fault_model: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    transport: LocalTransport = field(default_factory=LocalTransport)
    prefill_port: int = field(default_factory=free_port)
    decode_port: int = field(default_factory=free_port)
    bootstrap_port: int = field(default_factory=free_port)
    router_port: int = field(default_factory=free_port)
    procs: dict[str, Proc] = field(default_factory=dict)
    _n: int = 0

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def _start(self, role: str, argv: list[str], env: Mapping[str, str], url: str) -> Proc:
        """`argv` with `env` added, in a session of its own (its pid is its group's), its output in a log,
        forked from the warm zygote: a sim server's cold start is ~0.25 CPU-s, most of it importing
        aiohttp, and these tests co-restart a deployment a few hundred times. The orchestrator's own
        start line (`Transport.start_detached`) is what tests/sim/test_launch.py and every study use;
        `transport` still looks at and stops what this starts."""
        self._n += 1
        log_path = self.work / f"{role}-{self._n}.log"
        with open(log_path, "wb") as log:
            started = warm.popen(
                argv,
                env={**os.environ, **env},
                cwd=str(REPO),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(role, log_path, url, started)
        self.procs[role] = proc
        return proc

    def _start_server(
        self, role: str, port: int, env: Mapping[str, str], flags: Sequence[str], wait: bool
    ) -> Proc:
        launch = server_launch(
            port,
            mode=role,
            model_path=MODEL,
            bootstrap_port=self.bootstrap_port,
            time_scale=self.time_scale,
            fault_model=self.fault_model or None,
            flags=[*DEPLOYMENT_FLAGS, *flags],
            env={**self.extra_env, **env},
        )
        proc = self._start(role, launch.argv, launch.env, launch.url)
        if wait:
            self.wait_healthy(proc)
        return proc

    def start_prefill(self, arm: Arm = BASELINE, extra: Sequence[str] = (), wait: bool = True) -> Proc:
        flags = [*arm.prefill_flags(), *extra]
        return self._start_server("prefill", self.prefill_port, arm.prefill_env(), flags, wait)

    def start_decode(self, arm: Arm = BASELINE, extra: Sequence[str] = (), wait: bool = True) -> Proc:
        flags = ["--cuda-graph-max-bs-decode", "32", *arm.decode_flags(), *extra]
        return self._start_server("decode", self.decode_port, arm.decode_env(), flags, wait)

    def start_router(self, extra: Sequence[str] = ()) -> Proc:
        launch = router_launch(
            self.router_port,
            prefill_url=f"http://127.0.0.1:{self.prefill_port}",
            bootstrap_port=self.bootstrap_port,
            decode_url=f"http://127.0.0.1:{self.decode_port}",
            metrics_port=free_port(),
            flags=extra,
        )
        proc = self._start("router", launch.argv, launch.env, launch.url)
        self.wait_router(proc)
        return proc

    def start_all(self, arm: Arm = BASELINE, router_extra: Sequence[str] = ()) -> None:
        # prefill and decode boot side by side, as the orchestrator's co-restart starts them
        servers = [self.start_prefill(arm, wait=False), self.start_decode(arm, wait=False)]
        for proc in servers:
            self.wait_healthy(proc)
        self.start_router(router_extra)

    def stop(self, role: str) -> None:
        proc = self.procs.pop(role, None)
        if proc is not None:
            self.transport.stop_group(proc.pid, grace_s=5.0)
            proc.started.wait(timeout=10.0)  # the group is gone: its status is there to read

    def stop_all(self) -> None:
        for role in ("router", "decode", "prefill"):
            self.stop(role)

    def log(self, role: str) -> str:
        return self.procs[role].log_path.read_text(errors="replace")

    def wait_healthy(self, proc: Proc, timeout_s: float = 30.0) -> None:
        wait_healthy(
            proc.url,
            timeout_s=timeout_s,
            alive=lambda: self.transport.is_alive(proc.pid),
            log_tail=lambda: proc.log_path.read_text()[-3000:],
            name=proc.role,
        )

    def wait_router(self, proc: Proc, timeout_s: float = 30.0) -> None:
        """Ready when a warm-up chat through it succeeds (it may report ready before its workers)."""
        deadline = time.monotonic() + timeout_s
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        while time.monotonic() < deadline:
            if post_json(self.router_url + "/v1/chat/completions", body, timeout=10.0)[0] == 200:
                return
            if not self.transport.is_alive(proc.pid):
                raise RuntimeError(f"router exited during startup:\n{proc.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"router not serving within {timeout_s}s:\n{proc.log_path.read_text()[-3000:]}")


def http_status(url: str, timeout: float = 3.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: Any, timeout: float = 30.0) -> tuple[int | None, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.startswith(b"{") else raw.decode())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return None, str(e)


def sim_counters(url: str) -> dict[str, Any]:
    return get_json(url + "/server_info")["sim"]["counters"]


def stress_settings(c: Cluster, out_dir: Path, sessions: int, rounds: int, seed: int) -> StressSettings:
    """The orchestrator's stress runner aimed at this cluster's router, quietly, as the sim tests run it."""
    return StressSettings(
        url=c.router_url,
        out_dir=out_dir,
        sessions=sessions,
        rounds=rounds,
        seed=seed,
        model=MODEL,
        timeout_s=60.0,
        progress=False,
    )


def fresh_stress_run(
    c: Cluster, arm: Arm, out_dir: Path, sessions: int, rounds: int, seed: int
) -> tuple[Any, dict[str, Any]]:
    """A fresh co-restart of `arm`, then one run of the orchestrator's own stress runner through the
    router: its summary and the decode's counters after it. Checked here, as every caller needs it:
    every planned session ran without error, and the oracle found exactly the turns the sim corrupted."""
    c.stop_all()
    c.start_all(arm)
    decode = c.procs["decode"].url
    before = sim_counters(decode)["corrupted_turns"]
    summary = run_stress_sync(stress_settings(c, out_dir, sessions, rounds, seed))
    counters = sim_counters(decode)
    assert summary.errored == 0 and summary.sessions == sessions
    assert summary.corrupted == counters["corrupted_turns"] - before
    return summary, counters


# --- the session driver ------------------------------------------------------------------------


@dataclass
class Turn:
    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # {"id","name","arguments"}
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class Outcome:
    session: int
    status: str  # clean | corrupted | errored
    reason: str = ""


def parse_sse(body: str) -> Turn:
    turn = Turn()
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            turn.completion_tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            turn.content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                while len(turn.calls) <= tc["index"]:
                    turn.calls.append({"id": "", "name": "", "arguments": ""})
                call, function = turn.calls[tc["index"]], tc.get("function") or {}
                call["id"] = tc.get("id") or call["id"]
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            turn.finish_reason = choice.get("finish_reason") or turn.finish_reason
    return turn


def judge(turn: Turn, expected: tasks.ToolCall) -> str | None:
    """None if the turn is exactly the expected call, else why not."""
    if len(turn.calls) != 1:
        return f"{len(turn.calls)} tool calls; content {turn.content[:80]!r}"
    call = turn.calls[0]
    if call["name"] != expected.name:
        return f"called {call['name']!r}, expected {expected.name!r}"
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return f"arguments are not JSON: {call['arguments'][:80]!r}"
    if args != dict(expected.arguments):
        return f"arguments {args!r} != expected {dict(expected.arguments)!r}"
    if turn.content.strip() or turn.finish_reason != "tool_calls":
        return f"content {turn.content[:80]!r}, finish_reason {turn.finish_reason!r}"
    return None


async def run_session(
    http: aiohttp.ClientSession, url: str, task: tasks.Task, index: int, timeout_s: float
) -> Outcome:
    messages = tasks.initial_messages(task)
    for r, expected in enumerate(task.steps):
        body = {
            "model": MODEL,
            "messages": messages,
            "tools": tasks.TOOLS,
            "max_tokens": 1024,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        try:
            async with http.post(
                url + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    return Outcome(index, "errored", f"HTTP {resp.status}: {text[:200]}")
        except (aiohttp.ClientError, TimeoutError) as e:
            return Outcome(index, "errored", f"{type(e).__name__}: {e}")
        turn = parse_sse(text)
        problem = judge(turn, expected)
        if problem is not None:
            return Outcome(index, "corrupted", f"round {r}: {problem}")
        call = turn.calls[0]
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call["arguments"]},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": tasks.tool_result(task, r)})
    return Outcome(index, "clean")


async def run_sessions(
    url: str, sessions: int, rounds: int, seed: int, concurrency: int | None = None, timeout_s: float = 120.0
) -> list[Outcome]:
    """`sessions` seeded sessions of `rounds` rounds, at most `concurrency` at once (default: all)."""
    limit = asyncio.Semaphore(concurrency or sessions)
    connector = aiohttp.TCPConnector(limit=concurrency or sessions)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(i: int) -> Outcome:
            async with limit:
                return await run_session(http, url, tasks.make_task(seed, i, rounds), i, timeout_s)

        return list(await asyncio.gather(*(one(i) for i in range(sessions))))


def count(outcomes: Sequence[Outcome], status: str) -> int:
    return sum(1 for o in outcomes if o.status == status)


# --- a closed-loop throughput probe --------------------------------------------------------------


@dataclass
class Level:
    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    duration_s: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.duration_s


async def bench_level(url: str, concurrency: int, requests: int, output_len: int) -> Level:
    """`requests` streamed chats of exactly `output_len` tokens (ignore_eos), `concurrency` at a time;
    output tokens from the usage chunk over the wall time of the level."""
    queue = list(range(requests))
    tokens, errors = 0, 0
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story about GPUs."}],
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:

        async def worker() -> None:
            nonlocal tokens, errors
            while queue:
                queue.pop()
                async with http.post(url + "/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
                if resp.status != 200:
                    errors += 1
                    continue
                tokens += parse_sse(text).completion_tokens

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Level(concurrency, requests, errors, tokens, time.monotonic() - started)
