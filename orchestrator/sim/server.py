"""heisenhunt's simulated SGLang server: one process per PD role, launched like `sglang.launch_server`.

    python -m orchestrator.sim.server --model-path M --disaggregation-mode prefill|decode --port P ...

A test target, not SGLang: it has no model. It speaks the HTTP surface the orchestrator and the real
`sglang-router` use (`/health`, `/server_info`, `/model_info`, `/v1/models`, `/v1/chat/completions` with
tools and SSE, `/generate`, `/flush_cache`, `/metrics`), logs in SGLang's shapes, performs the PD
hand-off through the prefill's bootstrap port (bootstrap.py), batches like an engine (engine.py) and
corrupts tool calls only where its fault model (faults.py) says so.

Environment: `SGLANG_*` as SGLang parses them (envs.py); `HEISENHUNT_SIM_FAULT_MODEL` (path of a
fault-model YAML; unset = the built-in model); `HEISENHUNT_SIM_TIME_SCALE` (every modelled duration is
multiplied by it; default 1.0); `HEISENHUNT_SIM_SESSION_IDLE_S` (wall seconds a silent tool-calling
session stays open in the modelled load, engine.py; default 10). `/server_info` has a `sim` block with
the sim's own counters and its modelled load now.

Flags: SGLang 0.5.23's spelling and resolution (args.py); `/server_info` reports the resolved flags by
their dest, as SGLang's does (e.g. `disable_decode_cuda_graph`, `cuda_graph_max_bs_decode`), and
`internal_states[0].decode_cuda_graph_bs` the decode's graph batch sizes, empty when decode graphs are
off (`args.decode_graphs_enabled`, the one decision the engines use too).

Test-only: `HEISENHUNT_SIM_OVERRIDE_ARGS`, a JSON object `{dest: value}` (e.g.
`{"disable_decode_cuda_graph": false}`), models a real server overriding an argument during its
argument resolution (SGLang's resolution hooks do this silently, e.g. turning a feature off that is
incompatible with another). It is applied to the parsed flags after parsing and resolution; the server
logs one warning line per overridden dest (`Overriding disable_decode_cuda_graph=True -> False
(HEISENHUNT_SIM_OVERRIDE_ARGS)`), runs with the overridden values (graphs captured or not, fault-model
rules matched on them) and reports them in `/server_info`. An unknown dest, a value not of the parser's
type for it (or not among its choices), or an override the resolution would undo (decode graphs on while
`disable_cuda_graph` stays set) stops the server at start-up (exit status 2) with a message naming the
dest and what is accepted. Use it to test that the orchestrator notices a flag not in effect on the
running server; never in a study.

`/metrics` (with `--enable-metrics`, as SGLang) reports the decode's *modelled* load in SGLang's own
gauges, so a client that polls a real server's load reads the sim's the same way:
`sglang:num_running_reqs` is the running batch and `sglang:num_queue_reqs` the rest of the modelled load
(queued, receiving KV, and open sessions between their turns, which a GPU would hold in its batch);
their sum is the load the next turn of the session furthest behind would join (`DecodeEngine.
modelled_load_now`). `heisenhunt_sim:open_sessions` is the sim's own count of open sessions.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

if __name__ == "__main__":
    # A sim makes no TLS connection, yet importing aiohttp builds its default SSL contexts from the
    # CA bundle (the host's default, or the one SSL_CERT_FILE names): ~0.05 CPU-s of a ~0.25 s start, at
    # every start of every role (a study co-restarts hundreds). An empty bundle, for this process alone.
    os.environ["SSL_CERT_FILE"] = os.devnull

from aiohttp import web

from orchestrator.sim import agent
from orchestrator.sim.args import (
    apply_overrides,
    decode_graph_max_bs,
    decode_graphs_enabled,
    deprecation_warnings,
    parse_args,
    parse_overrides,
)
from orchestrator.sim.bootstrap import BootstrapClient, BootstrapFailed, BootstrapState
from orchestrator.sim.engine import (
    SESSION_IDLE_ENV,
    DecodeEngine,
    DecodeRequest,
    PrefillEngine,
    SessionLoad,
    SimCounters,
    parse_session_idle,
    session_turn,
    tagged_turn,
)
from orchestrator.sim.envs import effective_env
from orchestrator.sim.faults import FAULT_MODEL_ENV, FaultModel, FaultModelError, RoleConfig, load_fault_model

log = logging.getLogger("sglang.sim.server")

# "module:Class" of the decode engine (unset: the simulated one); orchestrator.gpu.engine:GpuDecodeEngine
DECODE_ENGINE_ENV = "HEISENHUNT_DECODE_ENGINE"
# the decode batch sizes SGLang captures graphs for (up to --cuda-graph-max-bs-decode)
CUDA_GRAPH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
TIME_SCALE_ENV = "HEISENHUNT_SIM_TIME_SCALE"
# test-only: {dest: value} a real server's argument resolution would override (module doc)
OVERRIDE_ARGS_ENV = "HEISENHUNT_SIM_OVERRIDE_ARGS"
SIM_VERSION = "0.5.23"  # the SGLang release whose flags and log lines the sim follows
READY_LINE = "The server is fired up and ready to roll!"
MIN_TIMEOUT_S = 0.5

try:  # orjson ships with sglang-router; fall back to json
    import orjson

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()


def parse_time_scale(raw: str | None) -> float:
    if raw is None or raw.strip() == "":
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(
            f"{TIME_SCALE_ENV} must be a finite number >= 0 (0: no modelled delays), got {raw!r}"
        )
    return value


def estimate_prompt_tokens(messages: Any, tools: Any) -> int:
    """About four characters per token, as BPE gives on English and JSON."""
    size = len(json.dumps(messages, ensure_ascii=False)) + (len(json.dumps(tools)) if tools else 0)
    return max(1, size // 4)


def decode_engine_class(spec: str | None) -> type[DecodeEngine]:
    """The decode engine named by `module:Class` (a DecodeEngine subclass); None or "": the sim's."""
    if not spec:
        return DecodeEngine
    module, _, name = spec.partition(":")
    engine = getattr(importlib.import_module(module), name or "", None)
    if not (isinstance(engine, type) and issubclass(engine, DecodeEngine)):
        raise ValueError(f"{DECODE_ENGINE_ENV}={spec!r} does not name a DecodeEngine subclass (module:Class)")
    return engine


