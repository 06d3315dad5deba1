"""The tool-calling stress workload: S sessions x R rounds, each turn judged by the oracle.

Each session gets a seeded task (tasks.py) that asks for a known sequence of tool calls. Every
round it sends the whole conversation so far (growing context, shared system prompt and tools: the
prefix reuse that exercises HiCache), streams the assistant turn, runs the oracle (detect.py) on it,
appends the assistant message and a synthetic tool result, and goes on. A session ends as
- `corrupted` at the first turn the oracle rejects (the turn, its detector and raw bytes are kept),
- `errored` at the first transport failure (HTTP error, timeout, reset, server gone),
- `clean` after R good rounds.

Outputs, under `out_dir`:
- `sessions.jsonl`: one `SessionOutcome.to_dict()` line per session, written and flushed as each
  session completes, so a crash or a kill keeps every finished session;
- `summary.json`: the `StressSummary` plus `partial`, errors by kind and the run's settings;
- `corrupted/<session_id>.json`: the conversation up to the bad turn and that turn in full
  (content, reasoning, tool calls, the raw SSE body);
- `transcripts/<session_id>.json` (with `keep_transcripts`): every turn of every session, each with
  its finding, so the oracle's calls can be checked by hand or by a test.

Detector families (detect.FAMILIES): `count` says which end a session as corrupted (default: all, as
the original hunt counted). A finding of another family (say `plan_drift` against a weak model, whose
well-formed calls stray from the plan) is noted in the outcome, counted per family in the summary, and
the session goes on. A run where no session reached an outcome (all errored) says so in its summary's
`warnings` and the CLI exits 1; so does a server that sends no usage block (token counts unknown).

Interruption (Ctrl-C, or the caller cancelling the task): sessions still in flight are *left out*
(no JSONL line: they have no outcome), `summary.json` is written with `planned` > `sessions`
(`partial`), and the cancellation propagates (KeyboardInterrupt from `run_stress_sync`).

Other oracles and prompts (docs/symptoms.md): `oracle="divergence"` runs every session alone first (the
batch-1 reference pass, `reference_session`) and then all of them under load, each turn the very request
of its reference turn, judged by divergence.py (`run_divergence_session`); `prompts` replays a JSONL file's
conversations (prompts.py) instead of the built-in tasks, under either oracle (`run_replayed_session` for
the tool-call one).

At most `concurrency` sessions run at once (default: all); one HTTP connection pool serves them all.
From code: `run_stress_sync(StressSettings(url=..., out_dir=..., sessions=60, rounds=4))`.
Standalone: `python -m orchestrator.workload.stress --url URL --sessions 60 --rounds 4 --out DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TextIO

from orchestrator.workload import divergence
from orchestrator.workload.client import chat_payload, open_session, run_sync, stream_body
from orchestrator.workload.detect import (
    DEFAULT_COUNTED,
    FAMILIES,
    Finding,
    check_turn,
    counted_families,
    family_of,
    family_problems,
)
from orchestrator.workload.fill import fill
from orchestrator.workload.prompts import (
    Conversation,
    ReplayTurn,
    answer_finding,
    load_prompts,
    replay_turns,
    session_conversation,
    session_id,
)
from orchestrator.workload.results import BadTurn, SessionOutcome, StreamedTurn, StressSummary
from orchestrator.workload.tasks import (
    TOOL_CHOICES,
    TOOLS,
    Task,
    initial_messages,
    make_task,
    session_tag,
    tool_choice_for,
    tool_result,
)
from orchestrator.workload.wire import RequestError, dumps

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024
# the oracles this workload runs (a reproducer is the user's own: reproducer.py)
STRESS_ORACLES = ("tool_calls", "divergence")


def assistant_message(turn: StreamedTurn) -> dict[str, Any]:
    """The turn as it goes back into the conversation (reasoning is not sent back, as DeepSeek asks)."""
    # "" rather than null beside tool calls: OpenAI takes either, but some servers (llama-cpp-python's
    # request model) reject a null content with HTTP 500, which would end every session at round 1
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [call.as_message() for call in turn.tool_calls]
    return message


def tool_messages(task: Task, round_index: int, turn: StreamedTurn) -> list[dict[str, Any]]:
    """One tool result per call of the turn: the task's synthetic output for the round's call."""
    text = tool_result(task, round_index)
    return [
        {"role": "tool", "tool_call_id": call.as_message()["id"], "content": text if i == 0 else "[ok]"}
        for i, call in enumerate(turn.tool_calls)
    ]


def raw_output(turn: StreamedTurn) -> str:
    """The assistant output of a turn as streamed: content, then each call's name and arguments."""
    parts = [turn.content]
    parts += [f"[tool_call {c.index} {c.name}] {c.arguments}" for c in turn.tool_calls]
    return "\n".join(parts)


