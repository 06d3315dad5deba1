"""Your own prompts (workload/prompts.py): the example file, the replay rule, and every refusal naming its
line and field."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.sim.agent import decide_reply
from orchestrator.workload import tasks
from orchestrator.workload.prompts import (
    MAX_PROBLEMS,
    Conversation,
    PromptsError,
    answer_finding,
    load_prompts,
    prompts_problems,
    replay_turns,
    session_conversation,
    session_id,
)
from orchestrator.workload.tasks import ToolCall

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/prompts/conversations.jsonl"

USER = {"role": "user", "content": "Hello"}
GOOD = {"id": "ok", "messages": [USER]}
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}


def call(call_id: str = "call_0", name: str = "read_file", arguments: str = '{"path": "a.py"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calling(*calls: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": list(calls)}


def answer(call_id: str = "call_0", content: str = "print(1)") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def write(tmp_path: Path, *lines: Any, name: str = "prompts.jsonl") -> Path:
    """A prompts file of these lines (dicts as JSON, strings as written)."""
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def conversation(messages: list[dict], tools: list[dict] | None = None) -> Conversation:
    return Conversation("c", tuple(messages), tuple(tools) if tools else None, None, 1)


def example_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_conversations", EXAMPLE.with_name("make_conversations.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the example file -------------------------------------------------------------------------------


def test_example_file_loads_and_equals_its_script():
    conversations = load_prompts(EXAMPLE)
    assert 18 <= len(conversations) <= 24
    assert len({c.id for c in conversations}) == len(conversations)
    assert prompts_problems(EXAMPLE) == []
    assert EXAMPLE.read_text(encoding="utf-8") == example_script().render()
    plans = [c for c in conversations if c.tools is not None]
    assert len(plans) == 8 and all(c.expected == tasks.DONE_REPLY for c in plans)
    chats = [c for c in conversations if c.tools is None]
    answered = [c for c in chats if c.expected is not None]
    assert len(answered) == 4
    for c in answered:  # the `Reply with exactly:` convention, which the simulated server follows
        last = c.messages[-1]["content"].splitlines()
        assert f"Reply with exactly: {c.expected}" in last
    assert any(len(replay_turns(c)) > 1 for c in chats) and any(len(replay_turns(c)) == 1 for c in chats)


def test_example_tool_plans_are_what_the_simulated_agent_answers():
    """Every turn of a tool plan as recorded: the simulated agent makes the recorded call, then DONE."""
    for c in load_prompts(EXAMPLE):
        if c.tools is None:
            continue
        turns = replay_turns(c)
        assert turns[-1].recorded is None and turns[-1].last
        for turn in turns:
            reply = decide_reply(turn.messages, list(c.tools), "auto")
            if turn.recorded is None:
                assert reply.content == c.expected
            else:
                assert reply.call == turn.expected_call


# --- the replay rule --------------------------------------------------------------------------------


def test_replay_multi_turn_chat_sends_the_recorded_answers():
    system = {"role": "system", "content": "Be brief."}
    first = {"role": "assistant", "content": "36."}
    then = {"role": "user", "content": "And minus 7?"}
    turns = replay_turns(conversation([system, USER, first, then]))
    assert [t.messages for t in turns] == [[system, USER], [system, USER, first, then]]
    assert [t.recorded for t in turns] == [first, None]
    assert [t.last for t in turns] == [False, True]
    assert [t.expected_call for t in turns] == [None, None]


def test_replay_single_turn_and_recorded_ending():
    (only,) = replay_turns(conversation([USER]))
    assert only.messages == [USER] and only.recorded is None and only.last
    reply = {"role": "assistant", "content": "Hi."}
    (recorded,) = replay_turns(conversation([USER, reply]))  # ends on its answer: no final turn
    assert recorded.messages == [USER] and recorded.recorded == reply and recorded.last


def test_replay_tool_conversation_expects_the_recorded_calls():
    task = tasks.make_task(3, 1, 3)
    script = example_script()
    line = script.plan_conversation(task)
    c = conversation(line["messages"], line["tools"])
    turns = replay_turns(c)
    assert len(turns) == 4
    for r, turn in enumerate(turns[:3]):
        assert turn.messages == line["messages"][: 2 + 2 * r]
        assert turn.expected_call == task.steps[r] and not turn.last
        assert tasks.rounds_done(turn.messages) == r
    assert turns[3].messages == line["messages"] and turns[3].expected_call is None and turns[3].last


def test_replay_expects_the_first_of_parallel_calls():
    both = calling(call("a", arguments='{"path": "x.py"}'), call("b", arguments='{"path": "y.py"}'))
    (turn, _) = replay_turns(conversation([USER, both, answer("a"), answer("b")], [READ_TOOL]))
    assert turn.expected_call == ToolCall("read_file", {"path": "x.py"})


def test_replay_turn_messages_are_fresh_lists():
    c = conversation([USER])
    replay_turns(c)[0].messages.append({"role": "assistant", "content": "x"})
    assert replay_turns(c)[0].messages == [USER]


# --- refusals ---------------------------------------------------------------------------------------

TOOLED = {"tools": [READ_TOOL]}
BAD_LINES = [
    ("bad json", '{"messages": [', None, "not JSON"),
    ("not an object", "[1, 2]", None, "a JSON array"),
    ("unknown key", {"prompt": "x", "messages": [USER]}, "prompt", "unknown key"),
    ("missing messages", {"id": "x"}, "messages", "missing"),
    ("empty messages", {"messages": []}, "messages", "an empty list"),
    ("bad role", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'bot'"),
    (
        "unknown message key",
        {"messages": [{"role": "user", "contents": "x"}]},
        "messages[0].contents",
        "unknown",
    ),
    ("content a number", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "a number"),
    (
        "image part",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].type",
        "'image_url'",
    ),
    (
        "first message assistant",
        {"messages": [{"role": "assistant", "content": "x"}]},
        "messages[0].role",
        "opens",
    ),
    (
        "unknown tool_call_id",
        {**TOOLED, "messages": [USER, calling(call()), answer("call_9")]},
        "messages[2].tool_call_id",
        "'call_9' names no earlier tool call",
    ),
    (
        "arguments not JSON",
        {**TOOLED, "messages": [USER, calling(call(arguments='{"path": '))]},
        "messages[1].tool_calls[0].function.arguments",
        "not JSON",
    ),
    (
        "arguments not an object",
        {**TOOLED, "messages": [USER, calling(call(arguments="[1]"))]},
        "messages[1].tool_calls[0].function.arguments",
        "not an object",
    ),
    (
        "arguments off the schema",
        {**TOOLED, "messages": [USER, calling(call(arguments='{"file": "a.py"}'))]},
        "messages[1].tool_calls[0].function.arguments",
        "does not fit read_file's parameters",
    ),
    (
        "tool not among tools",
        {**TOOLED, "messages": [USER, calling(call(name="rm_rf"))]},
        "messages[1].tool_calls[0].function.name",
        "'rm_rf' is not one of the line's tools",
    ),
    (
        "tool calls without tools",
        {"messages": [USER, calling(call())]},
        "messages[1].tool_calls",
        "without tools",
    ),
    (
        "unanswered call",
        {**TOOLED, "messages": [USER, calling(call()), USER]},
        "messages[1].tool_calls[0].id",
        "not answered before messages[2]",
    ),
    ("duplicate id", {"id": "ok", "messages": [USER]}, "id", "already line 1's id"),
    ("id with a slash", {"id": "a/b", "messages": [USER]}, "id", "'a/b'"),
    ("blank expected", {"expected": "  ", "messages": [USER]}, "expected", "string"),
    ("metadata a list", {"metadata": [], "messages": [USER]}, "metadata", "an array"),
    (
        "tool type",
        {"tools": [{"type": "code", "function": READ_TOOL["function"]}], "messages": [USER]},
        "tools[0].type",
        "'code'",
    ),
    (
        "tool parameters not a schema",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
            "messages": [USER],
        },
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    (
        "ends on system",
        {"messages": [USER, {"role": "system", "content": "x"}]},
        "messages[1].role",
        "ends on",
    ),
]


@pytest.mark.parametrize(("line", "field", "what"), [b[1:] for b in BAD_LINES], ids=[b[0] for b in BAD_LINES])
def test_a_bad_line_is_refused_naming_line_and_field(tmp_path, line, field, what):
    path = write(tmp_path, GOOD, "", line)  # a blank line is skipped, and still counted
    with pytest.raises(PromptsError) as refused:
        load_prompts(path)
    message = str(refused.value)
    where = f"{field}: " if field else ""
    assert message.startswith(f"{path} line 3: {where}"), message
    assert what in message and "; accepted: " in message, message
    assert prompts_problems(path)[0] == message


def test_problems_lists_several_at_once(tmp_path):
    path = write(tmp_path, GOOD, "nope", {"messages": [{"role": "bot"}]}, {"id": "ok", "messages": [USER]})
    problems = prompts_problems(path)
    assert [p.split(":")[0] for p in problems] == [f"{path} line {n}" for n in (2, 3, 4)]
    assert "messages[0].role" in problems[1] and "id" in problems[2]


def test_problems_stop_after_max(tmp_path):
    path = write(tmp_path, *(["[]"] * (MAX_PROBLEMS + 5)))
    problems = prompts_problems(path)
    assert len(problems) == MAX_PROBLEMS + 1 and "more problems" in problems[-1]


def test_unreadable_empty_and_non_utf8_files(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(PromptsError, match=r"missing\.jsonl: cannot read it"):
        load_prompts(missing)
    assert len(prompts_problems(missing)) == 1
    empty = write(tmp_path, "", "  ", name="empty.jsonl")
    with pytest.raises(PromptsError, match="no conversations"):
        load_prompts(empty)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(
        json.dumps(GOOD).encode() + b'\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'
    )
    with pytest.raises(PromptsError, match=r"latin\.jsonl line 2: not UTF-8"):
        load_prompts(latin)


def test_good_lines_load_as_given(tmp_path):
    tooled = {
        "expected": "ok",
        "metadata": {"from": "prod"},
        **TOOLED,
        "messages": [USER, calling(call()), answer()],
    }
    path = write(tmp_path, tooled, "", GOOD)
    first, second = load_prompts(path)
    assert first == Conversation("line1", tuple(tooled["messages"]), (READ_TOOL,), "ok", 1)
    assert second == Conversation("ok", (USER,), None, None, 3)


# --- sessions ---------------------------------------------------------------------------------------


def test_sessions_cycle_offset_by_seed():
    cs = tuple(Conversation(x, (USER,), None, None, n) for n, x in enumerate("abc", 1))
    assert [session_conversation(cs, 0, i).id for i in range(5)] == ["a", "b", "c", "a", "b"]
    assert [session_conversation(cs, 1, i).id for i in range(3)] == ["b", "c", "a"]
    assert session_conversation(cs, 7919, 0).id == "c"  # the next repetition starts elsewhere
    ids = {session_id(session_conversation(cs, s, i), s, i) for s in (0, 7919) for i in range(6)}
    assert len(ids) == 12 and session_id(cs[0], 7, 3) == "a~s7-00003"
    with pytest.raises(ValueError):
        session_conversation((), 0, 0)


# --- the answer oracle ------------------------------------------------------------------------------


def test_answer_finding():
    assert answer_finding("anything", None) is None
    assert answer_finding("The answer is\n  391.", "391") is None
    assert answer_finding("  on  the\tmat ", "on the mat") is None
    assert answer_finding("Done", "DONE") is not None  # case kept
    finding = answer_finding("I think it is 392." + " x" * 200, "391")
    assert finding.detector == "wrong_answer" and finding.family == "wrong_answer"
    assert "'391'" in finding.reason and "I think it is 392." in finding.reason
    assert len(finding.reason) < 400
