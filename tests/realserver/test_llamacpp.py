"""The stress and bench CLIs against a real OpenAI-compatible server: llama-cpp-python's, serving Gemma 3
270M (Q4_K_M) on 2 CPU threads. What that server really does is in tests/workload/data/README.md (its
raw SSE bodies are recorded there); in short: tool calls only when forced by name (`auto` and
`required` fail with an empty 200 body), legacy `function_call` deltas beside `tool_calls`, no usage
block ever, one request at a time (a second request cuts the stream in flight).

The oracle is checked here, turn by turn, by code of its own (json, the tools offered, jsonschema
against tasks.TOOL_SCHEMAS, the plan): a structural finding must be true of the turn, and a turn with a
structural fault must have one. A weak model's calls stray from the plan and break the schema's bounds
(the server's grammar keeps JSON and types, not minimum/maximum/pattern): those are true findings.

Run: `python -m pytest -m realserver tests/realserver -n 0` (or scripts/realserver.sh); about 2 minutes
on 2 cores (96-125 s measured), most of it the forced calls (grammar-constrained sampling over Gemma's
262k-token vocabulary is ~0.1-0.3 s a token).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from orchestrator.workload.tasks import TOOL_SCHEMAS, ToolCall, make_task
from tests.realserver.llamacpp_server import RealServer, run_cli

pytestmark = [pytest.mark.realserver, pytest.mark.timeout(900)]

STRESS = "orchestrator.workload.stress"
BENCH = "orchestrator.workload.bench"
# small enough for 2 cores, large enough for every call of the plan (write_file's content is the longest)
MAX_TOKENS = "128"
PLAN_SESSIONS, PLAN_ROUNDS = 3, 2


@dataclass
class Run:
    """One CLI run: its exit status, output, and what it wrote."""

    rc: int
    stdout: str
    stderr: str
    out: Path

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "summary.json").read_text())

    def sessions(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (self.out / "sessions.jsonl").read_text().splitlines()]

    def transcripts(self) -> dict[str, dict[str, Any]]:
        return {p.stem: json.loads(p.read_text()) for p in sorted((self.out / "transcripts").glob("*.json"))}

    def explain(self, server: RealServer) -> str:
        return (
            f"rc={self.rc}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr[-3000:]}\n"
            f"server log tail:\n{server.log_tail(3000)}"
        )


def stress(server: RealServer, out: Path, *args: str) -> Run:
    done = run_cli(
        STRESS, "--url", server.url, "--out", str(out), "--max-tokens", MAX_TOKENS, "--timeout", "180",
        "--quiet", *args,
    )  # fmt: skip
    return Run(done.returncode, done.stdout, done.stderr, out)


@pytest.fixture(scope="session")
def plan_run(llama_server: RealServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The forced-call run, shared by the oracle test and the usage test (the model's calls take most
    of this file's time)."""
    out = tmp_path_factory.mktemp("plan") / "stress"
    return stress(
        llama_server, out,
        "--sessions", str(PLAN_SESSIONS), "--rounds", str(PLAN_ROUNDS), "--concurrency", "1",
        "--tool-choice", "plan", "--count", "structural", "--keep-transcripts",
    )  # fmt: skip


# --- the oracle, re-derived -----------------------------------------------------------------------

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_LEAK_MARKERS = ("<tool_call>", "</tool_call>", "<|tool_call|>", "<|python_tag|>", "[TOOL_CALLS]", "<｜tool")


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _arguments(call: dict[str, Any]) -> Any:
    try:
        return json.loads(call["arguments"])
    except ValueError:
        return None


def _texts(turn: dict[str, Any]) -> list[str]:
    texts = [turn["content"] or "", turn.get("reasoning") or ""]
    for call in turn["tool_calls"]:
        texts += [call["name"], call["arguments"]]
        parsed = _arguments(call)
        if isinstance(parsed, dict):
            texts += list(_strings(parsed))
    return texts


