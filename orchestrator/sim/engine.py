"""The simulated schedulers: a prefill loop and a decode loop that batch like a real engine.

The decode loop runs one scheduler step at a time: admit waiting requests (their KV has arrived),
sleep the modelled step time for the running batch (captured graph up to `--cuda-graph-max-bs-decode`,
eager above it or everywhere when decode graphs are off: `--disable-decode-cuda-graph` or the
deprecated `--disable-cuda-graph`, `args.decode_graphs_enabled`), then advance every running request
by one token. There is no per-request sleep: throughput and latency come from the batch, as on a GPU.
When a planned tool-call request joins the batch, the fault model's rule for (prefill config,
decode config) gives the probability, over the decode's *modelled load*, that its output is
corrupted, and with which shape. A rule with `restart_icc` has its start's draw made once, when the
engine is built at server start-up (`faults.draw_restart_quantiles`), and shifts that probability for
the whole life of the process. All sleeps are multiplied by the time scale.

The modelled load of a turn (`DecodeEngine.modelled_load`) is the largest of
- the running batch,
- the requests the decode holds (running, queued, or still receiving their KV), and
- the tool-calling sessions open on the decode, as a turn at this turn's round sees them (`SessionLoad`).
Why sessions: on a GPU the client's turnaround between turns (oracle, JSON, the next request) is
negligible next to decode time, so every open session is in the decode's batch nearly all the time. The
sim compresses GPU time (the time scale), which makes that client time comparable to the modelled GPU
time: counting only the requests held let the load, and with it the corruption rate, follow how fast
and how busy the host was (issue 17: the same study gave 8.9% on a loaded 2-core host, 20% idle).
Counting open sessions makes it follow the workload's concurrency.

A session is known by its conversation (the task id of its first user message, `session_turn`). It is
open from its first turn until its last planned round ends, until a turn of it fails or is corrupted
(the client stops there), or until it has been silent for `HEISENHUNT_SIM_SESSION_IDLE_S` wall seconds
(default 10: longer than a client's turnaround between two turns, on a loaded host too). A session
that ended at round k still counts, for the same window, in the load of turns at rounds <= k: in the
modelled timeline (no client time) the sessions of a workload advance round by round together, so it
was still in the batch when a slow client's laggard reached that round; unless a new session has taken
its place since (a client that keeps C sessions at once starts the next when one ends: the load stays
C). `HEISENHUNT_SIM_SESSION_IDLE_S=0` counts a session only while the decode holds one of its turns:
the load model before issue 17. The decode's `/metrics` and `/server_info` report the modelled load as
the next turn of the session furthest behind would see it (`modelled_load_now`).

The prefill loop takes queued prompts up to `--chunked-prefill-size` tokens per batch and sleeps the
modelled prefill time of the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.sim import agent
from orchestrator.sim.args import decode_graph_max_bs, decode_graphs_enabled
from orchestrator.sim.faults import (
    FaultModel,
    RoleConfig,
    Rule,
    draw_restart_quantiles,
    restart_rate,
    session_rate,
)
from orchestrator.workload import tasks

log = logging.getLogger("sglang.sim.scheduler")

SESSION_IDLE_ENV = "HEISENHUNT_SIM_SESSION_IDLE_S"
DEFAULT_SESSION_IDLE_S = 10.0
# the shape of a benign flip, and its draw's key among the start's restart quantiles
BATCH_VARIANCE = "batch_variance"
# the first user message of a stress session: "Task <task id>: perform the following plan ..."
_TASK_RE = re.compile(r"^Task (\S+?):")


def parse_session_idle(raw: str | None) -> float:
    """`HEISENHUNT_SIM_SESSION_IDLE_S`: wall seconds a silent session stays open (unset: 10)."""
    if raw is None or raw.strip() == "":
        return DEFAULT_SESSION_IDLE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"{SESSION_IDLE_ENV} must be a finite number of seconds >= 0 (0: a session counts only while "
            f"the decode holds one of its requests), got {raw!r}"
        )
    return value


def tagged_turn(user: Any) -> tuple[str, int, bool, int] | None:
    """(session key, round index, whether it is the last turn, turns) from the OpenAI `user` field a
    heisenhunt client sends with a session's turns (`tasks.session_tag`: a prompts file's conversations
    carry no plan to read them from), or None."""
    tag = tasks.parse_session_tag(user)
    if tag is None:
        return None
    key, round_index, turns = tag
    return key, round_index, round_index == turns - 1, turns


def session_turn(messages: Sequence[Mapping[str, Any]]) -> tuple[str, int, bool, int] | None:
    """(session key, round index, whether it is the last planned round, planned rounds) for a turn of a
    planned tool-calling session, or None for any other request. The key is the task id of the first user
    message (a digest of that message when it names none); the round is the number of tool results so
    far."""
    if not isinstance(messages, list | tuple) or not all(isinstance(m, Mapping) for m in messages):
        return None
    plan = tasks.parse_plan(messages)
    if not plan:
        return None
    round_index = tasks.rounds_done(messages)
    if round_index >= len(plan):
        return None  # the plan is done: the closing DONE turn is no planned round
    users = (m.get("content") for m in messages if m.get("role") == "user")
    first = next(c for c in users if isinstance(c, str))  # the message parse_plan read the plan from
    found = _TASK_RE.match(first)
    key = found.group(1) if found else hashlib.sha256(first.encode("utf-8", "replace")).hexdigest()[:16]
    return key, round_index, round_index == len(plan) - 1, len(plan)


class SessionLoad:
    """The tool-calling sessions open on the decode, as a turn at a given round sees them. Pure: the
    clock is injected.

    `begin(key, round)` when a turn of session `key` reaches the decode (before its KV arrives);
    `end(key, round, last)` when that turn's response is over, `last` when the session ends with it
    (its last planned round, or a turn that failed or was corrupted: the client stops there).

    `open(round)` counts, for a turn at round `round` joining now:
    - the sessions the decode holds a turn of;
    - the sessions between two turns, for up to `idle_s` seconds after their last turn ended (a silent
      session is gone after that: its client left);
    - the sessions that ended at a round >= `round`, for up to `idle_s` seconds, unless a new session
      has replaced them since (a session opening at round 0 takes the place of the latest one that
      ended: its client moved on to the next session).
    The last rule is the modelled timeline: with no client time between turns (a GPU's case) the
    sessions of a workload advance round by round together, so a session that ended at round k was
    still in the batch of every turn at a round <= k, however late a slow client sends that turn. A
    turn of no session (`round` None) counts every session the three rules name.
    A session that goes on after a turn that ended it (a client that notes a finding and carries on)
    is open again, and no longer counted as ended.
    `now()`: the load the next turn of the session furthest behind would see (0 when no session is
    open): what the decode's load gauges report.
    With `idle_s` 0 only the first rule is left: the sessions the decode holds a turn of.
    """

    def __init__(self, idle_s: float = DEFAULT_SESSION_IDLE_S, clock: Callable[[], float] = time.monotonic):
        if not idle_s >= 0:
            raise ValueError(f"idle_s must be >= 0, got {idle_s!r}")
        self.idle_s = float(idle_s)
        self.clock = clock
        self._held: dict[str, list[int]] = {}  # key -> rounds of its turns the decode holds now
        self._idle: dict[str, tuple[float, int]] = {}  # key -> (when its last turn ended, next round)
        # (when, last round, key) of the sessions that ended, oldest first
        self._ended: list[tuple[float, int, str]] = []
        self.opened = 0  # sessions seen opening (a key that starts over at round 0 counts again)
        self.max_open = 0  # the largest `now()` seen at a turn's start

    def begin(self, key: str, round_index: int) -> None:
        self._expire()
        resumed = [i for i, (_, _, k) in enumerate(self._ended) if k == key and round_index > 0]
        if resumed:  # it went on after a turn that looked like its end (e.g. a finding the client notes)
            del self._ended[resumed[-1]]
        elif key not in self._held and key not in self._idle:
            self.opened += 1
            if round_index == 0 and self._ended:
                self._ended.pop()  # a new session in the place of the latest one that ended
        self._held.setdefault(key, []).append(round_index)
        self._idle.pop(key, None)
        self.max_open = max(self.max_open, self.now())

    def end(self, key: str, round_index: int, last: bool) -> None:
        rounds = self._held.get(key)
        if not rounds:
            return
        if round_index in rounds:
            rounds.remove(round_index)
        else:
            rounds.pop()
        if rounds:
            return
        del self._held[key]
        if self.idle_s > 0:
            if last:
                self._ended.append((self.clock(), round_index, key))
            else:
                self._idle[key] = (self.clock(), round_index + 1)

    def open(self, round_index: int | None = None) -> int:
        self._expire()
        ended = sum(1 for _, last, _ in self._ended if round_index is None or last >= round_index)
        return len(self._held) + len(self._idle) + ended

    def now(self) -> int:
        self._expire()
        behind = [min(r) for r in self._held.values()] + [r for _, r in self._idle.values()]
        return self.open(min(behind)) if behind else 0

    def _expire(self) -> None:
        horizon = self.clock() - self.idle_s
        for key in [k for k, (t, _) in self._idle.items() if t < horizon]:
            del self._idle[key]
        while self._ended and self._ended[0][0] < horizon:
            self._ended.pop(0)


@dataclass
class SimCounters:
    """The sim's own account of its work (exposed in /server_info and /metrics)."""

    tokens_generated: int = 0
    prompt_tokens: int = 0
    busy_time_s: float = 0.0  # wall seconds the decode loop spent in steps (scaled)
    model_time_s: float = 0.0  # modelled GPU seconds of those steps (unscaled)
    decode_steps: int = 0
    max_batch: int = 0  # largest running batch seen
    planned_turns: int = 0  # tool-call turns the fault model could corrupt
    planned_load_sum: int = 0  # sum over those turns of the load they joined (mean = sum / turns)
    max_load: int = 0  # largest modelled load a planned turn joined
    captured_steps: int = 0
    eager_steps: int = 0
    requests: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    corrupted_turns: int = 0
    corrupted_by_shape: Counter = field(default_factory=Counter)
    text_turns: int = 0  # turns of free text the fault model or batch variance could change
    benign_flips: int = 0  # of those, changed by batch variance alone (no fault)
    bootstrap_failures: int = 0
    transfer_failures: int = 0
    prefill_batches: int = 0
    last_gen_throughput: float = 0.0
    # rule -> this start's quantile of its between-start rate distribution (rules with restart_icc)
    restart_quantiles: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in vars(self).items() if k != "corrupted_by_shape"}
        data["corrupted_by_shape"] = dict(self.corrupted_by_shape)
        return data


