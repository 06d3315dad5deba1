"""The corruption oracle: pure, named detectors over one streamed assistant turn.

Each detector takes the turn (and, for the plan check, the call the task expects this round) and
returns a one-line reason when it fires, None when it does not. Several may fire on one turn (a
decoding loop that crowded out the call is also a missing call): the turn's kind is the one of them
that comes first in `DETECTORS`, their precedence (`kind_of`), and `check_turn` returns it as a
`Finding`. Only what the server *said* is judged here: transport failures never reach the oracle (the
client raises them), so `errored` is never `corrupted`.

Structural detectors (everything but `wrong_call`) hold for any healthy tool-calling model on this
workload, whatever it decides to do: they must never fire on a healthy server. `wrong_call` ("lost
the plot": a valid call, but not the one the plan asks for) assumes the model follows the plan; a
study enables it where the target is expected to (the simulated target, a strong model).

The workload asks for exactly one tool call per round, so a turn without one is `missing_tool_call`.

Cost (the oracle runs on every turn of a thousand concurrent sessions): `check_turn` reads each turn
once through a `_View` (the calls' arguments parsed once and shared by every detector, the texts
listed once); the text-hygiene detectors are skipped when one scan finds no suspect character; the
repetition search counts the matches of every unit length in one vectorised pass and looks closer only
at the lengths that could hold a run; the JSON schemas are compiled once into plain checks
(`_compile_schema`, for the keywords tool schemas use; any other schema goes to jsonschema's validator,
built once), and jsonschema's own error messages are computed only for a call that fails. The verdicts
and reasons are those of the straightforward detectors, each of which still works on its own.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from numbers import Number
from typing import Any

import jsonschema
import numpy as np

from orchestrator.workload.results import StreamedToolCall, StreamedTurn
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
# either of the two: a text with none of these passes both checks
_SUSPECT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x80-\x9f\ud800-\udfff\ufffd]")

# Tool-call syntax that belongs in `tool_calls`, never in plain text: JSON call objects and the
# call markers of common chat templates (Hermes/Qwen, Llama, Mistral, DeepSeek V3/V3.1/V3.2/V4).
_LEAKED_CALL = re.compile(
    r"<tool_call>|</tool_call>|<\|tool_call\|>|<\|python_tag\|>|\[TOOL_CALLS\]"
    r"|<｜tool▁calls?▁begin｜>|<｜tool▁call▁begin｜>|<｜tool▁sep｜>|<｜DSML｜"
    r"|\{\s*\"(?:name|function)\"\s*:\s*\"[A-Za-z_][\w.-]*\"\s*,\s*\"(?:arguments|parameters)\"\s*:",
)

# Degenerate repetition (a decoding loop), either of two shapes; in both the unit is at most MAX_UNIT
# characters and holds a letter or digit (so rules like "-----" or indentation are not repetition).
# - A run, in any text: the unit back to back at least MIN_REPEATS times and MIN_SPAN characters in all.
# - A loop in place of the call: in a turn without a tool call, a content or reasoning that ends in the
#   unit repeated back to back at least LOOP_MIN_REPEATS times, over at least LOOP_MIN_SHARE of it. A
#   small max_tokens cuts a loop before it is a run ('search( top_k top_k top_k top_'); the turn is
#   corrupted either way (no call), so this only decides its kind, never whether it is clean. A loop
#   runs until max_tokens stops it, hence "ends in"; most of the text, so that a sentence ending on a
#   repeated word is not one; three copies, since a word twice is ordinary text.
MIN_REPEATS = 10
MIN_SPAN = 80
MAX_UNIT = 200
LOOP_MIN_REPEATS = 3
LOOP_MIN_SHARE = 0.5
_ALNUM = re.compile(r"[^\W_]")


def _texts(turn: StreamedTurn) -> Iterator[tuple[str, str]]:
    """(where, text) for every piece of text the turn carries."""
    yield from _View(turn).texts()


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


class _View:
    """A turn as the detectors read it, each part computed once and only when a detector gets to it
    (as the detectors on their own do): the calls' parsed arguments, shared by every detector that
    looks at them, and the turn's texts."""

    __slots__ = ("_parsed", "_texts", "turn")

    def __init__(self, turn: StreamedTurn):
        self.turn = turn
        self._parsed: list[Any] = []  # the parsed arguments of the first len(_parsed) calls
        self._texts: list[tuple[str, str]] | None = None

    def parsed(self, i: int) -> Any:
        """Call i's arguments as JSON, or the ValueError that parsing them raised."""
        parsed = self._parsed
        while len(parsed) <= i:
            parsed.append(_parse_arguments(self.turn.tool_calls[len(parsed)]))
        return parsed[i]

    def calls(self) -> Iterator[tuple[StreamedToolCall, Any]]:
        """(call, its parsed arguments), in order, each parsed when the caller gets to it."""
        for i, call in enumerate(self.turn.tool_calls):
            yield call, self.parsed(i)

    def texts(self) -> Iterator[tuple[str, str]]:
        """(where, text) for every piece of text the turn carries."""
        if self._texts is not None:
            yield from self._texts
            return
        texts: list[tuple[str, str]] = []
        turn = self.turn
        for item in self._produce(turn):
            texts.append(item)
            yield item
        self._texts = texts

    def all_texts(self) -> list[tuple[str, str]]:
        """texts(), all of them, as a list."""
        if self._texts is None:
            self._texts = list(self._produce(self.turn))
        return self._texts

    def _produce(self, turn: StreamedTurn) -> Iterator[tuple[str, str]]:
        yield "content", turn.content
        yield "reasoning", turn.reasoning
        for i, call in enumerate(turn.tool_calls):
            yield f"tool call {call.index} name", call.name
            yield f"tool call {call.index} arguments", call.arguments
            parsed = self.parsed(i)
            if isinstance(parsed, dict):
                for value in _string_values(parsed):
                    yield f"tool call {call.index} argument value", value