def _repeats(text: str, min_repeats: int = 10, min_span: int = 80, max_unit: int = 200) -> bool:
    """A unit of up to max_unit characters, holding a letter or digit, back to back min_repeats times
    over at least min_span characters (brute force, unlike detect.periodic_run's shifted compare)."""
    for p in range(1, min(max_unit, len(text) // min_repeats) + 1):
        span = max(p * min_repeats, min_span)
        for i in range(len(text) - span + 1):
            unit = text[i : i + p]
            if re.search(r"[^\W_]", unit) and text[i : i + span] == (unit * (span // p + 1))[:span]:
                return True
    return False


def structural_faults(turn: dict[str, Any]) -> set[str]:
    """Which structural detectors are true of this transcript turn, decided without detect.py."""
    faults = set()
    calls = turn["tool_calls"]
    if turn["finish_reason"] is None:
        faults.add("truncated_stream")
    texts = _texts(turn)
    if any(re.search("[\ud800-\udfff\ufffd]", t) for t in texts):
        faults.add("invalid_utf8")
    if any(_CONTROL.search(t) for t in texts):
        faults.add("control_chars")
    if any(_repeats(t) for t in texts):
        faults.add("degenerate_repetition")
    content = turn["content"] or ""
    if any(m in content for m in _LEAK_MARKERS) or re.search(r'\{\s*"(name|function)"\s*:', content):
        faults.add("leaked_tool_call")
    for call in calls:
        parsed = _arguments(call)
        if not isinstance(parsed, dict):
            faults.add("malformed_json")
        if call["name"] not in TOOL_SCHEMAS:
            faults.add("unknown_tool")
        elif isinstance(parsed, dict) and not jsonschema.Draft202012Validator(
            TOOL_SCHEMAS[call["name"]]
        ).is_valid(parsed):
            faults.add("schema_invalid")
    if not calls:
        faults.add("missing_tool_call")
    return faults


# the structural faults decided exactly above (the text-hygiene ones are checked one way only: a finding
# must be true; their thresholds are detect.py's to tune)
EXACT = {"truncated_stream", "malformed_json", "unknown_tool", "schema_invalid", "missing_tool_call"}


def strays_from_plan(turn: dict[str, Any], expected: ToolCall | None) -> bool:
    if expected is None:
        return False
    calls = turn["tool_calls"]
    if len(calls) != 1:
        return True
    return calls[0]["name"] != expected.name or _arguments(calls[0]) != dict(expected.arguments)


def expected_call(session_id: str, round_index: int, rounds: int) -> ToolCall | None:
    seed, index = session_id.removeprefix("s").split("-")
    return make_task(int(seed), int(index), rounds).expected(round_index)


# --- 1. forced calls: parsed, and judged right ---------------------------------------------------


def test_plan_forced_calls_are_parsed_and_every_structural_finding_is_true(
    plan_run: Run, llama_server: RealServer
) -> None:
    run, why = plan_run, plan_run.explain(llama_server)
    assert run.rc == 0, why
    summary = run.summary
    assert summary["settings"]["tool_choice"] == "plan", summary
    assert summary["counted_families"] == ["structural"], summary
    # a healthy server given well-formed requests at concurrency 1: nothing may error
    assert summary["errored"] == 0, f"{summary['by_error']}\n{why}"
    assert summary["sessions"] == PLAN_SESSIONS
    assert summary["clean"] + summary["corrupted"] == PLAN_SESSIONS

    transcripts = run.transcripts()
    outcomes = {o["session_id"]: o for o in run.sessions()}
    assert set(transcripts) == set(outcomes), "a transcript per session (--keep-transcripts)"
    structural_sessions, drift_sessions, turns_seen = set(), set(), 0
    for sid, transcript in transcripts.items():
        turns = transcript["turns"]
        assert transcript["status"] == outcomes[sid]["status"]
        assert turns, f"{sid}: no turn recorded"
        for turn in turns:
            turns_seen += 1
            r = turn["round_index"]
            where = f"{sid} round {r}: {turn['tool_calls']} {turn['findings']}"
            expected = expected_call(sid, r, PLAN_ROUNDS)
            # the call was parsed: exactly one (the legacy function_call delta beside tool_calls is not a
            # second), named, one of the tools offered, and the one the request forced
            assert len(turn["tool_calls"]) == 1, where
            call = turn["tool_calls"][0]
            assert call["name"] in TOOL_SCHEMAS, where
            assert call["name"] == expected.name, where
            assert call["id"], where
            assert turn["finish_reason"] == "tool_calls", where
            assert len(turn["findings"]) <= 1, where

            faults = structural_faults(turn)
            found = turn["findings"][0] if turn["findings"] else None
            if found is not None and found["family"] == "structural":
                # no structural false positive: what it says is true of the turn
                assert found["detector"] in faults, f"false positive {found['detector']}: {where}"
                structural_sessions.add(sid)
            else:
                # no structural fault missed: a turn the oracle passed (or found only drifting) is sound
                assert not faults & EXACT, f"missed {faults & EXACT}: {where}"
            if found is not None and found["family"] == "plan_drift":
                assert found["detector"] == "wrong_call", where
                assert strays_from_plan(turn, expected), f"false plan drift: {where}"
                drift_sessions.add(sid)
            if found is None:
                assert not faults, where
                assert not strays_from_plan(turn, expected), f"missed plan drift: {where}"

        outcome = outcomes[sid]
        last = turns[-1]
        if outcome["status"] == "corrupted":  # it ended at its first structural finding, no later
            assert outcome["bad_turn"]["family"] == "structural", outcome
            assert last["findings"] and last["findings"][0]["family"] == "structural", sid
            earlier = [f for t in turns[:-1] for f in t["findings"]]
            assert all(f["family"] != "structural" for f in earlier), sid
        else:  # plan drift did not end it: every round was played
            assert outcome["status"] == "clean", outcome
            assert len(turns) == PLAN_ROUNDS, sid
        assert all(n["family"] == "plan_drift" for n in outcome["noted"]), outcome

    # plan drift is counted apart: per session in by_family, never in corrupted
    assert summary["corrupted"] == len(structural_sessions), summary
    assert sum(summary["by_detector"].values()) == summary["corrupted"], summary
    assert summary["by_family"].get("structural", 0) == len(structural_sessions), summary
    assert summary["by_family"].get("plan_drift", 0) == len(drift_sessions), summary
    # this model strays from the plan (seen on every run: e.g. write_file with content of its own)
    assert drift_sessions, f"no plan drift seen: the test no longer checks that it is counted apart\n{why}"
    assert summary["turns"] == turns_seen


# --- 2. the server sends no usage: flagged as the server's ---------------------------------------


def test_stress_flags_the_missing_usage(plan_run: Run, llama_server: RealServer) -> None:
    summary = plan_run.summary
    assert summary["turns"] > 0, plan_run.explain(llama_server)
    assert summary["usage_missing_turns"] == summary["turns"], summary
    assert all(t["usage"] is None for tr in plan_run.transcripts().values() for t in tr["turns"])
    usage_warnings = [w for w in summary["warnings"] if "usage" in w]
    assert usage_warnings and "server" in usage_warnings[0], summary["warnings"]
    assert any(line.startswith("WARNING") and "usage" in line for line in plan_run.stdout.splitlines())


def test_bench_tok_s_is_na_and_the_footer_names_the_server(llama_server: RealServer, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    done = run_cli(
        BENCH, "--url", llama_server.url, "--concurrency", "1", "--requests", "3", "--input-len", "64",
        "--output-len", "16", "--out", str(out),
    )  # fmt: skip
    why = f"rc={done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, why
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["C", "ok"])
    columns = lines[header].split()
    row = lines[header + 1].split()
    assert row[0] == "1" and row[1] == "3", why
    assert row[columns.index("tok/s")] == "n/a", why
    footer = [line for line in lines[header + 1 :] if "usage" in line and not line.lstrip().startswith("!")]
    assert footer and "server" in footer[0], why
    assert not any("client may have been the bottleneck" in line for line in lines), why
    bench = json.loads((out / "bench.json").read_text())
    level = bench["levels"][0]
    assert level["requests"] == 3 and level["errors"] == 0, level
    assert level["missing_usage"] == 3, level
    assert bench["missing_usage"] == 3
    assert bench["client_bound"] is False  # the server's missing usage is not the client's fault


# --- 3. errors are counted apart, never as corruption --------------------------------------------


def _errors_apart(run: Run) -> None:
    summary, outcomes = run.summary, run.sessions()
    errored = [o for o in outcomes if o["status"] == "errored"]
    assert len(errored) == summary["errored"] == sum(summary["by_error"].values()), summary
    for o in errored:
        kind = o["error"].split(":", 1)[0]
        assert kind in summary["by_error"], o
        assert o["bad_turn"] is None and not o["noted"], o
    corrupted = [o for o in outcomes if o["status"] == "corrupted"]
    assert len(corrupted) == summary["corrupted"]
    assert all(o["bad_turn"]["family"] == "structural" for o in corrupted)
    # the stream the server cut ended with [DONE] and no finish_reason: never a truncated_stream finding
    assert "truncated_stream" not in summary["by_detector"], summary


def test_a_cut_stream_is_an_error_not_corruption(llama_server: RealServer, tmp_path: Path) -> None:
    """Two sessions at once against a one-request-at-a-time server: the second request cuts the first
    one's stream (the server sends [DONE] without a finish_reason and closes mid-chunk)."""
    run = stress(
        llama_server, tmp_path / "stress",
        "--sessions", "2", "--rounds", "1", "--concurrency", "2",
        "--tool-choice", "plan", "--count", "structural", "--keep-transcripts",
    )  # fmt: skip
    why = run.explain(llama_server)
    assert run.rc == 0, why  # the session that was served reached an outcome
    summary = run.summary
    assert summary["sessions"] == 2 and summary["errored"] == 1, why
    assert summary["by_error"] == {"stream_cut": 1}, why  # up all along: not server_gone
    assert summary["clean"] + summary["corrupted"] == 1, why
    _errors_apart(run)
    cut = next(t for t in run.transcripts().values() if t["status"] == "errored")
    assert cut["error"].startswith("stream_cut") and not cut["turns"], cut
    assert llama_server.answers()


def test_a_request_the_server_fails_is_an_error_and_nothing_measured_exits_1(
    llama_server: RealServer, tmp_path: Path
) -> None:
    """`tool_choice: "required"` is accepted by the server's request model, then its handler asserts
    "auto": HTTP 200 with an empty body. Every session errors, so the run measured nothing."""
    run = stress(
        llama_server, tmp_path / "stress",
        "--sessions", "2", "--rounds", "1", "--concurrency", "1", "--tool-choice", "required",
    )  # fmt: skip
    why = run.explain(llama_server)
    summary = run.summary
    assert run.rc == 1, why
    assert "no session reached an outcome" in run.stdout, why
    assert summary["clean"] == 0 and summary["corrupted"] == 0 and summary["errored"] == 2, why
    # the empty body is incomplete_stream; the next session's request may meet the connection the
    # server closed after it (stream_cut): errors either way, never server_gone, never corruption
    assert "incomplete_stream" in summary["by_error"], why
    assert set(summary["by_error"]) <= {"incomplete_stream", "stream_cut"}, why
    _errors_apart(run)
    assert llama_server.answers()


# --- 4. auto: nothing measurable must not pass for clean -----------------------------------------


def test_auto_tool_choice_measures_nothing_and_says_so(llama_server: RealServer, tmp_path: Path) -> None:
    """With `auto` this server streams only when the model answers in text; when the model picks a
    function (this model, on every workload prompt seen) it raises "Automatic streaming tool choice is
    not supported": HTTP 200, empty body. Observed: every session errors (incomplete_stream), the run
    exits 1 with a line saying nothing was measured. (Had the model answered in text, that turn would be
    missing_tool_call, counted as structural corruption: either way the run is not clean.)"""
    run = stress(
        llama_server, tmp_path / "stress",
        "--sessions", "2", "--rounds", "1", "--concurrency", "1", "--tool-choice", "auto",
    )  # fmt: skip
    why = run.explain(llama_server)
    summary = run.summary
    assert summary["settings"]["tool_choice"] == "auto", summary
    assert summary["clean"] == 0, why  # whatever happens, not clean
    assert run.rc == 1, why
    assert summary["errored"] == 2 and summary["corrupted"] == 0, why
    assert "incomplete_stream" in summary["by_error"], why
    assert set(summary["by_error"]) <= {"incomplete_stream", "stream_cut"}, why
    assert any("no session reached an outcome" in w for w in summary["warnings"]), summary
    assert "no session reached an outcome" in run.stdout, why
    _errors_apart(run)