def turn_record(turn: StreamedTurn) -> dict[str, Any]:
    """A turn in full for a corrupted session's transcript; the raw body both readable and exact."""
    return {
        "content": turn.content,
        "reasoning": turn.reasoning,
        "tool_calls": [asdict(c) for c in turn.tool_calls],
        "finish_reason": turn.finish_reason,
        "done": turn.done,
        "usage": turn.usage,
        "latency_s": turn.latency_s,
        "raw_sse": turn.raw.decode("utf-8", "backslashreplace"),
        "raw_sse_b64": base64.b64encode(turn.raw).decode("ascii"),
    }


def summarize(
    outcomes: list[SessionOutcome],
    planned: int,
    duration_s: float,
    oracle: str = "tool_calls",
    reference_s: float = 0.0,
) -> StressSummary:
    """Counts by status, by detector of the counted finding, and by family of any finding (pure)."""
    status = Counter(o.status for o in outcomes)
    detectors = Counter(o.bad_turn.detector for o in outcomes if o.bad_turn is not None)
    # a session counts once per family; lines written before families were recorded: from the detector
    families = Counter(f for o in outcomes for f in {b.family or family_of(b.detector) for b in o.findings()})
    return StressSummary(
        sessions=len(outcomes),
        clean=status["clean"],
        corrupted=status["corrupted"],
        errored=status["errored"],
        planned=planned,
        by_detector=dict(sorted(detectors.items())),
        duration_s=duration_s,
        by_family={f: families[f] for f in FAMILIES if families[f]},
        usage_missing_turns=sum(o.usage_missing_turns for o in outcomes),
        oracle=oracle,
        reference_s=reference_s,
    )


def run_warnings(summary: StressSummary, turns: int) -> list[str]:
    """What a person must know before reading the counts (pure): nothing measured, tokens unknown."""
    out = []
    if summary.sessions and not summary.measured:
        out.append(
            f"no session reached an outcome: all {summary.errored} errored, so nothing was measured "
            "(see errored by kind)"
        )
    if summary.usage_missing_turns:
        out.append(
            f"the server sent no usage block in {summary.usage_missing_turns} of {turns} turns: token "
            "counts are unknown for those (the server's doing, not the client's)"
        )
    return out


def divergence_positions(outcomes: list[SessionOutcome]) -> dict[str, Any]:
    """Where each diverged session first parted from its reference: its turn and position (pure)."""
    found = [
        (o.bad_turn.round_index, o.bad_turn.divergence)
        for o in outcomes
        if o.bad_turn is not None and o.bad_turn.divergence is not None
    ]
    return {
        "positions": [d["position"] for _, d in found],
        "turns": [r for r, _ in found],
        "basis": dict(Counter(d["basis"] for _, d in found)),
    }


def read_outcomes(path: str | Path) -> list[SessionOutcome]:
    """The outcomes a (possibly interrupted) run wrote; a torn last line is skipped."""
    outcomes = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            outcomes.append(SessionOutcome.from_dict(json.loads(line)))
        except (ValueError, TypeError, KeyError):
            log.warning("skipping an unreadable line of %s", path)
    return outcomes


def summarize_jsonl(path: str | Path, planned: int, oracle: str = "tool_calls") -> StressSummary:
    """The summary of whatever a run wrote to its sessions JSONL, also when it was interrupted."""
    return summarize(read_outcomes(path), planned, duration_s=0.0, oracle=oracle)


def errors_by_kind(outcomes: list[SessionOutcome]) -> dict[str, int]:
    return dict(
        sorted(Counter((o.error or "").split(":", 1)[0] for o in outcomes if o.status == "errored").items())
    )