def _show(text: str, at: int, width: int = 40) -> str:
    return repr(text[max(0, at - width) : at + width])


# --- detectors ------------------------------------------------------------------------------
# Each public detector takes a turn; its `_view_*` twin reads a _View, which check_turn shares.


def truncated_stream(turn: StreamedTurn) -> str | None:
    """The stream closed normally but no choice ever carried a finish_reason."""
    if turn.finish_reason is None:
        return "stream ended without a finish_reason"
    return None


def _view_truncated_stream(view: _View) -> str | None:
    return truncated_stream(view.turn)


def invalid_utf8(turn: StreamedTurn) -> str | None:
    """Bytes that are not UTF-8, lone surrogates, or U+FFFD replacement characters."""
    return _view_invalid_utf8(_View(turn))


def _view_invalid_utf8(view: _View) -> str | None:
    for where, text in view.texts():
        found = _BAD_UNICODE.search(text)
        if found:
            return f"invalid UTF-8 in {where} (U+{ord(found.group()):04X}) near {_show(text, found.start())}"
    return None


def control_chars(turn: StreamedTurn) -> str | None:
    """Control characters other than tab, newline and carriage return."""
    return _view_control_chars(_View(turn))


def _view_control_chars(view: _View) -> str | None:
    for where, text in view.texts():
        found = _CONTROL.search(text)
        if found:
            return (
                f"control character U+{ord(found.group()):04X} in {where} near {_show(text, found.start())}"
            )
    return None


def degenerate_repetition(turn: StreamedTurn) -> str | None:
    """A decoding loop: a short unit repeated back to back, a run in any text or, in a turn without a
    call, the loop its content or reasoning ends in."""
    return _view_degenerate_repetition(_View(turn))