def error_body(message: str, status: int, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


class SimServer:
    def __init__(self, args, environ: Mapping[str, str], model: FaultModel, scale: float):
        self.args = args
        self.mode = args.disaggregation_mode
        self.scale = scale
        self.model = model
        self.instance = uuid.uuid4().hex[:12]
        self.env, self.env_warnings = effective_env(environ)
        self.raw_env = {k: v for k, v in environ.items() if k.startswith("SGLANG_")}
        self.config = RoleConfig(role=self.mode, env=self.env, args=vars(args))
        self.model_name = args.served_model_name or args.model_path
        self.counters = SimCounters()
        self.rng = random.Random(model.seed)
        self.ready = False
        self.stopping = False
        self.recent_rooms: deque[int] = deque(maxlen=256)
        self.decode = decode_engine_class(environ.get(DECODE_ENGINE_ENV))(
            model, self.config, scale, self.counters, self.rng, args.decode_log_interval
        )
        self.decode.sessions = SessionLoad(parse_session_idle(environ.get(SESSION_IDLE_ENV)))
        self.prefill = PrefillEngine(
            model.throughput.prefill_s, scale, self.counters, args.chunked_prefill_size
        )
        # modelled timeouts, scaled, but never so short that loopback HTTP itself would trip them
        boot_timeout = max(self.env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] * scale, MIN_TIMEOUT_S)
        wait_timeout = max(self.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] * scale, MIN_TIMEOUT_S)
        self.bootstrap_timeout_s = boot_timeout
        self.bootstrap_state = BootstrapState(
            self.instance,
            {"prefill_instance": self.instance, "config": self.config.to_dict()},
            ttl_s=2 * (boot_timeout + wait_timeout) + 60.0,
        )
        self.bootstrap_client = BootstrapClient(
            f"{args.host}:{args.port}", self.instance, boot_timeout, wait_timeout
        )
        self.health_timeout_s = max(self.env["SGLANG_HEALTH_CHECK_TIMEOUT"] * scale, MIN_TIMEOUT_S)
        self._tasks: list[asyncio.Task] = []

    # --- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready_handler)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/generate", self.generate)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/metrics", self.metrics)
        return app

    async def start(self) -> None:
        await self.bootstrap_client.start()
        self._tasks.append(asyncio.create_task(self.decode.run(), name="decode-loop"))
        self._tasks.append(asyncio.create_task(self.prefill.run(), name="prefill-loop"))
        self._tasks.append(asyncio.create_task(self._startup(), name="startup"))
        if self.mode == "prefill":
            self._tasks.append(asyncio.create_task(self._sweep_rooms(), name="room-sweeper"))

    async def stop(self) -> None:
        self.stopping = True
        self.decode.stop()
        self.prefill.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.bootstrap_client.close()

    async def _startup(self) -> None:
        startup = self.model.throughput.startup_s * self.scale
        captured = self.mode != "prefill" and decode_graphs_enabled(self.args)
        log.info("Load weight begin. avail mem=94.50 GB")
        await self.decode.load(startup * (0.5 if captured else 1.0))
        log.info("Load weight end. type=DeepseekV4ForCausalLM, dtype=torch.bfloat16, avail mem=22.10 GB")
        log.info("KV Cache is allocated. #tokens: 1000000")
        if captured:
            sizes = [b for b in CUDA_GRAPH_SIZES if b <= decode_graph_max_bs(self.args)]
            # as sglang 0.5.17 logs it (its decode log on the H200, reports/real_sglang)
            log.info(
                "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=%s, "
                "avail mem=21.90 GB",
                sizes,
            )
            t0 = time.monotonic()
            await self.decode.capture(sizes, startup * 0.5)
            log.info(
                "Capture target decode CUDA graph end. elapsed=%.2f s, mem usage=0.81 GB, "
                "avail mem=21.09 GB.",
                time.monotonic() - t0,
            )
        log.info(
            "max_total_num_tokens=1000000, chunked_prefill_size=%d, max_prefill_tokens=16384, "
            "max_running_requests=%d, context_len=163840",
            self.args.chunked_prefill_size,
            self.args.max_running_requests,
        )
        if self.mode in ("prefill", "decode"):
            log.info("End of disaggregation warmup (mode=%s)", self.mode)
        self.ready = True
        log.info(READY_LINE)

    async def _sweep_rooms(self) -> None:
        while True:
            await asyncio.sleep(10.0)
            self.bootstrap_state.sweep()

    # --- plain endpoints ---------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready or self.stopping:
            return web.Response(status=503, text="starting" if not self.ready else "shutting down")
        try:
            await asyncio.wait_for(self._health_generate(), self.health_timeout_s)
        except TimeoutError:
            return web.Response(status=503, text="health generate timed out")
        return web.Response(text="")

    async def _health_generate(self) -> None:
        """A 1-token generation through the scheduler, as SGLang's /health does."""
        if self.mode == "prefill":
            await self.prefill.prefill(1)
            return
        probe = DecodeRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex[:8]}",
            reply=None,
            tokens=["."],
            max_new_tokens=1,
            prompt_tokens=1,
            prefill_config=None,
        )
        self.decode.submit(probe)
        try:
            await probe.event.wait()
        finally:
            self.decode.abort(probe)

    async def ready_handler(self, request: web.Request) -> web.Response:
        ok = self.ready and not self.stopping
        return web.Response(status=200 if ok else 503, text="ready" if ok else "not ready")

    async def server_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = dict(vars(self.args))
        info["version"] = SIM_VERSION
        info["internal_states"] = [
            {
                "last_gen_throughput": self.counters.last_gen_throughput,
                "memory_usage": {"weight": 80.1, "kvcache": 20.4, "token_capacity": 1000000},
                "decode_cuda_graph_bs": list(range(1, decode_graph_max_bs(self.args) + 1))
                if decode_graphs_enabled(self.args)
                else [],
            }
        ]
        if self.env["SGLANG_EXPOSE_OWN_ENV_VARS"]:
            info["env"] = dict(self.raw_env)
        info["sim"] = {
            "kind": "heisenhunt-sim (a test target, not SGLang)",
            "instance": self.instance,
            "role": self.mode,
            "time_scale": self.scale,
            "fault_model": {"name": self.model.name, "source": self.model.source},
            "effective_env": dict(self.env),
            "env_warnings": list(self.env_warnings),
            "counters": self.counters.to_dict(),
            "decode_engine": self.decode.describe(),
            "running": len(self.decode.running),
            # the load the fault model uses now (engine.py module doc), and the sessions in it
            "modelled_load": self.decode.modelled_load_now(),
            "open_sessions": self.decode.sessions.now(),
            "sessions_opened": self.decode.sessions.opened,
            "session_idle_s": self.decode.sessions.idle_s,
            "recent_rooms": list(self.recent_rooms),
        }
        return web.json_response(info)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "deepseek_v4",
                "architectures": ["DeepseekV4ForCausalLM"],
                "tool_call_parser": self.args.tool_call_parser,
                "disaggregation_mode": self.mode,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": self.model_name,
                        "max_model_len": 163840,
                    }
                ],
            }
        )

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.decode.running:
            return web.Response(status=400, text="Cache not flushed because there are pending requests.")
        return web.Response(text="Cache flushed.")

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.args.enable_metrics:
            raise web.HTTPNotFound()
        c, labels = self.counters, f'model_name="{self.model_name}"'
        # SGLang's load gauges report the *modelled* load (engine.py): running = the running batch,
        # queue = the rest of it (queued, receiving KV, open sessions between their turns), so that
        # running + queue is the load the next turn of the session furthest behind would join
        running = len(self.decode.running)
        queued = max(len(self.decode.waiting), self.decode.modelled_load_now() - running)
        lines = [
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{labels}}} {c.tokens_generated}",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{labels}}} {c.prompt_tokens}",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{labels}}} {running}",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{labels}}} {queued}",
            "# TYPE heisenhunt_sim:open_sessions gauge",
            f"heisenhunt_sim:open_sessions{{{labels}}} {self.decode.sessions.now()}",
            "# TYPE sglang:gen_throughput gauge",
            f"sglang:gen_throughput{{{labels}}} {c.last_gen_throughput:.3f}",
            "# TYPE sglang:cuda_graph_passes_total counter",
            f'sglang:cuda_graph_passes_total{{{labels},mode="decode_cuda_graph"}} {c.captured_steps}',
            f'sglang:cuda_graph_passes_total{{{labels},mode="decode_none"}} {c.eager_steps}',
            "# TYPE sglang:num_bootstrap_failed_reqs_total counter",
            f"sglang:num_bootstrap_failed_reqs_total{{{labels}}} {c.bootstrap_failures}",
            "# TYPE sglang:num_transfer_failed_reqs_total counter",
            f"sglang:num_transfer_failed_reqs_total{{{labels}}} {c.transfer_failures}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # --- generation --------------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        with self.decode.holding():
            return await self._chat(request)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        with self.decode.holding():
            return await self._generate(request)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body, problem = await self._json_body(request)
        if problem is not None:
            return problem
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return web.json_response(error_body("messages must be a non-empty list", 400), status=400)
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        prompt_tokens = estimate_prompt_tokens(messages, tools)
        if self.mode == "prefill":
            return await self._prefill(request, body, prompt_tokens, chat=True)
        # the session the client names (a prompts file has no plan to read), else its plan's
        turn = tagged_turn(body.get("user")) or session_turn(messages)
        if turn is None:
            return (await self._chat_decode(request, body, messages, tools, max_tokens, prompt_tokens))[0]
        # a turn of a tool-calling session: the session is open on this decode from now (engine.py)
        key, round_index, last_round, turns = turn
        self.decode.sessions.begin(key, round_index)
        ends = True  # a turn that fails (or is cut off) ends its session: the client stops there
        try:
            response, req = await self._chat_decode(
                request, body, messages, tools, max_tokens, prompt_tokens, round_index, turns
            )
            ends = (
                last_round
                or req is None
                or req.shape is not None  # corrupted: the client's oracle stops the session here
                or req.aborted
                or response.status != 200
            )
            return response
        finally:
            self.decode.sessions.end(key, round_index, ends)

    async def _chat_decode(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        messages: list,
        tools: list | None,
        max_tokens: Any,
        prompt_tokens: int,
        session_round: int | None = None,
        session_turns: int | None = None,
    ) -> tuple[web.StreamResponse, DecodeRequest | None]:
        """The decode's (or a null server's) side of a chat: the hand-off, then the generation."""
        handoff, problem = await self._handoff(body, prompt_tokens)
        if problem is not None:
            return problem, None
        reply = agent.decide_reply(messages, tools, body.get("tool_choice", "auto"))
        tokens = agent.render(reply, max_tokens, bool(body.get("ignore_eos")))
        req = self._submit(reply, tokens, max_tokens, prompt_tokens, handoff, messages, tools)
        # before the decode loop runs again: it admits on our yield
        req.session_round, req.session_turns = session_round, session_turns
        req.ignore_eos = bool(body.get("ignore_eos"))
        rid = f"{uuid.uuid4().hex}"
        logprobs = body.get("logprobs") is True
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._chat_stream(request, req, rid, include_usage, logprobs), req
        await req.event.wait()
        while not req.done:
            req.event.clear()
            await req.event.wait()
        parsed = agent.parse_output(req.raw)
        calls = [self._tool_call(i, name, args) for i, (name, args) in enumerate(parsed.calls)]
        message = {
            "role": "assistant",
            "content": parsed.content or None,
            "reasoning_content": None,
            "tool_calls": calls or None,
        }
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": token_logprobs(req.tokens[: req.pos]) if logprobs else None,
                        "finish_reason": self._finish_reason(req, bool(calls)),
                        "matched_stop": None,
                    }
                ],
                "usage": self._usage(req),
            }
        ), req

    async def _chat_stream(
        self, request: web.Request, req: DecodeRequest, rid: str, include_usage: bool, logprobs: bool = False
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        created = int(time.time())

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created}
            head["model"] = self.model_name
            return b"data: " + _dumps({**head, "choices": choices, **extra}) + b"\n\n"

        sent_tokens = 0  # tokens whose logprobs went out (with logprobs: on the first chunk after them)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            nonlocal sent_tokens
            block = None
            if logprobs and (req.pos > sent_tokens or finish):
                block, sent_tokens = token_logprobs(req.tokens[sent_tokens : req.pos]), req.pos
            return event([{"index": 0, "delta": delta, "logprobs": block, "finish_reason": finish}])

        sent_content, sent_calls = 0, []  # chars of content sent; per call: chars of arguments sent
        try:
            await response.write(chunk({"role": "assistant", "content": ""}))
            while True:
                await req.event.wait()
                req.event.clear()
                parsed = agent.parse_output(req.raw)
                out = []
                if len(parsed.content) > sent_content:
                    out.append(chunk({"content": parsed.content[sent_content:]}))
                    sent_content = len(parsed.content)
                for i, (name, args) in enumerate(parsed.calls):
                    if i >= len(sent_calls):
                        call = self._tool_call(i, name, "")
                        out.append(chunk({"tool_calls": [call]}))
                        sent_calls.append(0)
                    if len(args) > sent_calls[i]:
                        delta = {
                            "index": i,
                            "id": None,
                            "type": "function",
                            "function": {"name": None, "arguments": args[sent_calls[i] :]},
                        }
                        out.append(chunk({"tool_calls": [delta]}))
                        sent_calls[i] = len(args)
                if req.done:
                    out.append(chunk({}, self._finish_reason(req, bool(parsed.calls))))
                    if include_usage:  # SGLang's usage chunk: no choices, only usage
                        out.append(event([], usage=self._usage(req)))
                    out.append(b"data: [DONE]\n\n")
                if out:
                    await response.write(b"".join(out))
                if req.done:
                    break
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self.decode.abort(req)
            raise
        return response

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body, problem = await self._json_body(request)
        if problem is not None:
            return problem
        params = body.get("sampling_params") or {}
        text = body.get("text", "")
        prompt_tokens = (
            len(body["input_ids"])
            if isinstance(body.get("input_ids"), list)
            else estimate_prompt_tokens(text, None)
        )
        if self.mode == "prefill":
            return await self._prefill(request, body, prompt_tokens, chat=False)
        handoff, problem = await self._handoff(body, prompt_tokens)
        if problem is not None:
            return problem
        max_new = params.get("max_new_tokens", 128)
        tokens = agent.render(agent.Reply(), max_new, bool(params.get("ignore_eos")))
        req = self._submit(None, tokens, max_new, prompt_tokens, handoff, (), None)
        rid = uuid.uuid4().hex

        def payload() -> dict[str, Any]:
            finish = None
            if req.done:
                finish = (
                    {"type": "length", "length": req.pos}
                    if req.finish_length
                    else {"type": "stop", "matched": None}
                )
            return {
                "text": req.raw,
                "meta_info": {
                    "id": rid,
                    "finish_reason": finish,
                    "prompt_tokens": req.prompt_tokens,
                    "completion_tokens": req.pos,
                    "cached_tokens": 0,
                },
            }

        if not body.get("stream"):
            while not req.done:
                await req.event.wait()
                req.event.clear()
            return web.json_response(payload())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await req.event.wait()
                req.event.clear()
                await response.write(b"data: " + _dumps(payload()) + b"\n\n")
                if req.done:
                    await response.write(b"data: [DONE]\n\n")
                    break
        except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
            self.decode.abort(req)
            raise
        return response

    # --- helpers -----------------------------------------------------------------------------

    async def _json_body(self, request: web.Request) -> tuple[dict[str, Any], web.Response | None]:
        if not self.ready:
            return {}, web.json_response(
                error_body("server is starting", 503, "ServiceUnavailable"), status=503
            )
        try:
            body = await request.json()
        except ValueError as e:
            return {}, web.json_response(error_body(f"invalid JSON body: {e}", 400), status=400)
        if not isinstance(body, dict):
            return {}, web.json_response(error_body("the body must be a JSON object", 400), status=400)
        return body, None

    def _bootstrap_target(self, body: Mapping[str, Any]) -> tuple[str, int, int] | None:
        room = body.get("bootstrap_room")
        if room is None:
            return None
        host = body.get("bootstrap_host") or "127.0.0.1"
        port = body.get("bootstrap_port") or self.args.disaggregation_bootstrap_port
        return str(host), int(port), int(room)

    async def _handoff(
        self, body: Mapping[str, Any], prompt_tokens: int
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        """Decode: the prefill's hand-off for this request's room. Null mode: our own config."""
        if self.mode != "decode":  # co-located ("null" mode): prefill here, with our own config
            await self.prefill.prefill(prompt_tokens)
            return {"prefill_config": self.config.to_dict()}, None
        target = self._bootstrap_target(body)
        if target is None:
            message = (
                "bootstrap_room is required in disaggregation decode mode (send requests through the router)"
            )
            return None, web.json_response(error_body(message, 400), status=400)
        host, port, room = target
        self.recent_rooms.append(room)
        started = time.monotonic()
        try:
            return await self.bootstrap_client.fetch(host, port, room), None
        except BootstrapFailed as e:
            waited = time.monotonic() - started
            if e.phase == "Bootstrapping":
                self.counters.bootstrap_failures += 1
                log.error("Decode handshake failed for request rank=0 bootstrap_room=%d: %s", room, e)
            else:
                self.counters.transfer_failures += 1
            log.error("Request %d timed out after %.1fs in KVPoll.%s", room, waited, e.phase)
            message = (
                f"Request {room} aborted: KV hand-off from the prefill at {host}:{port} failed in "
                f"KVPoll.{e.phase} after {waited:.1f}s: {e}"
            )
            return None, web.json_response(error_body(message, 500, "InternalServerError"), status=500)

    async def _prefill(
        self, request: web.Request, body: Mapping[str, Any], prompt_tokens: int, chat: bool
    ) -> web.Response:
        target = self._bootstrap_target(body)
        if target is None:
            message = (
                "bootstrap_room is required in disaggregation prefill mode (send requests through the router)"
            )
            return web.json_response(error_body(message, 400), status=400)
        room = target[2]
        self.recent_rooms.append(room)
        self.counters.requests += 1
        self.bootstrap_state.note_prefill(room)
        await self.prefill.prefill(prompt_tokens)
        handoff = {
            "room": room,
            "prefill_instance": self.instance,
            "prompt_tokens": prompt_tokens,
            "prefill_config": self.config.to_dict(),
        }
        try:
            await self.bootstrap_state.transfer(room, handoff, self.bootstrap_timeout_s)
        except BootstrapFailed as e:
            self.counters.bootstrap_failures += 1
            log.error("Prefill bootstrap failed for request rank=0 bootstrap_room=%d: %s", room, e)
            message = f"Request {room} aborted: prefill bootstrap failed: {e}"
            return web.json_response(error_body(message, 500, "InternalServerError"), status=500)
        self.counters.finished_requests += 1
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1}
        if not chat:
            return web.json_response(
                {
                    "text": "",
                    "meta_info": {
                        "id": uuid.uuid4().hex,
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": 1,
                        "finish_reason": None,
                    },
                }
            )
        return web.json_response(
            {
                "id": uuid.uuid4().hex,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}
                ],
                "usage": usage,
            }
        )

    def _submit(self, reply, tokens, max_tokens, prompt_tokens, handoff, messages, tools) -> DecodeRequest:
        prefill_config = RoleConfig.from_dict(handoff["prefill_config"]) if handoff else None
        req = DecodeRequest(
            rid=uuid.uuid4().hex,
            reply=reply,
            tokens=tokens,
            max_new_tokens=int(max_tokens) if max_tokens else None,
            prompt_tokens=handoff.get("prompt_tokens", prompt_tokens) if handoff else prompt_tokens,
            prefill_config=prefill_config,
            messages=messages,
            tools=tools,
        )
        self.decode.submit(req)
        return req

    @staticmethod
    def _tool_call(index: int, name: str, arguments: str) -> dict[str, Any]:
        return {
            "index": index,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }

    @staticmethod
    def _finish_reason(req: DecodeRequest, called: bool) -> str:
        if req.finish_length:
            return "length"
        return "tool_calls" if called else "stop"

    @staticmethod
    def _usage(req: DecodeRequest) -> dict[str, Any]:
        return {
            "prompt_tokens": req.prompt_tokens,
            "completion_tokens": req.pos,
            "total_tokens": req.prompt_tokens + req.pos,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
        }