@dataclass(frozen=True)
class StressSettings:
    """What one stress run does. The run's record (`record()`) goes into summary.json."""

    url: str  # the OpenAI-compatible base URL, e.g. http://127.0.0.1:8000
    out_dir: Path  # where sessions.jsonl, summary.json and corrupted/ are written
    sessions: int = 60
    rounds: int = 4
    concurrency: int | None = None  # sessions at once; None (or 0) means all of them
    seed: int = 0  # session i's task is make_task(seed, i, rounds)
    model: str = "default"  # the served model name sent in each request
    timeout_s: float = 120.0  # per turn, first byte to last
    # the detector families whose findings end a session as corrupted; the others are noted beside.
    # None: the oracle's own (detect.counted_families)
    count: tuple[str, ...] | None = None
    tool_choice: str = "auto"  # one of TOOL_CHOICES
    keep_transcripts: bool = False  # transcripts/<session>.json for every session, not only corrupted
    max_tokens: int = DEFAULT_MAX_TOKENS
    progress: bool | None = None  # live display on stderr; None: exactly when stderr is a terminal
    watch_interval_s: float = 2.0  # how often `server_gone` is polled
    # what judges a session: "tool_calls" | "divergence" (each turn under load against the batch-1
    # reference of the same start: two passes over the same prompts, divergence.py)
    oracle: str = "tool_calls"
    prompts: str | None = None  # a JSONL file of conversations (prompts.py); None: the built-in tasks
    early_tokens: int = 16  # divergence: a first difference before this position is diverged_early
    compare: str = "auto"  # divergence: "auto" (tokens where the server sends logprobs, else text) | "text"

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.rounds < 1:
            raise ValueError(f"sessions and rounds must be >= 1: {self.sessions}, {self.rounds}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice: {self.tool_choice!r} is not one of {list(TOOL_CHOICES)}")
        if self.oracle not in STRESS_ORACLES:
            raise ValueError(f"oracle: {self.oracle!r} is not one of {list(STRESS_ORACLES)}")
        if self.compare not in divergence.COMPARE:
            raise ValueError(f"compare: {self.compare!r} is not one of {list(divergence.COMPARE)}")
        if self.early_tokens < 0:
            raise ValueError(f"early_tokens: {self.early_tokens} must be >= 0")
        count = counted_families(self.oracle, self.count, answers=self.prompts is not None)
        problems = family_problems("count", list(count))
        if problems:
            raise ValueError(problems[0])
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "out_dir", Path(self.out_dir))

    @property
    def workers(self) -> int:
        """Sessions that run at once."""
        return min(self.sessions, self.concurrency or self.sessions)

    def record(self) -> dict[str, Any]:
        """The settings that shape the result, as summary.json keeps them."""
        return {
            "url": self.url,
            "sessions": self.sessions,
            "rounds": self.rounds,
            "concurrency": self.workers,
            "seed": self.seed,
            "model": self.model,
            "timeout_s": self.timeout_s,
            "count": list(self.count),
            "tool_choice": self.tool_choice,
            "max_tokens": self.max_tokens,
            # the tool-call oracle on the built-in tasks, the default, adds nothing (its records as before)
            **({"oracle": self.oracle} if self.oracle != "tool_calls" else {}),
            **({"prompts": self.prompts} if self.prompts is not None else {}),
            **(
                {"early_tokens": self.early_tokens, "compare": self.compare}
                if self.oracle == "divergence"
                else {}
            ),
        }


@dataclass
class SessionRun:
    """What one session leaves: its outcome, the corrupted turn's transcript (when it ended corrupted)
    and, when transcripts are kept, every turn with its finding."""

    outcome: SessionOutcome
    corrupted: dict[str, Any] | None = None
    transcript: dict[str, Any] | None = None


def finding_record(finding: Finding | None) -> list[dict[str, str]]:
    if finding is None:
        return []
    return [{"detector": finding.detector, "family": finding.family, "reason": finding.reason}]


class RequestBody:
    """A session's request bodies, serialised incrementally: the fixed parts (model, tools, options)
    and every message already sent are kept as JSON bytes, and each round serialises only the messages
    added since the last one. `body(tool_choice)` is byte for byte what `stream_chat` sends for
    `chat_payload(model, messages, TOOLS, max_tokens=..., temperature=0.0, tool_choice=...)`."""

    def __init__(self, settings: StressSettings, messages: list[dict[str, Any]]):
        self._head = b'{"model":' + dumps(settings.model) + b',"messages":['
        options = (
            b'],"stream":true,"stream_options":{"include_usage":true},"max_tokens":'
            + dumps(settings.max_tokens)
            + b',"temperature":'
            + dumps(0.0)
        )
        self._tail = options + (b',"tools":' + dumps(TOOLS) + b',"tool_choice":' if TOOLS else b"")
        self._sent = bytearray()  # the messages serialised so far, comma-separated
        self._pending = list(messages)  # added since: serialised when the next body is built

    def add(self, message: dict[str, Any]) -> None:
        self._pending.append(message)

    def body(self, tool_choice: Any) -> bytes:
        for message in self._pending:
            if self._sent:
                self._sent += b","
            self._sent += dumps(message)
        self._pending.clear()
        end = dumps(tool_choice) + b"}" if TOOLS else b"}"
        return b"".join((self._head, self._sent, self._tail, end))


async def run_session(http: Any, settings: StressSettings, task: Task) -> SessionRun:
    """One session to its end: it ends at the first finding of a counted family (corrupted), at the
    first transport failure (errored) or after its rounds (clean); a finding of a family the run does
    not count is noted and the session goes on with the call the model made."""
    rounds = settings.rounds
    messages = initial_messages(task)
    outcome = SessionOutcome(session_id=task.task_id, status="clean", rounds=rounds, rounds_done=0)
    turns: list[dict[str, Any]] | None = [] if settings.keep_transcripts else None

    def transcript(error: str | None = None) -> dict[str, Any] | None:
        if turns is None:
            return None
        return {"session_id": task.task_id, "status": outcome.status, "error": error, "turns": turns}

    # the request of round r is chat_payload(model, messages, TOOLS, ...), serialised incrementally
    request = RequestBody(settings, messages)
    for r in range(rounds):
        expected = task.expected(r)
        body = request.body(tool_choice_for(settings.tool_choice, expected))
        try:
            turn = await stream_body(http, settings.url, body, timeout=settings.timeout_s)
        except RequestError as e:
            outcome.status, outcome.error = "errored", f"{e.kind}: {e.message} (round {r})"[:500]
            return SessionRun(outcome, transcript=transcript(outcome.error))
        outcome.turn_latency_s.append(round(turn.latency_s, 6))
        outcome.prompt_tokens += turn.prompt_tokens
        outcome.completion_tokens += turn.completion_tokens
        outcome.usage_missing_turns += turn.usage is None
        finding = check_turn(turn, expected, check_plan=True)
        if turns is not None:
            turns.append({"round_index": r, **turn_record(turn), "findings": finding_record(finding)})
        if finding is not None:
            bad = BadTurn(r, finding.detector, finding.reason, raw_output(turn), finding.family)
            if finding.family in settings.count:
                outcome.status, outcome.bad_turn = "corrupted", bad
                corrupted = {
                    "session_id": task.task_id,
                    "task": {"task_id": task.task_id, "steps": [s.as_json() for s in task.steps]},
                    "messages": messages,
                    "bad_turn": {
                        "round_index": r,
                        "detector": finding.detector,
                        "family": finding.family,
                        "reason": finding.reason,
                        **turn_record(turn),
                    },
                }
                return SessionRun(outcome, corrupted, transcript())
            outcome.noted.append(bad)
        if r + 1 < rounds:  # the conversation goes on: the turn and its tool results join it
            for message in (assistant_message(turn), *tool_messages(task, r, turn)):
                messages.append(message)
                request.add(message)
        outcome.rounds_done = r + 1
    return SessionRun(outcome, transcript=transcript())