def _view_degenerate_repetition(view: _View) -> str | None:
    for where, text in view.texts():
        found = periodic_run(text)
        if found is not None:
            start, period, span = found
            return f"{where}: {text[start : start + period][:40]!r} repeated {span // period} times"
    turn = view.turn
    if turn.tool_calls:
        return None
    for where, text in (("content", turn.content), ("reasoning", turn.reasoning)):
        found = looping_tail(text)
        if found is not None:
            start, period, span = found
            unit = text[start : start + period][:40]
            return f"{where}: {unit!r} repeated {span // period} times to its end, no tool call"
    return None


def looping_tail(text: str) -> tuple[int, int, int] | None:
    """(start, unit length, span) of the loop `text` ends in: the shortest unit of at most MAX_UNIT
    characters, holding a letter or digit, back to back at least LOOP_MIN_REPEATS times up to the end
    and over at least LOOP_MIN_SHARE of the text (the span is the whole periodic tail); None if none.

    The last m characters repeat a unit of p exactly when they equal themselves shifted by p; a unit
    length p is only compared where the last character recurs p before it."""
    n = len(text)
    share = math.ceil(n * LOOP_MIN_SHARE)
    for p in range(1, min(MAX_UNIT, n // LOOP_MIN_REPEATS) + 1):
        if text[n - 1 - p] != text[n - 1]:
            continue
        start = n - max(p * LOOP_MIN_REPEATS, share)
        if text[start : n - p] == text[start + p :] and _ALNUM.search(text[n - p :]):
            while start >= p and text[start - p : start] == text[start : start + p]:
                start -= p  # the whole tail, for the reason: a unit at a time, then a character
            while start > 0 and text[start - 1] == text[start - 1 + p]:
                start -= 1
            return start, p, n - start
    return None


def periodic_run(text: str) -> tuple[int, int, int] | None:
    """(start, unit length, span) of the first run of >= MIN_REPEATS back-to-back copies of a unit of
    at most MAX_UNIT characters holding a letter or digit, spanning >= MIN_SPAN; None if there is none.

    For each unit length p, text[i] == text[i + p] over p * (MIN_REPEATS - 1) consecutive positions is
    exactly such a run (numpy compares the text with itself shifted by p). Such a stretch is at least
    _NEED_MIN positions long, so it holds an aligned block of _BLOCK positions that all match: one
    vectorised pass over every p at once (`_candidate_periods`) finds the unit lengths with such a block,
    and only those are looked at closer. O(n * p_max) in vectorised steps whatever the text; for most
    texts, a handful of steps.
    """
    n = len(text)
    if n < MIN_SPAN:
        return None
    top = min(MAX_UNIT, n // MIN_REPEATS)
    candidates = _candidate_periods(text, top)
    if not candidates:
        return None
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    for p in candidates:
        need = max(p * (MIN_REPEATS - 1), MIN_SPAN - p)  # matching positions; the span is need + p
        same = codes[p:] == codes[:-p]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], same.view(np.int8), [0]))))
        starts, ends = edges[::2], edges[1::2]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            if end - start >= need and _ALNUM.search(text[start : start + p]):
                return start, p, end - start + p
    return None


# the fewest matching positions any run needs (over p = 1..MAX_UNIT), and a block size such that any
# stretch of that many consecutive positions holds a whole aligned block: 2 * _BLOCK - 1 <= _NEED_MIN
_NEED_MIN = min(max(p * (MIN_REPEATS - 1), MIN_SPAN - p) for p in range(1, MAX_UNIT + 1))
_BLOCK = (_NEED_MIN + 1) // 2
_PAD = b"\xff" * 4 * MAX_UNIT  # 0xFFFFFFFF is no code point: past the end, no shifted position matches
_ROWS = _BLOCK * 256  # positions per vectorised step (bounds the memory of a long text's pass)
_STRING_COMPARISONS = 64  # up to this many block comparisons, plain string slices beat numpy's overhead