def token_logprobs(tokens: Sequence[str]) -> dict[str, Any]:
    """OpenAI's logprobs block for generated tokens (the sim's model is certain: logprob 0)."""
    return {
        "content": [
            {
                "token": t,
                "logprob": 0.0,
                "bytes": list(t.encode("utf-8", "surrogatepass")),
                "top_logprobs": [],
            }
            for t in tokens
        ]
    }


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[%(asctime)s DP0 TP0] %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("aiohttp.server").addFilter(_quiet_http2_probe)


def _quiet_http2_probe(record: logging.LogRecord) -> bool:
    """sglang-router probes workers with an HTTP/2 preface; an HTTP/1.1 server rejects it (as uvicorn
    does). Keep that to one short line instead of a traceback per probe."""
    exc = record.exc_info[1] if record.exc_info else None
    if exc is not None and "PRI/Upgrade" in str(exc):
        record.msg, record.args, record.exc_info, record.exc_text = (
            "rejected an HTTP/2 preface (HTTP/1.1 only)",
            (),
            None,
            None,
        )
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger("aiohttp.server").isEnabledFor(logging.DEBUG)
    return True


async def serve(server: SimServer) -> None:
    args = server.args
    runner = web.AppRunner(server.app(), access_log=None, handle_signals=False)
    await runner.setup()
    sites = [web.TCPSite(runner, args.host, args.port, reuse_address=True)]
    boot_runner = None
    if server.mode == "prefill":
        boot_runner = web.AppRunner(server.bootstrap_state.app(), access_log=None, handle_signals=False)
        await boot_runner.setup()
        sites.append(
            web.TCPSite(boot_runner, args.host, args.disaggregation_bootstrap_port, reuse_address=True)
        )
    for site in sites:
        await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    await stop.wait()
    log.info("Received signal; shutting down")
    server.stopping = True
    await runner.cleanup()
    if boot_runner is not None:
        await boot_runner.cleanup()
    await server.stop()