# --- the prompts a session replays: a built-in task, or a conversation of a prompts file -----------------


@dataclass(frozen=True)
class Prompts:
    """What the sessions of a run replay: the built-in tasks, or the conversations of a prompts file
    (session i replays `prompts.session_conversation(conversations, seed, i)`)."""

    settings: StressSettings
    conversations: tuple[Conversation, ...] | None = None

    @classmethod
    def of(cls, settings: StressSettings) -> Prompts:
        return cls(settings, load_prompts(settings.prompts) if settings.prompts else None)

    def session(self, index: int) -> Task | Conversation:
        if self.conversations is None:
            return make_task(self.settings.seed, index, self.settings.rounds)
        return session_conversation(self.conversations, self.settings.seed, index)

    def session_id(self, index: int) -> str:
        source = self.session(index)
        return source.task_id if isinstance(source, Task) else session_id(source, self.settings.seed, index)

    def turns(self, index: int) -> int:
        source = self.session(index)
        return len(source.steps) if isinstance(source, Task) else len(replay_turns(source))


def tool_schemas(tools: Any) -> dict[str, Any]:
    """name -> parameters schema of the tools a conversation offers (an empty object schema where none)."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools or ()}


def replayed_body(
    settings: StressSettings,
    conversation: Conversation,
    turn: ReplayTurn,
    sid: str,
    r: int,
    turns: int,
    **extra: Any,
) -> bytes:
    """The request of turn `r` of a replayed conversation, `turn` (prompts.replay_turns: the file's
    messages, the same in every pass); the `user` field says which session and turn (tasks.session_tag)."""
    tools = list(conversation.tools) if conversation.tools else None
    payload = chat_payload(
        settings.model,
        list(turn.messages),
        tools,
        max_tokens=settings.max_tokens,
        temperature=0.0,
        tool_choice=tool_choice_for(settings.tool_choice, turn.expected_call) if tools else "auto",
        user=session_tag(sid, r, turns),
        **extra,
    )
    return dumps(payload)


def session_outcome(sid: str, turns: int) -> SessionOutcome:
    return SessionOutcome(session_id=sid, status="clean", rounds=turns, rounds_done=0)


def account(outcome: SessionOutcome, turn: StreamedTurn) -> None:
    """A turn's latency and tokens into its session's outcome."""
    outcome.turn_latency_s.append(round(turn.latency_s, 6))
    outcome.prompt_tokens += turn.prompt_tokens
    outcome.completion_tokens += turn.completion_tokens
    outcome.usage_missing_turns += turn.usage is None


def errored(outcome: SessionOutcome, error: RequestError, r: int, where: str = "") -> SessionOutcome:
    outcome.status, outcome.error = "errored", f"{error.kind}: {where}{error.message} (round {r})"[:500]
    return outcome


async def run_replayed_session(
    http: Any, settings: StressSettings, conversation: Conversation, sid: str
) -> SessionRun:
    """The tool-call oracle over a replayed conversation: each turn checked for structure against the
    conversation's own tools (a call required where the recorded answer made one, and that call expected
    where `tool_choice` or the plan check asks), the last turn for its expected answer."""
    turns = replay_turns(conversation)
    outcome = session_outcome(sid, len(turns))
    schemas = tool_schemas(conversation.tools) if conversation.tools else {}
    for r, replay in enumerate(turns):
        body = replayed_body(settings, conversation, replay, sid, r, len(turns))
        try:
            turn = await stream_body(http, settings.url, body, timeout=settings.timeout_s)
        except RequestError as e:
            return SessionRun(errored(outcome, e, r))
        account(outcome, turn)
        finding = check_turn(
            turn, replay.expected_call, True, schemas, expect_call=replay.expected_call is not None
        )
        if finding is None and replay.last:
            finding = answer_finding(turn.content, conversation.expected)
        if finding is not None:
            bad = BadTurn(r, finding.detector, finding.reason, raw_output(turn), finding.family)
            if finding.family in settings.count:
                outcome.status, outcome.bad_turn = "corrupted", bad
                corrupted = {
                    "session_id": sid,
                    "conversation": conversation.id,
                    "messages": list(replay.messages),
                    "bad_turn": {
                        "round_index": r,
                        "detector": finding.detector,
                        "family": finding.family,
                        "reason": finding.reason,
                        **turn_record(turn),
                    },
                }
                return SessionRun(outcome, corrupted)
            outcome.noted.append(bad)
        outcome.rounds_done = r + 1
    return SessionRun(outcome)


# --- the differential oracle: a batch-1 reference pass, then the same turns under load ----------------


@dataclass
class Reference:
    """A session's reference: each turn's exact request and the output it got alone (batch 1)."""

    bodies: list[bytes]
    turns: list[StreamedTurn]
    error: str | None = None  # the reference could not be taken: the session is errored


def divergence_extra(settings: StressSettings) -> dict[str, Any]:
    """What both passes add to each request: a fixed seed, and the tokens where they are compared."""
    return {"seed": settings.seed, **({"logprobs": True} if settings.compare == "auto" else {})}


async def reference_session(http: Any, settings: StressSettings, prompts: Prompts, index: int) -> Reference:
    """One session's turns, alone: the requests of a built-in task grow with the reference's own answers
    (so the pass under load is fed the reference conversation, and one divergence cannot cascade); a
    replayed conversation's are the file's."""
    source, sid, extra = prompts.session(index), prompts.session_id(index), divergence_extra(settings)
    reference = Reference([], [])
    turns = prompts.turns(index)
    messages = initial_messages(source) if isinstance(source, Task) else []
    replays = replay_turns(source) if isinstance(source, Conversation) else ()
    for r in range(turns):
        if isinstance(source, Task):
            expected = source.expected(r)
            payload = chat_payload(
                settings.model,
                messages,
                TOOLS,
                max_tokens=settings.max_tokens,
                temperature=0.0,
                tool_choice=tool_choice_for(settings.tool_choice, expected),
                user=session_tag(sid, r, turns),
                **extra,
            )
            body = dumps(payload)
        else:
            body = replayed_body(settings, source, replays[r], sid, r, turns, **extra)
        try:
            turn = await stream_body(http, settings.url, body, timeout=settings.timeout_s)
        except RequestError as e:
            reference.error = f"{e.kind}: reference pass: {e.message} (round {r})"[:500]
            return reference
        reference.bodies.append(body)
        reference.turns.append(turn)
        if isinstance(source, Task) and r + 1 < turns:
            messages = [*messages, assistant_message(turn), *tool_messages(source, r, turn)]
    return reference


async def run_divergence_session(
    http: Any, settings: StressSettings, prompts: Prompts, index: int, reference: Reference
) -> SessionRun:
    """The session's turns under load, each the very request of its reference turn; the session ends
    corrupted at the first turn whose output differs (or, a prompts file's last turn, misses its expected
    answer), clean after its turns."""
    sid, turns = prompts.session_id(index), prompts.turns(index)
    outcome = session_outcome(sid, turns)
    if reference.error is not None:
        outcome.status, outcome.error = "errored", reference.error
        return SessionRun(outcome)
    source = prompts.session(index)
    for r, (body, ref) in enumerate(zip(reference.bodies, reference.turns, strict=True)):
        try:
            turn = await stream_body(http, settings.url, body, timeout=settings.timeout_s)
        except RequestError as e:
            return SessionRun(errored(outcome, e, r))
        account(outcome, turn)
        difference = divergence.first_difference(ref, turn, settings.compare)
        finding = difference.finding(settings.early_tokens, r) if difference is not None else None
        if finding is None and isinstance(source, Conversation) and r == turns - 1:
            finding = answer_finding(turn.content, source.expected)
        if finding is not None:
            bad = BadTurn(
                r,
                finding.detector,
                finding.reason,
                raw_output(turn),
                finding.family,
                difference.to_dict() if difference is not None else None,
            )
            if finding.family in settings.count:
                outcome.status, outcome.bad_turn = "corrupted", bad
                corrupted = {
                    "session_id": sid,
                    "round_index": r,
                    "finding": {
                        "detector": finding.detector,
                        "family": finding.family,
                        "reason": finding.reason,
                    },
                    "difference": bad.divergence,
                    "request": json.loads(body),
                    "reference": divergence.output_record(ref),
                    "under_load": divergence.output_record(turn),
                }
                return SessionRun(outcome, corrupted)
            outcome.noted.append(bad)
        outcome.rounds_done = r + 1
    return SessionRun(outcome)


_OUTCOME_FIELDS = tuple(f.name for f in fields(SessionOutcome))


def outcome_dict(outcome: SessionOutcome) -> dict[str, Any]:
    """`outcome.to_dict()` without its deep copy (the line is serialised at once): the same dict."""
    document = {name: getattr(outcome, name) for name in _OUTCOME_FIELDS}
    document["bad_turn"] = asdict(outcome.bad_turn) if outcome.bad_turn is not None else None
    document["noted"] = [asdict(n) for n in outcome.noted]
    return document


class Outputs:
    """The run's files and live counts; every write is flushed at once."""

    def __init__(
        self, out_dir: Path, planned: int, progress: bool, on_outcome: Callable[[str], None] | None = None
    ):
        self.out_dir = out_dir
        self.on_outcome = on_outcome
        self.planned = planned
        out_dir.mkdir(parents=True, exist_ok=True)
        self.corrupted_dir = out_dir / "corrupted"
        self.transcripts_dir = out_dir / "transcripts"
        self.outcomes: list[SessionOutcome] = []
        self._jsonl: TextIO = (out_dir / "sessions.jsonl").open("w", encoding="utf-8")
        self._progress = _Progress(planned) if progress else None
        self.oracle = "tool_calls"
        self.reference_s = 0.0  # the divergence oracle's reference pass
        self.reference: dict[str, Any] | None = None

    def record(self, run: SessionRun) -> None:
        outcome = run.outcome
        # ensure_ascii: lone surrogates (invalid UTF-8 evidence) stay representable
        for folder, document in ((self.corrupted_dir, run.corrupted), (self.transcripts_dir, run.transcript)):
            if document is not None:
                folder.mkdir(exist_ok=True)
                (folder / f"{outcome.session_id}.json").write_text(json.dumps(document, indent=1))
        self._jsonl.write(json.dumps(outcome_dict(outcome)) + "\n")
        self._jsonl.flush()
        self.outcomes.append(outcome)
        if self._progress is not None:
            self._progress.update(self.outcomes[-1].status)
        if self.on_outcome is not None:
            self.on_outcome(outcome.status)

    def finish(self, duration_s: float, settings: dict[str, Any]) -> StressSummary:
        self._jsonl.close()
        if self._progress is not None:
            self._progress.stop()
        oracle = settings.get("oracle", self.oracle)
        summary = summarize(self.outcomes, self.planned, duration_s, oracle, self.reference_s)
        turns = sum(len(o.turn_latency_s) for o in self.outcomes)
        document = {
            **asdict(summary),
            "partial": summary.partial,
            "by_error": errors_by_kind(self.outcomes),
            "counted_families": settings["count"],
            "turns": turns,
            "warnings": run_warnings(summary, turns),
            "settings": settings,
        }
        if self.reference is not None:
            document["reference"] = self.reference
            document["divergence"] = divergence_positions(self.outcomes)
        (self.out_dir / "summary.json").write_text(json.dumps(document, indent=1) + "\n")
        return summary


