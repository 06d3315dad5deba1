"""Tool-calling tasks: the contract between the stress workload and whatever serves it.

A task is a seeded, known sequence of tool calls. The user message states the plan in plain words and
as a JSON block between `<plan>` and `</plan>`; a capable model (or the simulated target's scripted
agent) performs one call per assistant turn, in order. Knowing the expected call per round is what
lets the oracle tell "lost the plot" (a valid call, but the wrong one) from a structural failure.

Everything here is pure and deterministic in the seed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful software agent working in a sandboxed repository. You act only through the tools "
    "you are given. Each turn, make exactly one tool call, following the user's plan step by step, with "
    "exactly the arguments the plan gives. Do not explain, do not skip or repeat steps, do not invent "
    "tools. When every step of the plan is done, reply with the single word DONE.\n"
    "Conventions: paths are relative to the repository root; shell commands run in a POSIX shell with a "
    "timeout in seconds; search queries are plain text; URLs are fetched with GET and no credentials."
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "minLength": 1}},
                "required": ["path"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write (replace) a text file in the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "minLength": 1},
                    "content": {"type": "string"},
                },
                "required": ["path", "content"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "minLength": 1},
                    "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
                },
                "required": ["command", "timeout_s"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the repository for text.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "minLength": 1},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
                },
                "required": ["query", "max_results"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "http_get",
            "description": "Fetch a URL with HTTP GET.",
            "parameters": {
                "type": "object",
                "properties": {"url": {"type": "string", "pattern": "^https?://"}},
                "required": ["url"],
                "additionalProperties": False,
            },
        },
    },
]

TOOL_SCHEMAS: dict[str, dict[str, Any]] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

_MODULES = [
    "scheduler",
    "radix_cache",
    "tokenizer_manager",
    "disagg_decode",
    "indexer",
    "memory_pool",
    "cuda_graph_runner",
    "router",
    "hicache",
    "sampler",
    "model_runner",
    "io_struct",
]
_WORDS = [
    "bootstrap_room",
    "KVPoll",
    "capture",
    "alt_stream",
    "index_k",
    "top_k",
    "mempool",
    "retract",
    "overlap",
    "heartbeat",
    "transfer",
    "checksum",
    "prefix",
    "eviction",
    "logits",
]
_COMMANDS = [
    "pytest -q tests/{m}",
    "git diff --stat",
    "grep -rn {w} src/",
    "python -m compileall src/{m}.py",
    "wc -l src/{m}.py",
    "ls src/",
]
_HOSTS = ["docs.example.org", "issues.example.org", "mirror.example.org"]

PLAN_RE = re.compile(r"<plan>\s*(\[.*?\])\s*</plan>", re.DOTALL)
DONE_REPLY = "DONE"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": dict(self.arguments)}


@dataclass(frozen=True)
class Task:
    task_id: str
    steps: tuple[ToolCall, ...]

    def expected(self, round_index: int) -> ToolCall | None:
        """The call expected in round `round_index` (0-based), or None once the plan is done."""
        return self.steps[round_index] if round_index < len(self.steps) else None


#: `auto`: the model decides; `required`: some tool call is forced; `plan`: the call the plan expects
#: next is forced by name (a model that makes no call unless forced can still be measured).
TOOL_CHOICES = ("auto", "required", "plan")


def tool_choice_for(mode: str, expected: ToolCall | None) -> Any:
    """The request's `tool_choice` for a round whose plan expects `expected` (None: the plan is done)."""
    if mode == "plan":
        return {"type": "function", "function": {"name": expected.name}} if expected else "auto"
    return mode


def make_task(seed: int, session_index: int, rounds: int) -> Task:
    """A task of `rounds` steps, deterministic in (seed, session_index)."""
    rng = random.Random(f"{seed}:{session_index}")
    steps = tuple(_random_step(rng) for _ in range(rounds))
    return Task(task_id=f"s{seed}-{session_index:05d}", steps=steps)


def _random_step(rng: random.Random) -> ToolCall:
    module, word = rng.choice(_MODULES), rng.choice(_WORDS)
    name = rng.choice(sorted(TOOL_SCHEMAS))
    if name == "read_file":
        args: dict[str, Any] = {"path": f"src/{module}.py"}
    elif name == "write_file":
        args = {
            "path": f"notes/{module}_{word}.md",
            "content": f"# {word} in {module}\nchecked: {rng.randint(1, 999)}\n",
        }
    elif name == "run_shell":
        args = {
            "command": rng.choice(_COMMANDS).format(m=module, w=word),
            "timeout_s": rng.choice([30, 60, 120]),
        }
    elif name == "search":
        args = {"query": f"{word} {module}", "max_results": rng.choice([5, 10, 20])}
    else:
        args = {"url": f"https://{rng.choice(_HOSTS)}/{module}/{word}"}
    return ToolCall(name, args)


