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
from dataclasses import asdict
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


async def run_session(
    http: Any,
    url: str,
    task: Task,
    rounds: int,
    model: str,
    timeout_s: float,
    check_plan: bool,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> tuple[SessionOutcome, dict[str, Any] | None]:
    """One session to its end; returns its outcome and, when corrupted, its transcript."""
    messages = initial_messages(task)
    outcome = SessionOutcome(session_id=task.task_id, status="clean", rounds=rounds, rounds_done=0)
    for r in range(rounds):
        payload = chat_payload(model, messages, TOOLS, max_tokens=max_tokens, temperature=0.0)
        try:
            turn = await stream_chat(http, url, payload, timeout=timeout_s)
        except RequestError as e:
            outcome.status, outcome.error = "errored", f"{e.kind}: {e.message} (round {r})"[:500]
            return outcome, None
        outcome.turn_latency_s.append(round(turn.latency_s, 6))
        outcome.prompt_tokens += turn.prompt_tokens
        outcome.completion_tokens += turn.completion_tokens
        finding = check_turn(turn, task.expected(r), check_plan=check_plan)
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


async def run_stress(
    url: str,
    sessions: int,
    rounds: int,
    concurrency: int | None,
    seed: int,
    model: str,
    timeout_s: float,
    out_dir: str | Path,
    check_plan: bool = True,
    progress: bool | None = None,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    server_gone: Callable[[], str | None] | None = None,
    watch_interval_s: float = 2.0,
) -> StressSummary:
    """Run the workload against `url` (an OpenAI-compatible base URL) and write the outputs.

    `concurrency` None means all sessions at once. `progress` None means a live display exactly when
    stderr is a terminal. On cancellation the outputs are written (in-flight sessions left out) and
    the CancelledError propagates.

    `server_gone`, polled every `watch_interval_s` in a thread, returns why the deployment can no longer
    serve (a server process died) or None. Then the sessions in flight end as `errored` at once, rather
    than each waiting out its timeout against a router that keeps retrying, and no new session starts
    (the summary is then partial: `planned` > `sessions`).
    """
    if sessions < 1 or rounds < 1:
        raise ValueError(f"sessions and rounds must be >= 1: {sessions}, {rounds}")
    concurrency = min(sessions, concurrency or sessions)
    if progress is None:
        progress = sys.stderr.isatty()
    settings = {
        "url": url,
        "sessions": sessions,
        "rounds": rounds,
        "concurrency": concurrency,
        "seed": seed,
        "model": model,
        "timeout_s": timeout_s,
        "check_plan": check_plan,
        "max_tokens": max_tokens,
    }
    outputs = _Outputs(Path(out_dir), sessions, progress)
    started = time.monotonic()
    next_index = 0

    abort = asyncio.Event()
    gone_reason = ""

    async def watchdog() -> None:
        nonlocal gone_reason
        assert server_gone is not None
        while True:
            await asyncio.sleep(watch_interval_s)
            reason = await asyncio.to_thread(server_gone)
            if reason:
                gone_reason = reason
                log.error("stress: %s; ending the sessions in flight as errored", reason)
                abort.set()
                return

    async def one_session(http: Any, task: Task) -> tuple[SessionOutcome, dict[str, Any] | None]:
        try:
            return await run_session(http, url, task, rounds, model, timeout_s, check_plan, max_tokens)
        except Exception as e:  # a client bug must not pass for corruption nor kill the run
            log.exception("session %s failed in the client", task.task_id)
            return SessionOutcome(
                task.task_id, "errored", rounds, 0, error=f"client_error: {e!r}"[:500]
            ), None

    async def worker(http: Any) -> None:
        nonlocal next_index
        while next_index < sessions and not abort.is_set():
            index, next_index = next_index, next_index + 1
            task = make_task(seed, index, rounds)
            session = asyncio.ensure_future(one_session(http, task))
            aborted = asyncio.ensure_future(abort.wait())
            await asyncio.wait({session, aborted}, return_when=asyncio.FIRST_COMPLETED)
            aborted.cancel()
            if session.done():
                outcome, transcript = session.result()
            else:
                session.cancel()
                await asyncio.gather(session, return_exceptions=True)
                outcome = SessionOutcome(
                    task.task_id, "errored", rounds, 0, error=f"server_gone: {gone_reason}"
                )
                transcript = None
            outputs.record(outcome, transcript)

    watcher = asyncio.ensure_future(watchdog()) if server_gone is not None else None
    try:
        async with open_session(concurrency) as http:
            await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    finally:
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        summary = outputs.finish(time.monotonic() - started, settings)
        if summary.partial:
            log.warning(
                "stress run interrupted: %d of %d sessions have an outcome", summary.sessions, sessions
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


def run_stress_sync(*args: Any, **kwargs: Any) -> StressSummary:
    """`run_stress` (same arguments) in a fresh event loop; Ctrl-C writes the partial outputs, then
    raises KeyboardInterrupt."""
    return asyncio.run(run_stress(*args, **kwargs))


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
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--sessions", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--model", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent sessions (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per turn")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--no-plan-check", action="store_true", help="disable the wrong_call detector")
    parser.add_argument("--quiet", action="store_true", help="no live progress")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    interrupted = False
    try:
        run_stress_sync(
            args.url,
            args.sessions,
            args.rounds,
            args.concurrency,
            args.seed,
            args.model,
            args.timeout,
            args.out,
            check_plan=not args.no_plan_check,
            progress=False if args.quiet else None,
            max_tokens=args.max_tokens,
        )
    except KeyboardInterrupt:
        interrupted = True
    summary_path = Path(args.out) / "summary.json"
    print(format_summary(json.loads(summary_path.read_text())))
    print(f"outputs: {Path(args.out).resolve()}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