@dataclass(eq=False)
class DecodeRequest:
    rid: str
    reply: agent.Reply | None  # None: an internal health-check request
    tokens: list[str]
    max_new_tokens: int | None
    prompt_tokens: int
    prefill_config: RoleConfig | None
    messages: Sequence[Mapping[str, Any]] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    pos: int = 0
    done: bool = False
    aborted: bool = False
    finish_length: bool = False
    batch_at_admission: int = 0
    session_round: int | None = None  # the round of its tool-calling session (None: of no session)
    session_turns: int | None = None  # the turns its session has, where the client says (server.py)
    ignore_eos: bool = False  # benchmark traffic: never judged, so never changed
    shape: str | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def raw(self) -> str:
        return "".join(self.tokens[: self.pos])


class DecodeEngine:
    def __init__(
        self,
        model: FaultModel,
        config: RoleConfig,
        scale: float,
        counters: SimCounters,
        rng: random.Random,
        log_interval: int = 40,
    ):
        self.model = model
        self.config = config
        self.scale = scale
        self.counters = counters
        self.rng = rng
        self.log_interval = max(1, int(log_interval))
        args = config.args
        self.max_running = int(args.get("max_running_requests") or 256)
        self.graph_enabled = decode_graphs_enabled(args)
        self.max_graph_bs = decode_graph_max_bs(args)
        self.multi_stream = bool(config.env.get("SGLANG_OPT_USE_MULTI_STREAM_OVERLAP", True))
        # batch-invariant kernels: no batch variance (_variance_probability), slower steps
        self.deterministic = bool(args.get("enable_deterministic_inference"))
        self.stream_interval = max(1, int(args.get("stream_interval") or 1))
        # once per server start: where this start's rate lies for each rule with restart_icc
        self.restart_quantiles = draw_restart_quantiles(model.rules, rng)
        if model.batch_variance is not None and model.batch_variance.restart_icc > 0:
            self.restart_quantiles[BATCH_VARIANCE] = rng.random()
        counters.restart_quantiles = dict(self.restart_quantiles)
        if self.restart_quantiles:
            log.info(
                "restart draw (quantile of the between-start rate, per rule): %s", self.restart_quantiles
            )
        self.waiting: deque[DecodeRequest] = deque()
        self.running: list[DecodeRequest] = []
        self.inflight = 0  # requests held by the server: receiving KV, queued or running
        # tool-calling sessions open on this decode (the server replaces it to set the idle window)
        self.sessions = SessionLoad()
        self._wake = asyncio.Event()
        self._stopped = False
        self._log_tokens = 0
        self._log_since = time.monotonic()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Count a request the server holds for this decode (receiving its KV, queued or running)."""
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    def submit(self, request: DecodeRequest) -> None:
        self.counters.requests += 1
        self.waiting.append(request)
        self._wake.set()

    def abort(self, request: DecodeRequest) -> None:
        if not request.done:
            request.aborted = True
            self.counters.aborted_requests += 1

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while not self._stopped:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()  # idle: the next step starts now
                continue
            admitted = []
            while self.waiting and len(self.running) < self.max_running:
                request = self.waiting.popleft()
                if not request.aborted:
                    self.running.append(request)
                    admitted.append(request)
            batch = len(self.running)
            if batch == 0:
                continue
            # the fault's "batch": the modelled load (module doc), not the running batch alone
            for request in admitted:
                self._admit(request, self.modelled_load(request.session_round))
            captured = self.graph_enabled and batch <= self.max_graph_bs
            step = self.model.throughput.step_s(batch, captured, self.multi_stream, self.deterministic)
            # absolute deadlines: sleep overshoot does not accumulate, but never catch up more than a step
            now = loop.time()
            clock = max(clock, now - step * self.scale) + step * self.scale
            # always yield: with time scale 0 a step has no duration but other tasks must run
            await asyncio.sleep(max(0.0, clock - now))
            await self._device_step(captured)
            self._advance(step, captured, batch)

    def modelled_load(self, round_index: int | None = None) -> int:
        """The load a request joining the batch now sees (module doc): the largest of the running batch,
        the requests held (running, queued, receiving KV) and the sessions open on this decode for a
        turn at `round_index` (`SessionLoad.open`; None: a request of no session)."""
        return max(len(self.running), self.inflight, self.sessions.open(round_index))

    def modelled_load_now(self) -> int:
        """The modelled load as the decode's load gauges report it: the largest of the running batch,
        the requests held, and the sessions the next turn of the session furthest behind would see
        (`SessionLoad.now`)."""
        return max(len(self.running), self.inflight, self.sessions.now())

    # --- hooks for a decode engine that does real device work (orchestrator.gpu); none here -------

    async def load(self, modelled_s: float) -> None:
        """Load the weights (server start-up)."""
        await asyncio.sleep(modelled_s)

    async def capture(self, sizes: Sequence[int], modelled_s: float) -> None:
        """Capture one decode graph per batch size (server start-up, unless decode graphs are off)."""
        await asyncio.sleep(modelled_s)

    async def _device_step(self, captured: bool) -> None:
        """The device work of one step for `self.running`, after its modelled duration."""

    def describe(self) -> dict[str, Any]:
        """This engine's block of /server_info."""
        return {"kind": "simulated (fault model)"}

    def _admit(self, request: DecodeRequest, batch: int) -> None:
        request.batch_at_admission = batch
        reply = request.reply
        if reply is not None and reply.call is None and request.prefill_config is not None:
            if not request.ignore_eos:
                self._free_text(request, batch)
        elif reply is not None and reply.planned and request.prefill_config is not None:
            self.counters.planned_turns += 1
            self.counters.planned_load_sum += batch
            self.counters.max_load = max(self.counters.max_load, batch)
            rule = self.model.rule_for(request.prefill_config, self.config)
            if rule is not None and self.rng.random() < self._turn_probability(rule, request, batch):
                shapes = list(rule.shapes)
                request.shape = self.rng.choices(shapes, weights=[rule.shapes[s] for s in shapes])[0]
                request.tokens = agent.corrupt(
                    request.reply,
                    request.shape,
                    self.rng,
                    request.messages,
                    request.tools,
                    request.max_new_tokens,
                )
                self.counters.corrupted_turns += 1
                self.counters.corrupted_by_shape[request.shape] += 1
                log.debug(
                    "request %s corrupted (%s) at batch %d by rule %s",
                    request.rid,
                    request.shape,
                    batch,
                    rule.name,
                )
        # no room left for the end-of-sequence token: the request ends by length, as with ignore_eos
        if request.max_new_tokens is not None and len(request.tokens) >= request.max_new_tokens:
            request.tokens = request.tokens[: request.max_new_tokens]
            request.finish_length = True
        if not request.tokens:
            request.tokens = [""]  # a generation is at least one step

    def _free_text(self, request: DecodeRequest, batch: int) -> None:
        """A turn of free text: the modelled race changes it with the rule's probability (shape
        `diverged`), else batch variance alone may (`batch_variance`); either way the output is the
        reply's up to a point, then another continuation (agent.diverge)."""
        self.counters.text_turns += 1
        rule = self.model.rule_for(request.prefill_config, self.config)
        if rule is not None and self.rng.random() < self._turn_probability(rule, request, batch):
            request.shape = "diverged"
            self.counters.corrupted_turns += 1
            self.counters.corrupted_by_shape[request.shape] += 1
        elif self.rng.random() < self._variance_probability(request, batch):
            request.shape = BATCH_VARIANCE
            self.counters.benign_flips += 1
        if request.shape is not None:
            request.tokens = agent.diverge(request.tokens, self.rng)

    def _variance_probability(self, request: DecodeRequest, batch: int) -> float:
        variance = self.model.batch_variance
        if variance is None or self.deterministic:
            return 0.0  # none modelled, or batch-invariant kernels on the decode that generates
        p = variance.probability(batch)
        quantile = self.restart_quantiles.get(BATCH_VARIANCE)
        if quantile is None or p in (0.0, 1.0):
            return p
        turns = self._session_turns(request)
        rate = restart_rate(session_rate(p, turns), quantile, variance.restart_icc)
        return 1.0 - (1.0 - rate) ** (1.0 / turns)

    @staticmethod
    def _session_turns(request: DecodeRequest) -> int:
        """The turns of the request's session: as its client says, else its plan's, else one."""
        return request.session_turns or len(tasks.parse_plan(request.messages) or ()) or 1

    def _turn_probability(self, rule: Rule, request: DecodeRequest, batch: int) -> float:
        quantile = self.restart_quantiles.get(rule.name)
        if quantile is None:
            return rule.probability(batch)
        return rule.turn_probability(batch, self._session_turns(request), quantile)

    def _advance(self, step: float, captured: bool, batch: int) -> None:
        c = self.counters
        c.decode_steps += 1
        c.max_batch = max(c.max_batch, batch)
        c.busy_time_s += step * self.scale
        c.model_time_s += step
        if captured:
            c.captured_steps += 1
        else:
            c.eager_steps += 1
        keep = []
        for request in self.running:
            if request.aborted:
                continue
            request.pos += 1
            c.tokens_generated += 1
            if request.pos >= len(request.tokens):
                request.done = True
                c.finished_requests += 1
                request.event.set()
            else:
                keep.append(request)
                if request.pos % self.stream_interval == 0:
                    request.event.set()
        self._log_tokens += batch
        self.running = keep
        if c.decode_steps % self.log_interval == 0:
            self._log_batch(batch, captured)

    def _log_batch(self, batch: int, captured: bool) -> None:
        now = time.monotonic()
        throughput = self._log_tokens / max(now - self._log_since, 1e-9)
        self.counters.last_gen_throughput = throughput
        self._log_tokens, self._log_since = 0, now
        tokens = sum(r.prompt_tokens + r.pos for r in self.running)
        # a PD decode server's line carries its KV-transfer queues too (sglang 0.5.17, as the H200 run
        # logged it: tests/real_sglang_lines/decode.log); the sim hands KV over at once, so they are 0
        pd = (
            "pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, "
            if self.config.role == "decode"
            else ""
        )
        log.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %scuda graph: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            batch,
            tokens,
            min(1.0, tokens / 1_000_000),
            pd,
            captured,
            throughput,
            len(self.waiting),
        )