def _candidate_periods(text: str, top: int) -> list[int]:
    """The unit lengths p in 1..top for which some aligned block of _BLOCK positions i all have
    text[i] == text[i + p]: the only ones whose shifted comparison can hold a stretch of _NEED_MIN
    matching positions. Short texts compare the blocks as strings; longer ones in one numpy pass."""
    n = len(text)
    usable = n // _BLOCK * _BLOCK  # an aligned block inside a stretch lies within [0, n)
    if usable // _BLOCK * top <= _STRING_COMPARISONS:
        # a block equal to itself shifted by p lies in a p-periodic stretch: it has at most p distinct
        # characters, so a block with more rules p out (ordinary text: no p is left to compare)
        blocks = [(b, len(set(text[b : b + _BLOCK]))) for b in range(0, usable, _BLOCK)]
        found = []
        for p in range(min(d for _, d in blocks), top + 1):
            for b, distinct in blocks:
                if distinct <= p and text[b : b + _BLOCK] == text[b + p : b + p + _BLOCK]:
                    found.append(p)
                    break
        return found
    padded = text.encode("utf-32-le", "surrogatepass") + _PAD[: 4 * top]
    found = np.zeros(top, dtype=bool)
    for first in range(0, usable, _ROWS):
        rows = min(_ROWS, usable - first)
        # row i is the text from position first + i on: its column p is text[first + i + p]
        windows = np.ndarray(
            (rows, top + 1), dtype=np.uint32, buffer=padded, offset=4 * first, strides=(4, 4)
        )
        same = windows[:, 1:] == windows[:, :1]
        found |= same.reshape(rows // _BLOCK, _BLOCK, top).all(axis=1).any(axis=0)
    return (np.flatnonzero(found) + 1).tolist()


def leaked_tool_call(turn: StreamedTurn) -> str | None:
    """Tool-call syntax in the plain text instead of in tool_calls."""
    # content only: reasoning may legitimately talk about the call it is about to make
    found = _LEAKED_CALL.search(turn.content)
    if found:
        return f"tool-call syntax in content: {_show(turn.content, found.start())}"
    return None


def _view_leaked_tool_call(view: _View) -> str | None:
    return leaked_tool_call(view.turn)


def malformed_json(turn: StreamedTurn) -> str | None:
    """Tool-call arguments that are not a JSON object."""
    return _view_malformed_json(_View(turn))


def _view_malformed_json(view: _View) -> str | None:
    for call, parsed in view.calls():
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


def _view_unknown_tool(view: _View) -> str | None:
    return unknown_tool(view.turn)


def schema_invalid(turn: StreamedTurn, tool_schemas: Mapping[str, Any] = TOOL_SCHEMAS) -> str | None:
    """Arguments that break the tool's JSON schema (missing, extra or mistyped fields)."""
    return _view_schema_invalid(_View(turn), tool_schemas)


def _view_schema_invalid(view: _View, tool_schemas: Mapping[str, Any] = TOOL_SCHEMAS) -> str | None:
    for call, parsed in view.calls():
        schema = tool_schemas.get(call.name)
        if schema is None or not isinstance(parsed, dict):
            continue  # other detectors own these cases
        if _schema_check(schema)(parsed):
            continue  # valid: jsonschema would find no error (tests/workload/test_detect_fast.py)
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


# --- compiled schema checks -------------------------------------------------------------------------

Check = Callable[[Any], bool]
_CHECKS: dict[int, tuple[Any, Check]] = {}  # id(schema) -> (the schema, kept alive; its check)
_MAX_CHECKS = 256


def _schema_check(schema: Any) -> Check:
    """A function telling whether an instance is valid against `schema`, built once per schema object
    (a schema is not expected to change once offered): `_compile_schema`'s where it covers every
    keyword, else the is_valid of jsonschema's validator for it (Draft 2020-12 unless it says)."""
    cached = _CHECKS.get(id(schema))
    if cached is not None and cached[0] is schema:
        return cached[1]
    check = _compile_schema(schema)
    if check is None:
        check = _validator(json.dumps(schema, sort_keys=True)).is_valid
    if len(_CHECKS) >= _MAX_CHECKS:
        _CHECKS.clear()
    _CHECKS[id(schema)] = (schema, check)
    return check


# jsonschema's Draft 2020-12 type checker, keyword for keyword (jsonschema/_types.py)
def _is_integer(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and x.is_integer())


def _is_number(x: Any) -> bool:
    return isinstance(x, Number) and not isinstance(x, bool)


_TYPES: dict[str, Check] = {
    "array": lambda x: isinstance(x, list),
    "boolean": lambda x: isinstance(x, bool),
    "integer": _is_integer,
    "null": lambda x: x is None,
    "number": _is_number,
    "object": lambda x: isinstance(x, dict),
    "string": lambda x: isinstance(x, str),
}
# keywords that do not assert anything under Draft 2020-12 without a format checker
_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "format",
    }
)