def user_prompt(task: Task) -> str:
    """The user message that states the plan, in words and as a parseable JSON block."""
    lines = [f"Task {task.task_id}: perform the following plan, one tool call per turn, in order."]
    # each step's arguments serialised once, for its line and for the plan: the plan is exactly
    # json.dumps([s.as_json() for s in task.steps], sort_keys=True) ("arguments" sorts before "name")
    entries = []
    for i, step in enumerate(task.steps, 1):
        arguments = json.dumps(dict(step.arguments), sort_keys=True)
        lines.append(f"{i}. call {step.name} with {arguments}")
        entries.append(f'{{"arguments": {arguments}, "name": {json.dumps(step.name)}}}')
    lines.append(f"<plan>[{', '.join(entries)}]</plan>")
    return "\n".join(lines)


def initial_messages(task: Task) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(task)}]


def tool_result(task: Task, round_index: int) -> str:
    """A deterministic synthetic tool output for the call of round `round_index` (grows the context)."""
    step = task.steps[round_index]
    body = " ".join(_choices(random.Random(f"{task.task_id}:{round_index}"), _WORDS, 40))
    return f"[{step.name} ok] {json.dumps(dict(step.arguments), sort_keys=True)}\n{body}"


def _choices(rng: random.Random, words: Sequence[str], k: int) -> list[str]:
    """`[rng.choice(words) for _ in range(k)]`, the same words from the same generator state, without a
    method call per word: `choice` takes `_randbelow(len(words))`, i.e. getrandbits(bit_length) until
    the value is below the length (tests/workload/test_fast_paths.py checks the two agree)."""
    n = len(words)
    bits = n.bit_length()
    getrandbits = rng.getrandbits
    out = []
    for _ in range(k):
        r = getrandbits(bits)
        while r >= n:
            r = getrandbits(bits)
        out.append(words[r])
    return out


def conversation_after(task: Task, rounds_done: int) -> list[dict[str, Any]]:
    """The conversation of a session whose first `rounds_done` rounds went exactly to plan."""
    messages = initial_messages(task)
    for r in range(rounds_done):
        step, call_id = task.steps[r], f"c{r}"
        function = {"name": step.name, "arguments": json.dumps(dict(step.arguments))}
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call_id, "type": "function", "function": function}],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(task, r)})
    return messages


def parse_plan(messages: Sequence[Mapping[str, Any]]) -> list[ToolCall] | None:
    """The plan stated in the first user message of a conversation, or None if there is none."""
    for message in messages:
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            found = PLAN_RE.search(message["content"])
            if not found:
                return None
            try:
                return [ToolCall(s["name"], s.get("arguments", {})) for s in json.loads(found.group(1))]
            except (ValueError, KeyError, TypeError):
                return None
    return None


def rounds_done(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many tool results the conversation already holds (= the 0-based index of the next round)."""
    return sum(1 for m in messages if m.get("role") == "tool")


def next_expected_call(messages: Sequence[Mapping[str, Any]]) -> ToolCall | None:
    """What a correct agent calls next in this conversation; None when the plan is done or absent."""
    plan = parse_plan(messages)
    if plan is None:
        return None
    index = rounds_done(messages)
    return plan[index] if index < len(plan) else None


_TAG_RE = re.compile(r"^heisenhunt (\S+) turn (\d+)/(\d+)$")


def session_tag(session_id: str, round_index: int, turns: int) -> str:
    """The OpenAI `user` field of a session's turn: which session, which turn of how many. A conversation
    of a prompts file carries no plan, so the embedded default reads its session from this (its load
    model counts open sessions); a real server only logs it. No space in `session_id`."""
    return f"heisenhunt {session_id} turn {round_index + 1}/{turns}"


def parse_session_tag(user: Any) -> tuple[str, int, int] | None:
    """(session id, round index, turns) of a `session_tag`, or None for anything else."""
    found = _TAG_RE.match(user) if isinstance(user, str) else None
    if not found or not 1 <= int(found.group(2)) <= int(found.group(3)):
        return None
    return found.group(1), int(found.group(2)) - 1, int(found.group(3))
