"""The corruption oracle: pure, named detectors over one streamed assistant turn.

Each detector takes the turn (and, for the plan check, the call the task expects this round) and
returns a one-line reason when it fires, None when it does not. `check_turn` runs them in a fixed
order and returns the first that fires as a `Finding`. Only what the server *said* is judged here:
transport failures never reach the oracle (the client raises them), so `errored` is never
`corrupted`.

Structural detectors (everything but `wrong_call`) hold for any healthy tool-calling model on this
workload, whatever it decides to do: they must never fire on a healthy server. `wrong_call` ("lost
the plot": a valid call, but not the one the plan asks for) assumes the model follows the plan; a
study enables it where the target is expected to (the simulated target, a strong model).

The workload asks for exactly one tool call per round, so a turn without one is `missing_tool_call`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import jsonschema
import numpy as np

from orchestrator.results import StreamedToolCall, StreamedTurn
from orchestrator.workload.tasks import TOOL_SCHEMAS, ToolCall


@dataclass(frozen=True)
class Finding:
    detector: str
    reason: str

    @property
    def family(self) -> str:
        return family_of(self.detector)


# --- text hygiene -----------------------------------------------------------------------------

# C0 controls except tab, newline, carriage return; DEL; C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x80-\x9f]")
# Lone surrogates (from invalid UTF-8 kept by surrogateescape, or from bad \u escapes) and U+FFFD,
# the replacement character a detokenizer emits for bytes that do not form UTF-8.
_BAD_UNICODE = re.compile("[\ud800-\udfff\ufffd]")

# Tool-call syntax that belongs in `tool_calls`, never in plain text: JSON call objects and the
# call markers of common chat templates (Hermes/Qwen, Llama, Mistral, DeepSeek V3/V3.1/V3.2/V4).
_LEAKED_CALL = re.compile(
    r"<tool_call>|</tool_call>|<\|tool_call\|>|<\|python_tag\|>|\[TOOL_CALLS\]"
    r"|<｜tool▁calls?▁begin｜>|<｜tool▁call▁begin｜>|<｜tool▁sep｜>|<｜DSML｜"
    r"|\{\s*\"(?:name|function)\"\s*:\s*\"[A-Za-z_][\w.-]*\"\s*,\s*\"(?:arguments|parameters)\"\s*:",
)

# Degenerate repetition: a unit of up to 200 characters repeated back to back, at least
# MIN_REPEATS times and MIN_SPAN characters in all, whose unit holds a letter or digit (so rules
# like "-----" or indentation are not repetition).
MIN_REPEATS = 10
MIN_SPAN = 80
MAX_UNIT = 200
_ALNUM = re.compile(r"[^\W_]")


def _texts(turn: StreamedTurn) -> Iterator[tuple[str, str]]:
    """(where, text) for every piece of text the turn carries."""
    yield "content", turn.content
    yield "reasoning", turn.reasoning
    for call in turn.tool_calls:
        yield f"tool call {call.index} name", call.name
        yield f"tool call {call.index} arguments", call.arguments
        parsed = _parse_arguments(call)
        if isinstance(parsed, dict):
            for value in _string_values(parsed):
                yield f"tool call {call.index} argument value", value


def _string_values(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _string_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from _string_values(item)


def _parse_arguments(call: StreamedToolCall) -> Any:
    """The arguments as JSON, or the ValueError that parsing them raised."""
    try:
        return json.loads(call.arguments)
    except ValueError as e:
        return e


def _show(text: str, at: int, width: int = 40) -> str:
    return repr(text[max(0, at - width) : at + width])


# --- detectors ------------------------------------------------------------------------------


def truncated_stream(turn: StreamedTurn) -> str | None:
    """The stream closed normally but no choice ever carried a finish_reason."""
    if turn.finish_reason is None:
        return "stream ended without a finish_reason"
    return None


def invalid_utf8(turn: StreamedTurn) -> str | None:
    """Bytes that are not UTF-8, lone surrogates, or U+FFFD replacement characters."""
    for where, text in _texts(turn):
        found = _BAD_UNICODE.search(text)
        if found:
            return f"invalid UTF-8 in {where} (U+{ord(found.group()):04X}) near {_show(text, found.start())}"
    return None


def control_chars(turn: StreamedTurn) -> str | None:
    """Control characters other than tab, newline and carriage return."""
    for where, text in _texts(turn):
        found = _CONTROL.search(text)
        if found:
            return (
                f"control character U+{ord(found.group()):04X} in {where} near {_show(text, found.start())}"
            )
    return None


def degenerate_repetition(turn: StreamedTurn) -> str | None:
    """A short unit repeated back to back many times (a decoding loop)."""
    for where, text in _texts(turn):
        found = periodic_run(text)
        if found is not None:
            start, period, span = found
            return f"{where}: {text[start : start + period][:40]!r} repeated {span // period} times"
    return None


def periodic_run(text: str) -> tuple[int, int, int] | None:
    """(start, unit length, span) of the first run of >= MIN_REPEATS back-to-back copies of a unit of
    at most MAX_UNIT characters holding a letter or digit, spanning >= MIN_SPAN; None if there is none.

    For each unit length p, text[i] == text[i + p] over p * (MIN_REPEATS - 1) consecutive positions is
    exactly such a run; numpy compares the text with itself shifted by p, so the cost is O(n * p_max)
    in vectorised steps, whatever the text.
    """
    n = len(text)
    if n < MIN_SPAN:
        return None
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    for p in range(1, min(MAX_UNIT, n // MIN_REPEATS) + 1):
        need = max(p * (MIN_REPEATS - 1), MIN_SPAN - p)  # matching positions; the span is need + p
        same = codes[p:] == codes[:-p]
        if int(same.sum()) < need:
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.view(np.int8), [0]))))
        starts, ends = edges[::2], edges[1::2]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            if end - start >= need and _ALNUM.search(text[start : start + p]):
                return start, p, end - start + p
    return None


def leaked_tool_call(turn: StreamedTurn) -> str | None:
    """Tool-call syntax in the plain text instead of in tool_calls."""
    # content only: reasoning may legitimately talk about the call it is about to make
    found = _LEAKED_CALL.search(turn.content)
    if found:
        return f"tool-call syntax in content: {_show(turn.content, found.start())}"
    return None


def malformed_json(turn: StreamedTurn) -> str | None:
    """Tool-call arguments that are not a JSON object."""
    for call in turn.tool_calls:
        parsed = _parse_arguments(call)
        if isinstance(parsed, ValueError):
            where = f"tool call {call.index} ({call.name})"
            return f"{where}: arguments are not JSON ({parsed}): {call.arguments[:200]!r}"
        if not isinstance(parsed, dict):
            return (
                f"tool call {call.index} ({call.name}): arguments are {type(parsed).__name__}, not an object"
            )
    return None


def unknown_tool(turn: StreamedTurn, tool_schemas: Mapping[str, Any] = TOOL_SCHEMAS) -> str | None:
    """A call to a tool that was not offered."""
    for call in turn.tool_calls:
        if call.name not in tool_schemas:
            return f"tool call {call.index}: unknown tool {call.name[:100]!r}"
    return None


def schema_invalid(turn: StreamedTurn, tool_schemas: Mapping[str, Any] = TOOL_SCHEMAS) -> str | None:
    """Arguments that break the tool's JSON schema (missing, extra or mistyped fields)."""
    for call in turn.tool_calls:
        schema = tool_schemas.get(call.name)
        parsed = _parse_arguments(call)
        if schema is None or not isinstance(parsed, dict):
            continue  # other detectors own these cases
        error = jsonschema.exceptions.best_match(
            _validator(json.dumps(schema, sort_keys=True)).iter_errors(parsed)
        )
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(root)"
            return f"tool call {call.index} ({call.name}): {path}: {error.message[:200]}"
    return None


