"""What a mismatching decode step does to a tool call (pure): the rest of the output goes wrong.

The GPU engine knows only that, at the step that generated token `pos` of a request, the indexer
selected other KV entries than the serialized reference. The tokens already streamed stay as they
were; what the model writes from there depends on where in the call it was, and each case is one of
the shapes the sim's fault model uses (orchestrator.sim.agent.corrupt), so the oracle already knows it:

- nothing written yet: the call comes out as plain JSON text (`leaked_text`);
- inside the tool name: the name runs on past the declared one (`unknown_tool`);
- inside the arguments: the call is closed where it stands (`truncated_arguments`);
- the arguments already complete (the closing marker is all that is left): nothing visible is left to
  go wrong (None: a masked mismatch).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from orchestrator.sim import agent


def corrupt_from(
    tokens: Sequence[str], pos: int, reply: agent.Reply, tools: Sequence[Mapping[str, Any]] | None
) -> tuple[str, list[str]] | None:
    """(shape, tokens) of the call `reply` when the step generating token `pos` mismatched; None
    when the reply is no tool call or the call was already complete at `pos`."""
    if reply.call is None:
        return None
    emitted = "".join(tokens[:pos])
    name, arguments = reply.call.name, dict(reply.call.arguments)
    if agent.CALL_END in emitted or pos >= len(tokens):
        return None
    if not emitted:
        return "leaked_text", agent.tokenize(json.dumps({"name": name, "arguments": arguments}))
    if agent.SEP not in emitted:
        text = agent.call_text(run_on_name(name, agent.tool_names(tools)), arguments)
        shape = "unknown_tool"
    else:
        text = emitted + agent.CALL_END + agent.CALLS_END
        shape = "truncated_arguments"
    if not text.startswith(emitted):  # cannot happen for the markup above; guard the splice
        raise AssertionError(f"corrupted text does not continue what was streamed: {emitted!r}")
    if text == "".join(tokens):
        return None  # hit on the closing marker: closing the call where it stands is the call itself
    return shape, list(tokens[:pos]) + agent.tokenize(text[len(emitted) :])


def run_on_name(name: str, declared: Sequence[str]) -> str:
    """A name that starts with `name` (so it continues any prefix of it) and is not declared."""
    for suffix in ("s", "2", f"_{name.split('_')[-1]}", "_x"):
        if name + suffix not in declared:
            return name + suffix
    return name + "_unknown"