@dataclass(eq=False)
class PrefillJob:
    tokens: int
    future: asyncio.Future


class PrefillEngine:
    def __init__(
        self, prefill_s: Callable[[int], float], scale: float, counters: SimCounters, chunk_tokens: int = 8192
    ):
        self.prefill_s = prefill_s
        self.scale = scale
        self.counters = counters
        self.chunk_tokens = max(1, int(chunk_tokens))
        self.queue: deque[PrefillJob] = deque()
        self._wake = asyncio.Event()
        self._stopped = False

    async def prefill(self, tokens: int) -> None:
        """Wait until a batch containing this prompt has been prefilled."""
        job = PrefillJob(tokens, asyncio.get_running_loop().create_future())
        self.queue.append(job)
        self._wake.set()
        await job.future

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopped:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, total = [], 0
            while self.queue and (not batch or total + self.queue[0].tokens <= self.chunk_tokens):
                job = self.queue.popleft()
                batch.append(job)
                total += job.tokens
            started = time.monotonic()
            await asyncio.sleep(self.prefill_s(total) * self.scale)
            self.counters.prefill_batches += 1
            self.counters.prompt_tokens += total
            log.info(
                "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: 0, token usage: 0.00, "
                "#running-req: 0, #queue-req: %d, input throughput (token/s): %.2f",
                len(batch),
                total,
                len(self.queue),
                total / max(time.monotonic() - started, 1e-9),
            )
            for job in batch:
                if not job.future.done():
                    job.future.set_result(None)
