"""The scripted agent, its token stream, the corruption shapes and the tool-call parser (pure)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from orchestrator.sim import agent
from orchestrator.sim.faults import SHAPES
from orchestrator.workload import tasks
from orchestrator.workload.detect import periodic_run


def conversation(rounds: int, done: int, seed: int = 3):
    task = tasks.make_task(seed, 0, rounds)
    return task, tasks.conversation_after(task, done)


def test_tokenize_is_lossless_and_markers_are_single_tokens():
    text = agent.call_text("write_file", {"path": "notes/a b.md", "content": "# x\nchecked: 12\n"})
    tokens = agent.tokenize(text)
    assert "".join(tokens) == text
    assert agent.CALLS_BEGIN in tokens and agent.SEP in tokens and agent.CALL_END in tokens
    assert 10 < len(tokens) < len(text)


@pytest.mark.parametrize("done", [0, 1, 2])
def test_healthy_agent_follows_the_plan_then_says_done(done):
    task, messages = conversation(3, done)
    reply = agent.decide_reply(messages, tasks.TOOLS, "auto")
    assert reply.planned and reply.call == task.steps[done]
    parsed = agent.parse_output("".join(agent.render(reply, 1024, False)))
    assert parsed.content == ""
    assert [(n, json.loads(a)) for n, a in parsed.calls] == [
        (task.steps[done].name, dict(task.steps[done].arguments))
    ]
    _, finished = conversation(3, 3)
    final = agent.decide_reply(finished, tasks.TOOLS, "auto")
    assert final.call is None and final.content == tasks.DONE_REPLY and not final.planned


def test_plain_chat_and_ignore_eos_lengths():
    hello = [{"role": "user", "content": "Hello"}]
    assert len(agent.render(agent.decide_reply(hello, None, "auto"), 8, False)) == 8
    assert len(agent.render(agent.decide_reply(hello, None, "auto"), 300, True)) == 300
    assert (
        len(agent.render(agent.decide_reply(hello, None, "auto"), None, False)) == agent.DEFAULT_CHAT_TOKENS
    )
    forced = agent.decide_reply(hello, tasks.TOOLS, {"type": "function", "function": {"name": "search"}})
    assert forced.call is not None and forced.call.name == "search" and not forced.planned


def test_parse_output_is_safe_on_every_prefix():
    raw = agent.call_text("search", {"query": "a b", "max_results": 5})
    tokens = agent.tokenize(raw)
    seen_args = ""
    for i in range(len(tokens) + 1):
        parsed = agent.parse_output("".join(tokens[:i]))
        assert parsed.content == ""
        if parsed.calls:
            name, args = parsed.calls[0]
            assert name == "search" and args.startswith(seen_args)  # arguments only grow
            seen_args = args
    assert json.loads(seen_args) == {"query": "a b", "max_results": 5}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(5))
def test_every_shape_is_a_detectable_corruption(shape, seed):
    _, messages = conversation(4, seed % 4, seed=seed)
    reply = agent.decide_reply(messages, tasks.TOOLS, "auto")
    expected = reply.call
    tokens = agent.corrupt(reply, shape, random.Random(seed), messages, tasks.TOOLS, 1024)
    parsed = agent.parse_output("".join(tokens))
    names = agent.tool_names(tasks.TOOLS)
    if shape in ("truncated_arguments", "invalid_json"):
        ((name, args),) = parsed.calls
        assert name == expected.name
        with pytest.raises(ValueError):
            json.loads(args)
    elif shape == "unknown_tool":
        ((name, args),) = parsed.calls
        assert name not in names and json.loads(args) == dict(expected.arguments)
    elif shape == "leaked_text":
        assert parsed.calls == () and json.loads(parsed.content)["name"] == expected.name
    elif shape == "repetition":
        assert parsed.calls == () and len(tokens) == agent.REPETITION_CAP
        tail = tokens[-40:]  # a short unit, over and over: the tail is periodic with a short period
        assert any(all(tail[i] == tail[i + p] for i in range(len(tail) - p)) for p in range(1, 10))
    else:  # wrong_arguments: a valid call, schema-valid, but not the expected one
        ((name, args),) = parsed.calls
        assert name in names
        jsonschema.validate(json.loads(args), tasks.TOOL_SCHEMAS[name])
        assert (name, json.loads(args)) != (expected.name, dict(expected.arguments))


def test_a_repetition_of_any_call_the_workload_makes_is_one_the_oracle_calls_a_repetition():
    """Every shell command the workload's tasks can ask for (each template with each word and module)
    and the argument strings of 40 seeds x 20 sessions of tasks: a looped decode of each holds a letter
    or digit, so the oracle's detector finds it. (`ls src/` once looped its empty tail, a bare space: the
    oracle saw a missing tool call instead, and the stress test comparing the two failed.)"""
    values = {
        ("run_shell", c.format(w=w, m=m))
        for c in tasks._COMMANDS
        for w in tasks._WORDS
        for m in tasks._MODULES
    }
    for seed in range(40):
        for session in range(20):
            for call in tasks.make_task(seed, session, 4).steps:
                values |= {(call.name, v) for v in call.arguments.values() if isinstance(v, str)}
    missed = []
    for name, value in sorted(values):
        reply = agent.Reply(call=tasks.ToolCall(name, {"only": value}))
        tokens = agent.corrupt(reply, "repetition", random.Random(0), [], tasks.TOOLS, 1024)
        if periodic_run("".join(tokens)) is None:
            missed.append((name, value))
    assert not missed, missed[:10]


def test_corruption_respects_max_tokens():
    _, messages = conversation(2, 0)
    reply = agent.decide_reply(messages, tasks.TOOLS, "auto")
    assert len(agent.corrupt(reply, "repetition", random.Random(0), messages, tasks.TOOLS, 40)) == 40