class _Progress:
    """rich live progress on stderr: sessions done / corrupted / errored."""

    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.counts: Counter[str] = Counter()
        self.progress = Progress(
            TextColumn("stress"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(
                "[red]corrupted {task.fields[corrupted]}[/] [yellow]errored {task.fields[errored]}[/]"
            ),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        )
        self.task = self.progress.add_task("stress", total=total, corrupted=0, errored=0)
        self.progress.start()

    def update(self, status: str) -> None:
        self.counts[status] += 1
        self.progress.update(
            self.task, advance=1, corrupted=self.counts["corrupted"], errored=self.counts["errored"]
        )

    def stop(self) -> None:
        self.progress.stop()


class _StressRun:
    """One run's shared state: the next session to start, the abort signal and its reason, the outputs.

    `concurrency` workers take sessions in index order until all have started or the watchdog aborts
    (it then cancels the sessions in flight, which end as errored); each records its session's outcome
    as soon as it ends.
    """

    def __init__(
        self,
        settings: StressSettings,
        outputs: Outputs | None,
        server_gone: Callable[[], str | None] | None,
        prompts: Prompts,
        session: Callable[[Any, int], Awaitable[SessionRun]],
        workers: int | None = None,
    ):
        self.settings = settings
        self.outputs = outputs  # None: the caller keeps what `session` returns (the reference pass)
        self.server_gone = server_gone
        self.prompts = prompts
        self.session = session  # (http, session index) -> that session's run
        self.workers = workers or settings.workers
        self.next_index = 0
        self.abort = asyncio.Event()
        self.gone_reason = ""
        self.in_flight: set[asyncio.Future[SessionRun]] = set()  # the sessions running now

    async def run(self) -> None:
        watcher = asyncio.ensure_future(self.watchdog()) if self.server_gone is not None else None
        try:
            async with open_session(self.workers) as http:
                await asyncio.gather(*(self.worker(http) for _ in range(self.workers)))
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)

    async def watchdog(self) -> None:
        assert self.server_gone is not None
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            reason = await asyncio.to_thread(self.server_gone)
            if reason:
                self.gone_reason = reason
                log.error("stress: %s; ending the sessions in flight as errored", reason)
                self.abort.set()
                for session in list(self.in_flight):
                    session.cancel()
                return

    async def worker(self, http: Any) -> None:
        settings = self.settings
        while self.next_index < settings.sessions and not self.abort.is_set():
            index, self.next_index = self.next_index, self.next_index + 1
            session = asyncio.ensure_future(self.one_session(http, index))
            self.in_flight.add(session)
            try:
                run = await session
            except asyncio.CancelledError:
                # the watchdog ended the session (the server is gone), unless this worker is cancelled
                current = asyncio.current_task()
                if not (session.cancelled() and self.abort.is_set()) or (current and current.cancelling()):
                    raise
                run = self.errored(index, f"server_gone: {self.gone_reason}")
            finally:
                self.in_flight.discard(session)
            if self.outputs is not None:
                self.outputs.record(run)

    def errored(self, index: int, error: str) -> SessionRun:
        sid, turns = self.prompts.session_id(index), self.prompts.turns(index)
        return SessionRun(SessionOutcome(sid, "errored", turns, 0, error=error[:500]))

    async def one_session(self, http: Any, index: int) -> SessionRun:
        try:
            return await self.session(http, index)
        except Exception as e:  # a client bug must not pass for corruption nor kill the run
            log.exception("session %s failed in the client", self.prompts.session_id(index))
            return self.errored(index, f"client_error: {e!r}")