def _compile_schema(schema: Any) -> Check | None:
    """`schema` as a plain Python check with jsonschema's Draft 2020-12 semantics, for the keywords
    tool schemas use (type, properties, required, additionalProperties, min/maxLength, minimum,
    maximum, exclusiveMinimum/Maximum, pattern, and annotations); None for a schema with any other
    keyword, which jsonschema then checks itself."""
    if schema is True or schema is False:
        return (lambda x: True) if schema else (lambda x: False)
    if not isinstance(schema, dict):
        return None
    checks: list[Check] = []
    properties: dict[str, Check] = {}
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        check = _compile_keyword(key, value, schema, properties)
        if check is None:
            return None
        checks.append(check)
    if len(checks) == 1:
        return checks[0]

    def all_of(x: Any) -> bool:
        for check in checks:  # noqa: SIM110 - a plain loop: no generator per call
            if not check(x):
                return False
        return True

    return all_of


def _compile_keyword(key: str, value: Any, schema: dict, properties: dict[str, Check]) -> Check | None:
    """One keyword of `schema` as a check (None: not covered)."""
    if key == "type":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or any(n not in _TYPES for n in names):
            return None
        tests = [_TYPES[n] for n in names]
        return tests[0] if len(tests) == 1 else (lambda x: any(t(x) for t in tests))
    if key == "properties":
        if not isinstance(value, dict):
            return None
        for name, sub in value.items():
            compiled = _compile_schema(sub)
            if compiled is None:
                return None
            properties[name] = compiled
        subs = dict(properties)

        def check_properties(x: Any) -> bool:
            if isinstance(x, dict):
                for name, sub in subs.items():
                    if name in x and not sub(x[name]):
                        return False
            return True

        return check_properties
    if key == "required":
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            return None
        names = list(value)
        return lambda x: not isinstance(x, dict) or all(n in x for n in names)
    if key == "additionalProperties":
        if "patternProperties" in schema:
            return None
        declared = schema.get("properties", {})
        if not isinstance(declared, dict):
            return None
        known = frozenset(declared)
        if value is True:
            return lambda x: True
        if value is False:
            return lambda x: not isinstance(x, dict) or all(k in known for k in x)
        extra = _compile_schema(value)
        if extra is None:
            return None
        return lambda x: not isinstance(x, dict) or all(extra(v) for k, v in x.items() if k not in known)
    if key in ("minLength", "maxLength"):
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        if key == "minLength":
            return lambda x: not isinstance(x, str) or len(x) >= value
        return lambda x: not isinstance(x, str) or len(x) <= value
    if key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if key == "minimum":
            return lambda x: not _is_number(x) or not x < value
        if key == "maximum":
            return lambda x: not _is_number(x) or not x > value
        if key == "exclusiveMinimum":
            return lambda x: not _is_number(x) or not x <= value
        return lambda x: not _is_number(x) or not x >= value
    if key == "pattern":
        if not isinstance(value, str):
            return None
        try:
            regex = re.compile(value)
        except re.error:
            return None
        return lambda x: not isinstance(x, str) or regex.search(x) is not None
    return None


