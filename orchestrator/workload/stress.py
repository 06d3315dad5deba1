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
  (content, reasoning, tool calls, the raw SSE body).

Interruption (Ctrl-C, or the caller cancelling the task): sessions still in flight are *left out*
(no JSONL line: they have no outcome), `summary.json` is written with `planned` > `sessions`
(`partial`), and the cancellation propagates (KeyboardInterrupt from `run_stress_sync`).

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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from orchestrator.results import BadTurn, SessionOutcome, StreamedTurn, StressSummary
from orchestrator.workload.client import RequestError, chat_payload, open_session, stream_chat
from orchestrator.workload.detect import check_turn
from orchestrator.workload.tasks import TOOLS, Task, initial_messages, make_task, tool_result

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 1024


def assistant_message(turn: StreamedTurn) -> dict[str, Any]:
    """The turn as it goes back into the conversation (reasoning is not sent back, as DeepSeek asks)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content or None}
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


def summarize(outcomes: list[SessionOutcome], planned: int, duration_s: float) -> StressSummary:
    """Counts by status and by detector (pure)."""
    status = Counter(o.status for o in outcomes)
    detectors = Counter(o.bad_turn.detector for o in outcomes if o.bad_turn is not None)
    return StressSummary(
        sessions=len(outcomes),
        clean=status["clean"],
        corrupted=status["corrupted"],
        errored=status["errored"],
        planned=planned,
        by_detector=dict(sorted(detectors.items())),
        duration_s=duration_s,
    )


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


def summarize_jsonl(path: str | Path, planned: int) -> StressSummary:
    """The summary of whatever a run wrote to its sessions JSONL, also when it was interrupted."""
    return summarize(read_outcomes(path), planned, duration_s=0.0)


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
    check_plan: bool = True  # the wrong_call detector (the target is expected to follow the plan)
    max_tokens: int = DEFAULT_MAX_TOKENS
    progress: bool | None = None  # live display on stderr; None: exactly when stderr is a terminal
    watch_interval_s: float = 2.0  # how often `server_gone` is polled

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.rounds < 1:
            raise ValueError(f"sessions and rounds must be >= 1: {self.sessions}, {self.rounds}")
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
            "check_plan": self.check_plan,
            "max_tokens": self.max_tokens,
        }


async def run_session(
    http: Any, settings: StressSettings, task: Task
) -> tuple[SessionOutcome, dict[str, Any] | None]:
    """One session to its end; returns its outcome and, when corrupted, its transcript."""
    rounds = settings.rounds
    messages = initial_messages(task)
    outcome = SessionOutcome(session_id=task.task_id, status="clean", rounds=rounds, rounds_done=0)
    for r in range(rounds):
        payload = chat_payload(
            settings.model, messages, TOOLS, max_tokens=settings.max_tokens, temperature=0.0
        )
        try:
            turn = await stream_chat(http, settings.url, payload, timeout=settings.timeout_s)
        except RequestError as e:
            outcome.status, outcome.error = "errored", f"{e.kind}: {e.message} (round {r})"[:500]
            return outcome, None
        outcome.turn_latency_s.append(round(turn.latency_s, 6))
        outcome.prompt_tokens += turn.prompt_tokens
        outcome.completion_tokens += turn.completion_tokens
        finding = check_turn(turn, task.expected(r), check_plan=settings.check_plan)
        if finding is not None:
            outcome.status = "corrupted"
            outcome.bad_turn = BadTurn(r, finding.detector, finding.reason, raw_output(turn))
            transcript = {
                "session_id": task.task_id,
                "task": {"task_id": task.task_id, "steps": [s.as_json() for s in task.steps]},
                "messages": messages,
                "bad_turn": {
                    "round_index": r,
                    "detector": finding.detector,
                    "reason": finding.reason,
                    **turn_record(turn),
                },
            }
            return outcome, transcript
        messages.append(assistant_message(turn))
        messages.extend(tool_messages(task, r, turn))
        outcome.rounds_done = r + 1
    return outcome, None


class _Outputs:
    """The run's files and live counts; every write is flushed at once."""

    def __init__(self, out_dir: Path, planned: int, progress: bool):
        self.out_dir = out_dir
        self.planned = planned
        out_dir.mkdir(parents=True, exist_ok=True)
        self.corrupted_dir = out_dir / "corrupted"
        self.outcomes: list[SessionOutcome] = []
        self._jsonl: TextIO = (out_dir / "sessions.jsonl").open("w", encoding="utf-8")
        self._progress = _Progress(planned) if progress else None

    def record(self, outcome: SessionOutcome, transcript: dict[str, Any] | None) -> None:
        if transcript is not None:
            self.corrupted_dir.mkdir(exist_ok=True)
            # ensure_ascii: lone surrogates (invalid UTF-8 evidence) stay representable
            (self.corrupted_dir / f"{outcome.session_id}.json").write_text(json.dumps(transcript, indent=1))
        self._jsonl.write(json.dumps(outcome.to_dict()) + "\n")
        self._jsonl.flush()
        self.outcomes.append(outcome)
        if self._progress is not None:
            self._progress.update(self.outcomes[-1].status)

    def finish(self, duration_s: float, settings: dict[str, Any]) -> StressSummary:
        self._jsonl.close()
        if self._progress is not None:
            self._progress.stop()
        summary = summarize(self.outcomes, self.planned, duration_s)
        document = {
            **asdict(summary),
            "partial": summary.partial,
            "by_error": errors_by_kind(self.outcomes),
            "settings": settings,
        }
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

    `concurrency` workers take sessions in index order until all have started or the watchdog aborts;
    each records its session's outcome as soon as it ends.
    """

    def __init__(
        self, settings: StressSettings, outputs: _Outputs, server_gone: Callable[[], str | None] | None
    ):
        self.settings = settings
        self.outputs = outputs
        self.server_gone = server_gone
        self.next_index = 0
        self.abort = asyncio.Event()
        self.gone_reason = ""

    async def run(self) -> None:
        watcher = asyncio.ensure_future(self.watchdog()) if self.server_gone is not None else None
        try:
            async with open_session(self.settings.workers) as http:
                await asyncio.gather(*(self.worker(http) for _ in range(self.settings.workers)))
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
                return

    async def worker(self, http: Any) -> None:
        settings = self.settings
        while self.next_index < settings.sessions and not self.abort.is_set():
            index, self.next_index = self.next_index, self.next_index + 1
            task = make_task(settings.seed, index, settings.rounds)
            session = asyncio.ensure_future(self.one_session(http, task))
            aborted = asyncio.ensure_future(self.abort.wait())
            await asyncio.wait({session, aborted}, return_when=asyncio.FIRST_COMPLETED)
            aborted.cancel()
            if session.done():
                outcome, transcript = session.result()
            else:
                session.cancel()
                await asyncio.gather(session, return_exceptions=True)
                outcome = SessionOutcome(
                    task.task_id, "errored", settings.rounds, 0, error=f"server_gone: {self.gone_reason}"
                )
                transcript = None
            self.outputs.record(outcome, transcript)

    async def one_session(self, http: Any, task: Task) -> tuple[SessionOutcome, dict[str, Any] | None]:
        try:
            return await run_session(http, self.settings, task)
        except Exception as e:  # a client bug must not pass for corruption nor kill the run
            log.exception("session %s failed in the client", task.task_id)
            return SessionOutcome(
                task.task_id, "errored", self.settings.rounds, 0, error=f"client_error: {e!r}"[:500]
            ), None


def _quiet_on_interrupt(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """A Ctrl-C or SIGTERM lands in whichever session task runs at that moment: that task's
    KeyboardInterrupt is the interrupt the caller handles, not an error for asyncio to print as
    "Task exception was never retrieved" with a traceback."""
    if isinstance(context.get("exception"), KeyboardInterrupt):
        return
    loop.default_exception_handler(context)


async def run_stress(
    settings: StressSettings, server_gone: Callable[[], str | None] | None = None
) -> StressSummary:
    """Run the workload and write the outputs under `settings.out_dir`.

    On cancellation the outputs are written (in-flight sessions left out) and the CancelledError
    propagates.

    `server_gone`, polled every `settings.watch_interval_s` in a thread, returns why the deployment can
    no longer serve (a server process died) or None. Then the sessions in flight end as `errored` at
    once, rather than each waiting out its timeout against a router that keeps retrying, and no new
    session starts (the summary is then partial: `planned` > `sessions`).
    """
    progress = sys.stderr.isatty() if settings.progress is None else settings.progress
    outputs = _Outputs(settings.out_dir, settings.sessions, progress)
    started = time.monotonic()
    asyncio.get_running_loop().set_exception_handler(_quiet_on_interrupt)
    try:
        await _StressRun(settings, outputs, server_gone).run()
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
    settings: StressSettings, server_gone: Callable[[], str | None] | None = None
) -> StressSummary:
    """`run_stress` in a fresh event loop; Ctrl-C writes the partial outputs, then raises
    KeyboardInterrupt."""
    return asyncio.run(run_stress(settings, server_gone))


def format_summary(document: dict[str, Any]) -> str:
    """A summary.json document as a few lines for a person."""
    partial = " (partial)" if document.get("partial") else ""
    lines = [
        f"sessions {document['sessions']}/{document['planned']}{partial}"
        f" in {document['duration_s']:.1f}s: clean {document['clean']}, corrupted {document['corrupted']}, "
        f"errored {document['errored']}",
    ]
    if document["sessions"]:
        lines.append(f"corruption rate {document['corrupted'] / document['sessions']:.1%}")
    for name, count in document.get("by_detector", {}).items():
        lines.append(f"  corrupted by {name}: {count}")
    for kind, count in document.get("by_error", {}).items():
        lines.append(f"  errored by {kind}: {count}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.workload.stress",
        description="Tool-calling stress reproducer against an OpenAI-compatible endpoint.",
    )
    defaults = StressSettings
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent sessions (default: all)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="seconds per turn")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--no-plan-check", action="store_true", help="disable the wrong_call detector")
    parser.add_argument("--quiet", action="store_true", help="no live progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    settings = StressSettings(
        url=args.url,
        out_dir=Path(args.out),
        sessions=args.sessions,
        rounds=args.rounds,
        concurrency=args.concurrency,
        seed=args.seed,
        model=args.model,
        timeout_s=args.timeout,
        check_plan=not args.no_plan_check,
        max_tokens=args.max_tokens,
        progress=False if args.quiet else None,
    )
    interrupted = False
    try:
        run_stress_sync(settings)
    except KeyboardInterrupt:
        interrupted = True
    print(format_summary(json.loads((settings.out_dir / "summary.json").read_text())))
    print(f"outputs: {settings.out_dir.resolve()}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