def _tool_call_session(
    settings: StressSettings, prompts: Prompts
) -> Callable[[Any, int], Awaitable[SessionRun]]:
    async def session(http: Any, index: int) -> SessionRun:
        source = prompts.session(index)
        if isinstance(source, Task):
            return await run_session(http, settings, source)
        return await run_replayed_session(http, settings, source, prompts.session_id(index))

    return session


async def _run_divergence(
    settings: StressSettings,
    outputs: Outputs,
    server_gone: Callable[[], str | None] | None,
    prompts: Prompts,
    on_phase: Callable[[str], None],
) -> None:
    """The two passes of the differential oracle on one start: every session alone (its reference), then
    all of them at the planned concurrency, each turn judged against its reference."""
    references: dict[int, Reference] = {}

    async def reference(http: Any, index: int) -> SessionRun:
        references[index] = await reference_session(http, settings, prompts, index)
        return SessionRun(session_outcome(prompts.session_id(index), prompts.turns(index)))

    async def under_load(http: Any, index: int) -> SessionRun:
        taken = references.get(index) or Reference([], [], "reference pass: not taken (the run was stopped)")
        return await run_divergence_session(http, settings, prompts, index, taken)

    started = time.monotonic()
    on_phase("reference")
    log.info("divergence: the reference pass, %d sessions one at a time", settings.sessions)
    try:
        await _StressRun(settings, None, server_gone, prompts, reference, workers=1).run()
    finally:
        outputs.reference_s = time.monotonic() - started
        outputs.reference = reference_record(references, outputs.reference_s)
    log.info("divergence: reference pass done in %.1fs; the pass under load", outputs.reference_s)
    on_phase("stress")
    await _StressRun(settings, outputs, server_gone, prompts, under_load).run()