def missing_tool_call(turn: StreamedTurn) -> str | None:
    """A round of the workload without a tool call (every round asks for exactly one)."""
    if not turn.tool_calls:
        return f"no tool call (finish_reason={turn.finish_reason}, content {turn.content[:80]!r})"
    return None


def _view_missing_tool_call(view: _View) -> str | None:
    return missing_tool_call(view.turn)


def wrong_call(turn: StreamedTurn, expected: ToolCall | None) -> str | None:
    """A well-formed call that is not the one the plan expects this round (lost the plot)."""
    return _view_wrong_call(_View(turn), expected)


def _view_wrong_call(view: _View, expected: ToolCall | None) -> str | None:
    if expected is None:
        return None
    turn = view.turn
    if len(turn.tool_calls) != 1:
        return f"{len(turn.tool_calls)} tool calls, the plan expects exactly one ({expected.name})"
    call = turn.tool_calls[0]
    if call.name != expected.name:
        return f"called {call.name}, the plan expects {expected.name}"
    arguments = view.parsed(0)
    if not isinstance(arguments, dict):
        return f"{call.name} with arguments that are not a JSON object: {call.arguments[:150]!r}"
    if arguments != dict(expected.arguments):
        return (
            f"{call.name} with {json.dumps(arguments, sort_keys=True)[:150]}, the plan expects "
            f"{json.dumps(dict(expected.arguments), sort_keys=True)[:150]}"
        )
    return None


# --- the oracle -----------------------------------------------------------------------------

#: The structural detectors, in precedence (the order of DETECTORS, which ends with wrong_call): a turn
#: on which several fire is of the first kind (`kind_of`). A kind comes before the kinds it explains, the
#: most basic fault first: a stream cut short leaves anything after the cut broken; bytes that are not
#: text break names and JSON; a decoding loop crowds out the call, keeps its arguments from closing, or
#: loops on call syntax; call syntax leaked as text leaves no call; then a call that is there but broken
#: (not JSON, so neither tool nor schema can be judged; an unknown tool, so no schema to judge by; its
#: schema broken); a missing call is the bare symptom, named only when nothing above explains it; a
#: valid call that is not the plan's (checked only where a study asks) comes last.
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

#: each structural detector's twin on a shared _View (check_turn's path; same verdicts and reasons)
_ON_VIEW: dict[Callable[[StreamedTurn], str | None], Callable[[_View], str | None]] = {
    truncated_stream: _view_truncated_stream,
    invalid_utf8: _view_invalid_utf8,
    control_chars: _view_control_chars,
    degenerate_repetition: _view_degenerate_repetition,
    leaked_tool_call: _view_leaked_tool_call,
    malformed_json: _view_malformed_json,
    unknown_tool: _view_unknown_tool,
    schema_invalid: _view_schema_invalid,
    missing_tool_call: _view_missing_tool_call,
}

#: The families of detectors. `structural`: what no healthy server emits, whatever its model decides
#: (the corruption a heisenbug brings). `plan_drift`: a well-formed call that is not the plan's next
#: one; against a weak model that is model quality, present in every arm, so a study may count it
#: apart. The original hunt counted both ("loses the plot": nonsensical or incomplete tool calls).
#: The other oracles' families, each its own detector: `diverged_early` and `diverged`, a turn under load
#: whose output differs from the same start's batch-1 reference within its first `early_tokens` tokens or
#: later (workload/divergence.py); `wrong_answer`, a conversation's last turn without its expected
#: answer (workload/prompts.py); `reproducer`, what the user's own reproducer called corrupted.
FAMILIES: dict[str, tuple[str, ...]] = {
    "structural": tuple(name for name, _ in STRUCTURAL),
    "plan_drift": ("wrong_call",),
    "diverged_early": ("diverged_early",),
    "diverged": ("diverged",),
    "wrong_answer": ("wrong_answer",),
    "reproducer": ("reproducer",),
}
#: what each oracle judges a session by (`workload.oracle`), its families in the order it counts them
ORACLES: dict[str, tuple[str, ...]] = {
    "tool_calls": ("structural", "plan_drift"),
    "divergence": ("diverged_early", "diverged"),
    "reproducer": ("reproducer",),
}
#: the tool-call oracle's families: what the original hunt counted
DEFAULT_COUNTED: tuple[str, ...] = ORACLES["tool_calls"]