@cache
def _validator(schema_json: str) -> jsonschema.protocols.Validator:
    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def missing_tool_call(turn: StreamedTurn) -> str | None:
    """A round of the workload without a tool call (every round asks for exactly one)."""
    if not turn.tool_calls:
        return f"no tool call (finish_reason={turn.finish_reason}, content {turn.content[:80]!r})"
    return None


def wrong_call(turn: StreamedTurn, expected: ToolCall | None) -> str | None:
    """A well-formed call that is not the one the plan expects this round (lost the plot)."""
    if expected is None:
        return None
    if len(turn.tool_calls) != 1:
        return f"{len(turn.tool_calls)} tool calls, the plan expects exactly one ({expected.name})"
    call = turn.tool_calls[0]
    if call.name != expected.name:
        return f"called {call.name}, the plan expects {expected.name}"
    arguments = _parse_arguments(call)
    if not isinstance(arguments, dict):
        return f"{call.name} with arguments that are not a JSON object: {call.arguments[:150]!r}"
    if arguments != dict(expected.arguments):
        return (
            f"{call.name} with {json.dumps(arguments, sort_keys=True)[:150]}, the plan expects "
            f"{json.dumps(dict(expected.arguments), sort_keys=True)[:150]}"
        )
    return None


# --- the oracle -----------------------------------------------------------------------------