def reference_record(references: Mapping[int, Reference], seconds: float) -> dict[str, Any]:
    """What summary.json says of the reference pass: its time (GPU time too), turns and tokens."""
    turns = [t for r in references.values() for t in r.turns]
    return {
        "duration_s": round(seconds, 3),
        "sessions": len(references),
        "errored": sum(r.error is not None for r in references.values()),
        "turns": len(turns),
        "completion_tokens": sum(t.completion_tokens for t in turns),
        "with_tokens": sum(t.tokens is not None for t in turns),
    }


def quiet_on_interrupt(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """A Ctrl-C or SIGTERM lands in whichever session task runs at that moment: that task's
    KeyboardInterrupt is the interrupt the caller handles, not an error for asyncio to print as
    "Task exception was never retrieved" with a traceback."""
    if isinstance(context.get("exception"), KeyboardInterrupt):
        return
    loop.default_exception_handler(context)


async def run_stress(
    settings: StressSettings,
    server_gone: Callable[[], str | None] | None = None,
    on_outcome: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> StressSummary:
    """Run the workload and write the outputs under `settings.out_dir`.

    On cancellation the outputs are written (in-flight sessions left out) and the CancelledError
    propagates.

    `server_gone`, polled every `settings.watch_interval_s` in a thread, returns why the deployment can
    no longer serve (a server process died) or None. Then the sessions in flight end as `errored` at
    once, rather than each waiting out its timeout against a router that keeps retrying, and no new
    session starts (the summary is then partial: `planned` > `sessions`).

    `on_outcome` hears each session's status as its line is written (an orchestrator's progress display);
    `on_phase` hears "reference" and then "stress" around the divergence oracle's reference pass.
    """
    progress = sys.stderr.isatty() if settings.progress is None else settings.progress
    prompts = Prompts.of(settings)
    outputs = Outputs(settings.out_dir, settings.sessions, progress, on_outcome)
    started = time.monotonic()
    asyncio.get_running_loop().set_exception_handler(quiet_on_interrupt)
    try:
        if settings.oracle == "divergence":
            await _run_divergence(settings, outputs, server_gone, prompts, on_phase or (lambda phase: None))
        else:
            await _StressRun(
                settings, outputs, server_gone, prompts, _tool_call_session(settings, prompts)
            ).run()
    finally:
        summary = outputs.finish(time.monotonic() - started, settings.record())
        if summary.partial:
            log.warning(
                "stress run interrupted: %d of %d sessions have an outcome",
                summary.sessions,
                settings.sessions,
            )
    log.info(
        "stress: %d clean, %d corrupted %s, %d errored in %.1fs",
        summary.clean,
        summary.corrupted,
        summary.by_detector,
        summary.errored,
        summary.duration_s,
    )
    return summary


def run_stress_sync(
    settings: StressSettings,
    server_gone: Callable[[], str | None] | None = None,
    on_outcome: Callable[[str], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> StressSummary:
    """`run_stress` in a fresh event loop (uvloop's where installed: client.loop_factory); Ctrl-C
    writes the partial outputs, then raises KeyboardInterrupt."""
    return run_sync(run_stress(settings, server_gone, on_outcome, on_phase))


def format_summary(document: dict[str, Any]) -> str:
    """A summary.json document as a few lines for a person."""
    partial = " (partial)" if document.get("partial") else ""
    lines = [
        f"sessions {document['sessions']}/{document['planned']}{partial}"
        f" in {document['duration_s']:.1f}s: clean {document['clean']}, corrupted {document['corrupted']}, "
        f"errored {document['errored']}",
    ]
    measured = document["clean"] + document["corrupted"]
    counted = document.get("counted_families") or list(DEFAULT_COUNTED)
    if measured:
        lines.append(
            f"corruption rate {document['corrupted'] / document['sessions']:.1%} "
            f"(counting {', '.join(counted)})"
        )
    else:
        lines.append("corruption rate n/a: no session reached an outcome")
    for name, count in document.get("by_detector", {}).items():
        lines.append(f"  corrupted by {name}: {count}")
    for family, count in document.get("by_family", {}).items():
        if family not in counted:
            lines.append(f"  {family} (not counted) in {count} session(s)")
    for kind, count in document.get("by_error", {}).items():
        lines.append(f"  errored by {kind}: {count}")
    lines.extend(f"WARNING: {w}" for w in document.get("warnings", ()))
    return "\n".join(lines)


def stress_settings(source: object, **given: Any) -> StressSettings:
    """The one mapping to StressSettings (fill.py): every field from `source` by name (a job's
    `workload` section, or the CLI's arguments), but those `given` (what the caller computes: url,
    out_dir, ...)."""
    return fill(StressSettings, source, **given)


def _families(text: str) -> tuple[str, ...]:
    return tuple(f.strip() for f in text.split(",") if f.strip())


def argument_parser() -> argparse.ArgumentParser:
    """The CLI; each dest is the StressSettings field it sets (the flags stay as they were)."""
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.workload.stress",
        description="Tool-calling stress reproducer against an OpenAI-compatible endpoint.",
    )
    defaults = StressSettings
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--out", dest="out_dir", required=True, help="output directory")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent sessions (default: all)")
    parser.add_argument(
        "--timeout", dest="timeout_s", type=float, default=defaults.timeout_s, help="seconds per turn"
    )
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument(
        "--oracle",
        choices=STRESS_ORACLES,
        default=defaults.oracle,
        help="tool_calls: judge the calls' structure and plan; divergence: each turn under load against "
        "its batch-1 reference, taken first on the same server",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        help="a JSONL file of conversations to replay (default: the built-in tasks)",
    )
    parser.add_argument("--early-tokens", type=int, default=defaults.early_tokens)
    parser.add_argument("--compare", choices=divergence.COMPARE, default=defaults.compare)
    parser.add_argument(
        "--count",
        type=_families,
        default=None,
        help=f"detector families that count as corruption, comma-separated from {','.join(FAMILIES)}; "
        "the others are reported beside (default: all the oracle's)",
    )
    parser.add_argument(
        "--tool-choice",
        choices=TOOL_CHOICES,
        default=defaults.tool_choice,
        help="auto: the model decides; required: force some call; plan: force the call the plan expects",
    )
    parser.add_argument(
        "--keep-transcripts", action="store_true", help="write transcripts/<session>.json for every session"
    )
    # progress None: shown exactly when stderr is a terminal
    parser.add_argument(
        "--quiet", dest="progress", action="store_const", const=False, default=None, help="no live progress"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = stress_settings(args)
    except ValueError as e:
        parser.error(str(e))
    interrupted = False
    try:
        summary = run_stress_sync(settings)
    except KeyboardInterrupt:
        interrupted = True
    print(format_summary(json.loads((settings.out_dir / "summary.json").read_text())))
    print(f"outputs: {settings.out_dir.resolve()}")
    if interrupted:
        return 130
    return 0 if summary.measured else 1  # a run that measured nothing must not pass for clean


if __name__ == "__main__":
    sys.exit(main())