def oracle_families(oracle: str, answers: bool = False) -> tuple[str, ...]:
    """The families an oracle judges; `answers`: the prompts carry expected answers (wrong_answer)."""
    families = ORACLES[oracle]
    return (*families, "wrong_answer") if answers and oracle != "reproducer" else families


def counted_families(oracle: str, count: object, answers: bool = False) -> tuple[str, ...]:
    """The families that end a session as corrupted: `count` where given, else all the oracle's."""
    return tuple(count) if count else oracle_families(oracle, answers)  # type: ignore[call-overload]


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


def kind_of(fired: Iterable[str]) -> str | None:
    """The kind of a turn on which the detectors named in `fired` fire: the first of them in DETECTORS,
    whatever order they were tried in (None: none fired). check_turn tries them in that order and
    stops at the first that fires, which is the same."""
    ranks = [DETECTORS.index(name) for name in fired]
    return DETECTORS[min(ranks)] if ranks else None


def check_turn(
    turn: StreamedTurn,
    expected: ToolCall | None = None,
    check_plan: bool = False,
    tool_schemas: Mapping[str, Any] = TOOL_SCHEMAS,
    expect_call: bool = True,
) -> Finding | None:
    """The finding of the turn's kind (`kind_of` the detectors that fire on it), or None for a healthy
    turn: the detectors are tried in precedence, so the first that fires is that kind.

    `expected` is the call the task expects this round (Task.expected(round)); it is only used when
    `check_plan` is true. `tool_schemas`: the tools offered, name -> parameters schema (the built-in
    tasks' by default; a prompts file's conversation offers its own). `expect_call`: whether the turn
    must call a tool (every round of a built-in task does; a replayed conversation's turn does where its
    recorded answer did).
    """
    view = _View(turn)
    try:  # every text at once (the arguments parsed once): the usual path
        texts = view.all_texts()
    except Exception:  # e.g. arguments nested too deep to walk: each detector in order, as on its own
        texts = None
    skip: set[Callable[[StreamedTurn], str | None]] = set()  # detectors that cannot fire on these texts
    if texts is not None:
        if not _SUSPECT.search("\n".join(text for _, text in texts)):
            skip.update((invalid_utf8, control_chars))  # no character either hygiene check looks for
        if turn.tool_calls and all(len(text) < MIN_SPAN for _, text in texts):
            skip.add(degenerate_repetition)  # too short to hold a run, and a call: no loop in its place
    if not expect_call:
        skip.add(missing_tool_call)
    for name, detector in STRUCTURAL:
        if detector in skip:
            continue
        if tool_schemas is not TOOL_SCHEMAS and detector in (unknown_tool, schema_invalid):
            reason = unknown_tool(turn, tool_schemas) if detector is unknown_tool else None
            reason = reason or (
                _view_schema_invalid(view, tool_schemas) if detector is schema_invalid else None
            )
        else:
            reason = _ON_VIEW[detector](view) if detector in _ON_VIEW else detector(turn)
        if reason is not None:
            return Finding(name, reason)
    if check_plan:
        reason = _view_wrong_call(view, expected)
        if reason is not None:
            return Finding("wrong_call", reason)
    return None
