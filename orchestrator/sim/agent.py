"""The simulated model: a scripted agent, its raw token stream, the corruption shapes, and the
tool-call parser that turns raw output into OpenAI fields.

The agent follows the plan of `orchestrator.workload.tasks`: one tool call per turn, the one
`tasks.next_expected_call(messages)` names, then `tasks.DONE_REPLY` as plain content. Any other chat
gets a short deterministic plain-text answer (exactly `max_tokens` tokens with `ignore_eos`, as a
benchmark asks for). So a healthy server yields zero corrupted sessions.

Output is raw text in DeepSeek's tool-call markup (`<｜tool▁calls▁begin｜>...`), cut into tokens
by `tokenize` (markers are one token, words and punctuation a token each: roughly BPE-sized). The
server runs `parse_output` on what has been generated so far, as SGLang's `deepseekv4` parser does,
so a corrupted raw stream surfaces to the client exactly as it would from a real server: broken
arguments, a tool name nobody declared, a call leaked as plain content, a degenerate repetition, a
valid call with the wrong arguments. Pure and deterministic given the `random.Random` passed in.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.workload import tasks

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜>"

_TOKEN_RE = re.compile(r"<｜[^｜<>]{1,40}｜>|\s?[A-Za-z]{1,8}|\s?\d{1,3}|\s?[^\sA-Za-z\d]|\s+")
_CHAT_REPLY = (
    "This is heisenhunt's simulated server, a test target that speaks SGLang's API. It has no model "
    "weights: it follows the tool plan it is given and otherwise writes this filler text. "
)
DEFAULT_CHAT_TOKENS = 48
_EXACT_RE = re.compile(r"Reply with exactly:[ \t]*(\S[^\n]*)")
# what a diverged continuation is made of (any words: the point is that they differ from the reference)
_DRIFT_WORDS = (" however", " thus", " the", " a", " it", " then", " so", " which", " this", " and")
REPETITION_CAP = 512


@dataclass(frozen=True)
class Reply:
    """What the agent means to say this turn: plain content, or one tool call."""

    content: str | None = None
    call: tasks.ToolCall | None = None
    # a call the plan asks for: the only kind of turn the fault model may corrupt
    planned: bool = False


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: tuple[tuple[str, str], ...]  # (name, raw arguments text) per call whose name is complete


def tokenize(text: str) -> list[str]:
    """Lossless: `''.join(tokenize(t)) == t`."""
    return _TOKEN_RE.findall(text)


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    names = []
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def decide_reply(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any
) -> Reply:
    """The correct reply to this conversation."""
    names = tool_names(tools)
    plan = tasks.parse_plan(messages) if isinstance(messages, Sequence) else None
    if plan is not None:
        expected = tasks.next_expected_call(messages)
        if expected is None:
            return Reply(content=tasks.DONE_REPLY)
        if tool_choice != "none" and expected.name in names:
            return Reply(call=expected, planned=True)
        return Reply(content=f"I would call {expected.name} next, but that tool is not available to me.")
    forced = _forced_tool(tool_choice, names)
    if forced is not None:
        return Reply(call=tasks.ToolCall(forced, {}))
    exact = _asked_reply(messages)
    if exact is not None:
        return Reply(content=exact)
    return Reply(content=None)  # plain chat: filler text, length decided by `render`


def _asked_reply(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The text of a `Reply with exactly: <text>` line in the last user message (a convention an
    instruction-following model follows too: the prompts file's answers are then right on the sim)."""
    users = [m.get("content") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
    last = users[-1] if users else None
    if isinstance(last, list):  # content parts
        last = "\n".join(p.get("text", "") for p in last if isinstance(p, Mapping))
    found = _EXACT_RE.search(last) if isinstance(last, str) else None
    return found.group(1).strip() if found else None


def _forced_tool(tool_choice: Any, names: list[str]) -> str | None:
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        return name if name in names else None
    if tool_choice == "required" and names:
        return names[0]
    return None


def call_text(name: str, arguments: Mapping[str, Any] | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments), ensure_ascii=False)
    return f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}{args}{CALL_END}{CALLS_END}"


def render(reply: Reply, max_tokens: int | None, ignore_eos: bool) -> list[str]:
    """The raw tokens of a correct reply."""
    if reply.call is not None:
        return tokenize(call_text(reply.call.name, reply.call.arguments))
    if reply.content is not None:
        return tokenize(reply.content)
    n = (
        max_tokens
        if (ignore_eos and max_tokens)
        else min(max_tokens or DEFAULT_CHAT_TOKENS, DEFAULT_CHAT_TOKENS)
    )
    return filler(n)


def filler(n: int) -> list[str]:
    base = tokenize(_CHAT_REPLY)
    return [base[i % len(base)] for i in range(max(0, n))]