def override_args(args, raw: str | None) -> None:
    """Apply `HEISENHUNT_SIM_OVERRIDE_ARGS` (module doc) to the parsed args, one warning line per dest.
    ValueError names the variable, the bad dest and what is accepted."""
    if raw is None or not raw.strip():
        return
    try:
        changes = apply_overrides(args, parse_overrides(raw))
    except ValueError as e:
        raise ValueError(f"{OVERRIDE_ARGS_ENV}: {e}") from e
    for dest, old, new in changes:
        log.warning("Overriding %s=%r -> %r (%s)", dest, old, new, OVERRIDE_ARGS_ENV)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    for warning in deprecation_warnings(args):
        log.warning("%s", warning)
    try:
        override_args(args, os.environ.get(OVERRIDE_ARGS_ENV))
        scale = parse_time_scale(os.environ.get(TIME_SCALE_ENV))
        parse_session_idle(os.environ.get(SESSION_IDLE_ENV))
        model = load_fault_model(os.environ.get(FAULT_MODEL_ENV) or None)
    except (ValueError, FaultModelError) as e:
        log.error("%s", e)
        return 2
    server = SimServer(args, os.environ, model, scale)
    log.info("server_args=ServerArgs(%s)", ", ".join(f"{k}={v!r}" for k, v in sorted(vars(args).items())))
    log.info(
        "heisenhunt simulated SGLang server (a test target, not SGLang): role=%s, fault model %r from %s, "
        "time scale %g",
        server.mode,
        model.name,
        model.source,
        scale,
    )
    for warning in server.env_warnings:
        log.warning("%s", warning)
    try:
        asyncio.run(serve(server))
    except OSError as e:  # e.g. the port is taken
        log.error("cannot serve: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
