"""Writes conversations.jsonl, the example prompts file
(`workload.prompts=examples/prompts/conversations.jsonl`).

    python examples/prompts/make_conversations.py          # rewrite the file next to this script
    python examples/prompts/make_conversations.py --check  # exit 1 if the file differs from what it writes

Two kinds of conversation (README.md says what each shows):
- tool plans: the built-in workload's tasks (orchestrator.workload.tasks) recorded as a model that follows
  the plan would answer them, one tool call per assistant message, each followed by its tool result, and
  ended on the last tool result: the final turn's expected answer is tasks.DONE_REPLY. The simulated
  server follows the same plan, so it answers every turn as recorded.
- plain chats: questions with no tools, some with recorded answers between the user's messages. Those with
  an `expected` answer end with a line `Reply with exactly: <answer>`, which an instruction-following
  model obeys and the simulated server answers the same way.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from orchestrator.workload.tasks import DONE_REPLY, TOOLS, Task, initial_messages, make_task, tool_result

OUT = Path(__file__).with_name("conversations.jsonl")
SEED = 49  # the issue that asked for your own prompts
PLAN_ROUNDS = (2, 3, 4, 5, 3, 6, 4, 2)  # one tool-plan conversation each, of that many calls


def plan_conversation(task: Task) -> dict[str, Any]:
    """The task as a plan-following model answers it, ending on its last tool result (the DONE turn)."""
    messages = initial_messages(task)
    for r, step in enumerate(task.steps):
        call_id = f"call_{r}"
        function = {"name": step.name, "arguments": json.dumps(dict(step.arguments))}
        call = {"id": call_id, "type": "function", "function": function}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool_result(task, r)})
    return {
        "id": f"plan-{task.task_id}",
        "metadata": {"kind": "tool_plan", "calls": len(task.steps)},
        "expected": DONE_REPLY,
        "tools": TOOLS,
        "messages": messages,
    }


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


CONCISE = {"role": "system", "content": "You are a concise, accurate assistant."}

INCIDENT = (
    "Summarise this incident report for an engineering manager in three bullet points.\n\n"
    "At 02:14 UTC the inference cluster began returning truncated tool calls for roughly 3% of "
    "requests. The on-call engineer saw no errors in the server logs; responses had status 200 and "
    "finish_reason 'stop'. The share of bad responses rose with load and fell to zero below 40 "
    "concurrent sessions. Rolling back the overlap scheduler flag at 03:05 stopped the failures; "
    "re-enabling it on one node brought them back within ten minutes. A fix to the scheduler's "
    "stream synchronisation was deployed at 11:30 and the flag was re-enabled fleet-wide at 14:00 "
    "with no further failures in 24 hours of traffic."
)

CHATS: list[dict[str, Any]] = [
    # expected answers, in the `Reply with exactly:` convention
    {
        "id": "arith-17x23",
        "metadata": {"kind": "chat", "topic": "arithmetic"},
        "expected": "391",
        "messages": [user("What is 17 * 23?\nReply with exactly: 391")],
    },
    {
        "id": "capital-australia",
        "metadata": {"kind": "chat", "topic": "facts"},
        "expected": "Canberra",
        "messages": [CONCISE, user("What is the capital of Australia?\nReply with exactly: Canberra")],
    },
    {
        "id": "python-output",
        "metadata": {"kind": "chat", "topic": "code"},
        "expected": "[3, 2, 1]",
        "messages": [
            user(
                "What does this Python program print?\n\n```python\nprint(sorted([3, 1, 2])[::-1])\n```\n"
                "Reply with exactly: [3, 2, 1]"
            )
        ],
    },
    {
        "id": "eggs-two-turns",
        "metadata": {"kind": "chat", "topic": "arithmetic", "turns": 2},
        "expected": "29",
        "messages": [
            user("I have 3 boxes of 12 eggs. How many eggs do I have?"),
            assistant("You have 3 * 12 = 36 eggs."),
            user("I use 7 of them for a cake. How many are left?\nReply with exactly: 29"),
        ],
    },
    # no expected answer: judged by the tool-call oracle's text checks, or against the batch-1 reference
    {
        "id": "palindrome-function",
        "metadata": {"kind": "chat", "topic": "code"},
        "messages": [
            user(
                "Write a Python function is_palindrome(s) that ignores case and any character that is "
                "not a letter or digit. Include two doctest examples."
            )
        ],
    },
    {
        "id": "tcp-vs-udp",
        "metadata": {"kind": "chat", "topic": "explanation"},
        "messages": [CONCISE, user("Explain the difference between TCP and UDP in three sentences.")],
    },
    {
        "id": "incident-summary",
        "metadata": {"kind": "chat", "topic": "summary"},
        "messages": [user(INCIDENT)],
    },
    {
        "id": "race-condition",
        "metadata": {"kind": "chat", "topic": "explanation", "note": "developer role, content parts"},
        "messages": [
            {"role": "developer", "content": "Answer in one short paragraph, without code."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is a race condition?"},
                    {"type": "text", "text": "Give one example from web servers."},
                ],
            },
        ],
    },
    {
        "id": "type-hints-two-turns",
        "metadata": {"kind": "chat", "topic": "code", "turns": 2},
        "messages": [
            user("Review this function:\n\ndef mean(xs):\n    return sum(xs) / len(xs)"),
            assistant(
                "It works for non-empty sequences of numbers, but raises ZeroDivisionError on an empty "
                "one. Decide whether that should return None, raise a clearer ValueError, or stay as is."
            ),
            user("Make it raise ValueError on an empty sequence and add type hints."),
        ],
    },
    {
        "id": "units-three-turns",
        "metadata": {"kind": "chat", "topic": "arithmetic", "turns": 3},
        "messages": [
            CONCISE,
            user("Convert 5 miles to kilometres."),
            assistant("5 miles is about 8.05 km."),
            user("And 10 kilometres to miles?"),
            assistant("10 km is about 6.21 miles."),
            user("So which is longer, a 10K race or a 5-mile race, and by how much?"),
        ],
    },
    {
        "id": "sql-recorded-answer",
        "metadata": {"kind": "chat", "topic": "code", "note": "ends on its recorded answer"},
        "messages": [
            user(
                "Write a SQL query that lists the five customers with the highest total order value, "
                "from tables customers(id, name) and orders(id, customer_id, total)."
            ),
            assistant(
                "SELECT c.name, SUM(o.total) AS total_value\nFROM customers c\n"
                "JOIN orders o ON o.customer_id = c.id\nGROUP BY c.id, c.name\n"
                "ORDER BY total_value DESC\nLIMIT 5;"
            ),
        ],
    },
    {
        "id": "git-rebase-two-turns",
        "metadata": {"kind": "chat", "topic": "explanation", "turns": 2},
        "messages": [
            user("When should I use git rebase instead of git merge?"),
            assistant(
                "Rebase to keep a linear history of your own local or feature-branch commits before "
                "sharing them; merge to combine branches others already use, since rebasing rewrites "
                "commits and forces everyone else to reconcile the new ones."
            ),
            user("How do I undo a rebase I just finished?"),
        ],
    },
]


def conversations() -> list[dict[str, Any]]:
    plans = [plan_conversation(make_task(SEED, i, rounds)) for i, rounds in enumerate(PLAN_ROUNDS)]
    return [*plans, *CHATS]


def render() -> str:
    """The file's text: one conversation per line."""
    return "".join(json.dumps(c) + "\n" for c in conversations())


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'up to date' if same else 'differs; run this script without --check'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}: {len(conversations())} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