def corrupt(
    reply: Reply,
    shape: str,
    rng: random.Random,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    max_tokens: int | None,
) -> list[str]:
    """The raw tokens of `reply` (a tool call) as the modelled fault garbles it."""
    assert reply.call is not None
    name, args = reply.call.name, dict(reply.call.arguments)
    args_text = json.dumps(args, ensure_ascii=False)
    if shape == "truncated_arguments":
        cut = rng.randint(1, max(1, len(args_text) - 2))
        return tokenize(f"{CALLS_BEGIN}{CALL_BEGIN}{name}{SEP}{args_text[:cut]}{CALL_END}{CALLS_END}")
    if shape == "invalid_json":
        return tokenize(call_text(name, _invalid_json(args_text, rng)))
    if shape == "unknown_tool":
        return tokenize(call_text(_unknown_name(name, tool_names(tools), rng), args))
    if shape == "leaked_text":
        return tokenize(json.dumps({"name": name, "arguments": args}, ensure_ascii=False))
    if shape == "repetition":
        limit = min(max_tokens or REPETITION_CAP, REPETITION_CAP)
        strings = [v for v in args.values() if isinstance(v, str)] or [name]
        unit = tokenize(f" {_repeated_word(rng.choice(strings), name)}")
        head = tokenize(f"{name}(")
        return (head + unit * limit)[:limit]
    if shape == "wrong_arguments":
        return tokenize(call_text(*_wrong_call(reply.call, messages, rng)))
    raise ValueError(f"unknown corruption shape {shape!r}")


def diverge(tokens: Sequence[str], rng: random.Random) -> list[str]:
    """`tokens` as a decode under load may emit them instead: the same up to a position drawn uniformly,
    then a different continuation of the same length (the argmax flipped there, and every later token
    followed the new prefix). The token at the position always differs; an empty reply stays empty."""
    if not tokens:
        return list(tokens)
    at = rng.randrange(len(tokens))
    words = [w for w in _DRIFT_WORDS if w != tokens[at]]
    tail = [words[0 if i == 0 else rng.randrange(len(words))] for i in range(len(tokens) - at)]
    tail[0] = rng.choice(words)
    return [*tokens[:at], *tail]


def _repeated_word(text: str, name: str) -> str:
    """What a looping decode repeats of an argument: its last path segment holding a letter or digit (a
    loop on `src/`'s empty tail would repeat a bare space, which no oracle calls a repetition), at most
    24 characters; the tool's name when there is none."""
    words = [w for w in text.split("/") if any(c.isalnum() for c in w)]
    return (words[-1] if words else name)[:24]


def _invalid_json(text: str, rng: random.Random) -> str:
    mutations = (
        lambda t: t.replace('"', "", 1),
        lambda t: t.replace(": ", ":: ", 1),
        lambda t: t.replace(", ", ",, ", 1) if ", " in t else t[:-1] + ",}",
        lambda t: t[:-1] + '"}',
        lambda t: t + "}",
    )
    for mutate in rng.sample(mutations, len(mutations)):
        candidate = mutate(text)
        try:
            json.loads(candidate)
        except ValueError:
            return candidate
    return text + "}"


def _unknown_name(name: str, declared: list[str], rng: random.Random) -> str:
    candidates = [name[:-1], name + "s", name.replace("_", ""), f"{name}_{name.split('_')[-1]}", f"{name}2"]
    candidates = [c for c in candidates if c and c not in declared]
    return rng.choice(candidates) if candidates else f"{name}_unknown"


def _wrong_call(call: tasks.ToolCall, messages: Sequence[Mapping[str, Any]], rng: random.Random):
    """A schema-valid call that is not the expected one: another step of the plan (the model lost its
    place), else the expected tool with a string argument changed."""
    plan = tasks.parse_plan(messages) or []
    others = [s for s in plan if s.as_json() != call.as_json()]
    if others:
        other = rng.choice(others)
        return other.name, dict(other.arguments)
    args = dict(call.arguments)
    for key, value in args.items():
        if isinstance(value, str):
            args[key] = value + "_old"
            return call.name, args
    return call.name, args


def parse_output(raw: str) -> Parsed:
    """SGLang-style tool-call parsing of raw output so far (safe on any prefix of a generation):
    text before the calls block is content; each call whose name is complete is reported with the
    arguments text generated so far."""
    start = raw.find(CALLS_BEGIN)
    if start < 0:
        return Parsed(raw, ())
    calls = []
    for segment in raw[start + len(CALLS_BEGIN) :].split(CALL_BEGIN)[1:]:
        if SEP not in segment:
            break
        name, _, rest = segment.partition(SEP)
        args = rest.split(CALL_END, 1)[0]
        calls.append((name, args))
    return Parsed(raw[:start], tuple(calls))