#: Structural detectors in the order they are tried: the first that fires names the turn's fault.
STRUCTURAL: tuple[tuple[str, Callable[[StreamedTurn], str | None]], ...] = (
    ("truncated_stream", truncated_stream),
    ("invalid_utf8", invalid_utf8),
    ("control_chars", control_chars),
    ("degenerate_repetition", degenerate_repetition),
    ("leaked_tool_call", leaked_tool_call),
    ("malformed_json", malformed_json),
    ("unknown_tool", unknown_tool),
    ("schema_invalid", schema_invalid),
    ("missing_tool_call", missing_tool_call),
)
DETECTORS: tuple[str, ...] = (*(name for name, _ in STRUCTURAL), "wrong_call")

#: The families of detectors. `structural`: what no healthy server emits, whatever its model decides
#: (the corruption a heisenbug brings). `plan_drift`: a well-formed call that is not the plan's next
#: one; against a weak model that is model quality, present in every arm, so a study may count it
#: apart. The original hunt counted both ("loses the plot": nonsensical or incomplete tool calls).
FAMILIES: dict[str, tuple[str, ...]] = {
    "structural": tuple(name for name, _ in STRUCTURAL),
    "plan_drift": ("wrong_call",),
}
DEFAULT_COUNTED: tuple[str, ...] = tuple(FAMILIES)


def family_of(detector: str) -> str:
    """The family a detector belongs to (ValueError for a name that is not a detector)."""
    for family, names in FAMILIES.items():
        if detector in names:
            return family
    raise ValueError(f"unknown detector {detector!r}: one of {list(DETECTORS)}")


def family_problems(where: str, families: object) -> list[str]:
    """Why `families` is not a valid, non-empty list of detector families (empty list: it is)."""
    if isinstance(families, str) or not isinstance(families, (list, tuple)) or not families:
        return [f"{where}: {families!r} must be a non-empty list of families from {list(FAMILIES)}"]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        return [f"{where}: {unknown} not a detector family; accepted: {list(FAMILIES)}"]
    return []


def check_turn(
    turn: StreamedTurn, expected: ToolCall | None = None, check_plan: bool = False
) -> Finding | None:
    """The first detector that fires on `turn`, or None for a healthy turn.

    `expected` is the call the task expects this round (Task.expected(round)); it is only used when
    `check_plan` is true.
    """
    for name, detector in STRUCTURAL:
        reason = detector(turn)
        if reason is not None:
            return Finding(name, reason)
    if check_plan:
        reason = wrong_call(turn, expected)
        if reason is not None:
            return Finding("wrong_call", reason)
    return None
