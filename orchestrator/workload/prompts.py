"""Your own prompts (`workload.prompts=FILE.jsonl`): conversations in the OpenAI chat format, replayed
in place of the built-in tool-calling tasks by either oracle (tool calls, or divergence).

The file holds one conversation per line, a JSON object (blank lines are skipped):

    {"id": "capital", "messages": [{"role": "user", "content": "..."}], "expected": "Canberra"}

- `messages` (required): the chat, as OpenAI's Chat Completions API takes it. Roles system, developer,
  user, assistant, tool; `content` a string or a list of text parts; an assistant message may carry
  `tool_calls` (their `arguments` a string holding a JSON object) and a tool message names the call it
  answers by `tool_call_id`. After any system or developer messages the chat starts with a user message.
- `tools` (optional): the functions the conversation may call (OpenAI function tools); required where an
  assistant message calls one, and every call names one of them and fits its `parameters`.
- `expected` (optional): the answer of the conversation's last turn; a last turn whose answer does not
  contain it (whitespace collapsed, case kept) is `wrong_answer`.
- `id` (optional, unique in the file, default `line<n>`; it names the session's files, hence the short
  alphabet) and `metadata` (optional, any object, for you: never sent).

Replay rule: a conversation is replayed turn by turn AS RECORDED. There is one turn per assistant message
in the file, and each sends the messages before that assistant message, the file's own earlier assistant
and tool messages included; a conversation that ends on a user or tool message has one more, final turn,
sending all of it. Nothing the server generates is fed back, so every pass (under load, or the
divergence oracle's batch-1 reference) sends the same inputs, and one diverging turn cannot cascade into
the next. A recorded assistant message stands for what its turn should say: its first tool call is the
call the tool-call oracle expects that turn. Only the last turn is judged against `expected`.

Every line is checked before any start (`prompts_problems` lists what is wrong, `load_prompts` refuses
the first), each problem naming the file, the line, the field (`messages[2].tool_calls[0].function.
arguments`) and what is accepted. Pure apart from reading the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from orchestrator.workload.detect import Finding
from orchestrator.workload.tasks import ToolCall


class PromptsError(ValueError):
    """A prompts file that cannot be replayed: "<path> line <n>: <field>: <what>; accepted: ..."."""


@dataclass(frozen=True)
class Conversation:
    id: str  # the line's "id", else f"line{n}"
    messages: tuple[dict, ...]  # the file's messages, as given
    tools: tuple[dict, ...] | None
    expected: str | None  # the expected answer of the conversation's last turn
    line: int


@dataclass(frozen=True)
class ReplayTurn:
    # what is sent for this turn: the file's messages before this turn's assistant message (the dicts are
    # the Conversation's own: read them, never change them)
    messages: list[dict]
    recorded: dict | None  # the file's assistant message this turn stands for (None: the final turn)
    expected_call: ToolCall | None  # the recorded message's first tool call, its arguments parsed
    last: bool  # the conversation's last turn (its answer is judged against `expected`)


LINE_KEYS = ("id", "messages", "tools", "expected", "metadata")
ROLES = ("system", "developer", "user", "assistant", "tool")
_SYSTEM_ROLES = ("system", "developer")
# the keys each role's message may carry (reasoning_content: SGLang's and DeepSeek's recorded reasoning)
_MESSAGE_KEYS = {
    "system": ("role", "content", "name"),
    "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "tool_calls", "reasoning_content"),
    "tool": ("role", "content", "tool_call_id"),
}
_TOOL_KEYS = ("type", "function")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
_CALL_KEYS = ("id", "type", "function")
_CALL_FUNCTION_KEYS = ("name", "arguments")
_PART_KEYS = ("type", "text")
# an id names the session's files (corrupted/<session id>.json): no separators, no '~' (session_id's own)
_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ID_ACCEPTED = "1 to 64 letters, digits, '.', '_' or '-'"
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_CONTENT_ACCEPTED = 'a string, or a non-empty list of {"type": "text", "text": <string>} parts'
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class _Problem:
    field: str | None  # None: the line as a whole
    what: str
    accepted: str


# --- reading ----------------------------------------------------------------------------------------


def load_prompts(path: str | os.PathLike[str]) -> tuple[Conversation, ...]:
    """The file's conversations, in order; PromptsError naming the first problem (or an unreadable file)."""
    problems, conversations = _scan(path, limit=1)
    if problems:
        raise PromptsError(problems[0])
    return conversations


def prompts_problems(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of the file (the first MAX_PROBLEMS, then a line saying there are more); [] when
    the file is good. For config checks before any start."""
    try:
        problems, _ = _scan(path, limit=MAX_PROBLEMS + 1)
    except PromptsError as e:
        return [str(e)]
    if len(problems) > MAX_PROBLEMS:
        return [*problems[:MAX_PROBLEMS], f"{path}: more problems after these {MAX_PROBLEMS}, not listed"]
    return problems


def _scan(path: str | os.PathLike[str], limit: int) -> tuple[list[str], tuple[Conversation, ...]]:
    """(up to `limit` problems, the good lines' conversations); PromptsError when the file is unreadable."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PromptsError(
            f"{path}: cannot read it ({e.strerror or e}); accepted: a readable JSONL file"
        ) from e
    data = data.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark, as some editors write
    problems: list[str] = []
    conversations: list[Conversation] = []
    ids: dict[str, int] = {}  # conversation id -> its line
    for n, raw in enumerate(data.split(b"\n"), 1):
        if len(problems) >= limit:
            break
        if not raw.strip():
            continue
        value, found = _parse_line(raw)
        if not found:
            found = list(_check_line(value))
        conversation = None if found else _conversation(value, n)
        cid = value.get("id", f"line{n}") if isinstance(value, dict) else None
        if isinstance(cid, str) and cid in ids:
            given = "" if "id" in value else "(no id: its default) "
            found.append(
                _Problem("id", f"{given}{cid!r} is already line {ids[cid]}'s id", "an id unique in the file")
            )
        elif isinstance(cid, str):
            ids[cid] = n
        problems += [_render(path, n, p) for p in found]
        if conversation is not None and not found:
            conversations.append(conversation)
    if not problems and not conversations:
        problems.append(f"{path}: no conversations; accepted: one conversation (a JSON object) per line")
    return problems[:limit], tuple(conversations)


def _parse_line(raw: bytes) -> tuple[Any, list[_Problem]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, [_Problem(None, f"not UTF-8 (byte {e.start + 1})", "UTF-8 text")]
    try:
        return json.loads(text), []
    except json.JSONDecodeError as e:
        return None, [_Problem(None, f"not JSON: {e.msg} (column {e.colno})", "one JSON object per line")]
    except RecursionError:
        return None, [_Problem(None, "JSON nested too deeply to read", "one JSON object per line")]


def _render(path: str | os.PathLike[str], n: int, problem: _Problem) -> str:
    where = f"{problem.field}: " if problem.field else ""
    return f"{path} line {n}: {where}{problem.what}; accepted: {problem.accepted}"


def _conversation(value: dict[str, Any], n: int) -> Conversation:
    tools = value.get("tools")
    return Conversation(
        id=value.get("id", f"line{n}"),
        messages=tuple(value["messages"]),
        tools=tuple(tools) if tools is not None else None,
        expected=value.get("expected"),
        line=n,
    )


# --- checks -----------------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    """The JSON name of a value's type, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {str: "string", int: "number", float: "number", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _a_kind(value: Any) -> str:
    kind = _kind(value)
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _clip(text: str, limit: int = 120) -> str:
    """`text` quoted, its middle cut where it is long (both ends of an answer can matter)."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return f"{text[:half]!r} … {text[-half:]!r} ({len(text)} characters)"


def _unknown_keys(value: Mapping[str, Any], where: str, allowed: Sequence[str]) -> Iterator[_Problem]:
    for key in value:
        if key not in allowed:
            field = f"{where}.{key}" if where else key
            yield _Problem(field, "unknown key", f"the keys {', '.join(allowed)}")


def _check_line(value: Any) -> Iterator[_Problem]:
    if not isinstance(value, dict):
        yield _Problem(None, f"a JSON {_kind(value)}", "one JSON object per line")
        return
    yield from _unknown_keys(value, "", LINE_KEYS)
    if "id" in value and not (isinstance(value["id"], str) and _ID_RE.fullmatch(value["id"])):
        given = value["id"]
        yield _Problem("id", _clip(given, 70) if isinstance(given, str) else _a_kind(given), _ID_ACCEPTED)
    expected = value.get("expected")
    if "expected" in value and not (isinstance(expected, str) and expected.strip()):
        # an empty answer occurs in every text: it would judge nothing
        what = f"a blank string {expected!r}"[:80] if isinstance(expected, str) else _a_kind(expected)
        yield _Problem("expected", what, "a non-blank string")
    if "metadata" in value and not isinstance(value["metadata"], dict):
        yield _Problem("metadata", _a_kind(value["metadata"]), "an object")
    tools: dict[str, Any] | None = None  # the declared functions -> their parameters (None: no tools)
    tools_ok = True  # calls are checked against the tools only where these are well formed
    if "tools" in value:
        tool_problems, tools = _check_tools(value["tools"])
        tools_ok = not tool_problems
        yield from tool_problems
    if "messages" not in value:
        yield _Problem("messages", "missing", "a non-empty list of chat messages")
        return
    yield from _check_messages(value["messages"], tools, tools_ok)


def _check_tools(tools: Any) -> tuple[list[_Problem], dict[str, Any]]:
    """(problems, the declared functions' names -> their parameters schema, None where they have none)."""
    if not isinstance(tools, list) or not tools:
        what = "an empty list" if tools == [] else _a_kind(tools)
        return [_Problem("tools", what, "a non-empty list of function tools (leave it out for none)")], {}
    problems: list[_Problem] = []
    declared: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        problems += _check_tool(tool, where)
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name in declared:
            problems.append(_Problem(f"{where}.function.name", f"{name!r} declared twice", "unique names"))
        elif isinstance(name, str):
            declared[name] = function.get("parameters")
    return problems, declared


def _check_tool(tool: Any, where: str) -> Iterator[_Problem]:
    """One OpenAI function tool on its own."""
    if not isinstance(tool, dict):
        yield _Problem(where, _a_kind(tool), '{"type": "function", "function": {...}}')
        return
    yield from _unknown_keys(tool, where, _TOOL_KEYS)
    if tool.get("type") != "function":
        yield _Problem(f"{where}.type", repr(tool.get("type")), "'function'")
    function = tool.get("function")
    where = f"{where}.function"
    if not isinstance(function, dict):
        accepted = '{"name": <string>, "description"?: <string>, "parameters"?: <JSON schema object>}'
        yield _Problem(where, _a_kind(function), accepted)
        return
    yield from _unknown_keys(function, where, _FUNCTION_KEYS)
    name = function.get("name")
    if not (isinstance(name, str) and _NAME_RE.fullmatch(name)):
        yield _Problem(f"{where}.name", repr(name), "1 to 64 letters, digits, '_' or '-'")
    if "description" in function and not isinstance(function["description"], str):
        yield _Problem(f"{where}.description", _a_kind(function["description"]), "a string")
    if "strict" in function and not isinstance(function["strict"], bool):
        yield _Problem(f"{where}.strict", _a_kind(function["strict"]), "true or false")
    if "parameters" in function:
        yield from _schema_problems(function["parameters"], f"{where}.parameters")


def _schema_problems(schema: Any, where: str) -> Iterator[_Problem]:
    if not isinstance(schema, dict):
        yield _Problem(where, _a_kind(schema), "a JSON schema object")
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        yield _Problem(where, f"not a valid JSON schema: {e.message[:160]}", "a JSON schema object")


def _check_messages(messages: Any, tools: dict[str, Any] | None, tools_ok: bool) -> Iterator[_Problem]:
    """`tools`: the line's functions -> their parameters (None: the line declares none); `tools_ok`: they
    are well formed, so each call's name and arguments are checked against them."""
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else _a_kind(messages)
        yield _Problem("messages", what, "a non-empty list of chat messages")
        return
    calls: dict[str, int] = {}  # every call id so far -> its assistant message's index
    pending: dict[str, str] = {}  # the latest assistant message's unanswered call ids -> their field
    started = False  # a non-system message was seen
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        shape = list(_check_message(message, where))
        yield from shape
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            continue
        if not started and role not in _SYSTEM_ROLES:
            started = True
            if role != "user":
                accepted = "a user message first, after any system or developer messages"
                yield _Problem(f"{where}.role", f"{role!r} opens the chat", accepted)
        if role != "tool":
            # OpenAI's rule: tool messages answer each call of an assistant message before anything else
            accepted = "a tool message answering each call, right after its assistant message"
            for call_id, field in pending.items():
                yield _Problem(field, f"call {call_id!r} is not answered before {where}", accepted)
            pending = {}
        if role == "assistant" and isinstance(message.get("tool_calls"), list):
            yield from _check_calls(message["tool_calls"], i, tools, tools_ok, calls, pending)
        if role == "tool":
            yield from _check_answer(message.get("tool_call_id"), where, calls, pending)
    yield from _check_ending(messages, started, pending)


def _check_message(message: Any, where: str) -> Iterator[_Problem]:
    """One message on its own: its role, keys and the types of its fields."""
    if not isinstance(message, dict):
        yield _Problem(where, _a_kind(message), 'a message object {"role": ..., "content": ...}')
        return
    role = message.get("role")
    if role not in ROLES:
        yield _Problem(
            f"{where}.role", "missing" if role is None else repr(role), f"one of {', '.join(ROLES)}"
        )
        return
    yield from _unknown_keys(message, where, _MESSAGE_KEYS[role])
    yield from _check_content(message, where)
    if "name" in message and not (isinstance(message["name"], str) and message["name"]):
        yield _Problem(f"{where}.name", repr(message["name"]), "a non-empty string")
    reasoning = message.get("reasoning_content")
    if role == "assistant" and not isinstance(reasoning, str | None):
        yield _Problem(f"{where}.reasoning_content", _a_kind(reasoning), "a string or null")
    tool_calls = message.get("tool_calls")
    if role == "assistant" and "tool_calls" in message and not (isinstance(tool_calls, list) and tool_calls):
        what = "an empty list" if tool_calls == [] else _a_kind(tool_calls)
        yield _Problem(f"{where}.tool_calls", what, "a non-empty list of tool calls (leave it out for none)")


def _check_calls(
    tool_calls: list[Any],
    i: int,
    tools: dict[str, Any] | None,
    tools_ok: bool,
    calls: dict[str, int],
    pending: dict[str, str],
) -> Iterator[_Problem]:
    """The tool calls of message i; each well-named one joins `calls` and `pending` (updated in place)."""
    where = f"messages[{i}].tool_calls"
    if tools is None:
        yield _Problem(
            where, "tool calls in a line without tools", "a line whose `tools` declare each called function"
        )
    for j, call in enumerate(tool_calls):
        field = f"{where}[{j}]"
        yield from _check_call(call, field, tools if tools_ok else None)
        call_id = call.get("id") if isinstance(call, dict) else None
        if not (isinstance(call_id, str) and call_id):
            continue
        if call_id in calls:
            accepted = "call ids unique in the conversation"
            yield _Problem(
                f"{field}.id", f"{call_id!r} is already a call of messages[{calls[call_id]}]", accepted
            )
        else:
            calls[call_id], pending[call_id] = i, f"{field}.id"


def _check_content(message: dict[str, Any], where: str) -> Iterator[_Problem]:
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return  # OpenAI's form of a turn that only calls
        accepted = f"{_CONTENT_ACCEPTED} (null or left out only in an assistant message with tool_calls)"
        yield _Problem(f"{where}.content", "missing" if "content" not in message else "null", accepted)
    elif isinstance(content, list):
        if not content:
            yield _Problem(f"{where}.content", "an empty list", _CONTENT_ACCEPTED)
        for k, part in enumerate(content):
            field = f"{where}.content[{k}]"
            if not isinstance(part, dict):
                yield _Problem(field, _a_kind(part), '{"type": "text", "text": <string>}')
                continue
            if part.get("type") != "text":  # an image or audio part: its other keys say nothing more
                yield _Problem(f"{field}.type", repr(part.get("type")), "'text' (text parts only)")
                continue
            yield from _unknown_keys(part, field, _PART_KEYS)
            if not isinstance(part.get("text"), str):
                yield _Problem(f"{field}.text", _a_kind(part.get("text")), "a string")
    elif not isinstance(content, str):
        yield _Problem(f"{where}.content", _a_kind(content), _CONTENT_ACCEPTED)


def _check_call(call: Any, where: str, tools: dict[str, Any] | None) -> Iterator[_Problem]:
    """One recorded tool call; `tools`: the tools to check its name and arguments against (None: don't)."""
    shape = '{"id": <string>, "type": "function", "function": {"name": <string>, "arguments": <JSON string>}}'
    if not isinstance(call, dict):
        yield _Problem(where, _a_kind(call), shape)
        return
    yield from _unknown_keys(call, where, _CALL_KEYS)
    if not (isinstance(call.get("id"), str) and call["id"]):
        yield _Problem(f"{where}.id", f"{call.get('id')!r}", "a non-empty string")
    if call.get("type") != "function":
        yield _Problem(f"{where}.type", f"{call.get('type')!r}", "'function'")
    function = call.get("function")
    if not isinstance(function, dict):
        yield _Problem(
            f"{where}.function", _a_kind(function), '{"name": <string>, "arguments": <JSON string>}'
        )
        return
    yield from _unknown_keys(function, f"{where}.function", _CALL_FUNCTION_KEYS)
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str):
        yield _Problem(
            f"{where}.function.name", _a_kind(name), "a string, the name of one of the line's tools"
        )
    elif tools is not None and name not in tools:
        yield _Problem(
            f"{where}.function.name",
            f"{name!r} is not one of the line's tools",
            f"one of {', '.join(tools) or 'none'}",
        )
    schema = tools.get(name) if tools is not None and isinstance(name, str) else None
    yield from _check_arguments(arguments, f"{where}.function.arguments", name, schema)


def _check_arguments(arguments: Any, field: str, name: Any, schema: dict | None) -> Iterator[_Problem]:
    """A recorded call's arguments: a JSON object in a string, valid against its tool's `schema` (if any)."""
    if not isinstance(arguments, str):
        accepted = "a string holding a JSON object (OpenAI sends arguments as text)"
        yield _Problem(field, _a_kind(arguments), accepted)
        return
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        what = f"not JSON: {e.msg} (column {e.colno}) in {_clip(arguments, 60)}"
        yield _Problem(field, what, "a string holding a JSON object")
        return
    except RecursionError:
        yield _Problem(field, "JSON nested too deeply to read", "a string holding a JSON object")
        return
    if not isinstance(parsed, dict):
        yield _Problem(field, f"JSON {_kind(parsed)}, not an object", "a string holding a JSON object")
        return
    if schema is None:
        return
    # a recorded call is the call the oracle expects: one that breaks its own schema expects corruption
    error = best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(parsed))
    if error is not None:
        at = "".join(f"[{p!r}]" for p in error.absolute_path)
        what = f"does not fit {name}'s parameters{' at ' + at if at else ''}: {error.message[:160]}"
        yield _Problem(field, what, "arguments valid against the tool's parameters")


def _check_answer(
    call_id: Any, where: str, calls: dict[str, int], pending: dict[str, str]
) -> Iterator[_Problem]:
    """A tool message's tool_call_id: it answers an unanswered call of the latest assistant message."""
    field = f"{where}.tool_call_id"
    if not isinstance(call_id, str):
        yield _Problem(
            field,
            "missing" if call_id is None else _a_kind(call_id),
            "the id of an earlier assistant tool call",
        )
    elif call_id in pending:
        del pending[call_id]
    elif call_id in calls:
        yield _Problem(
            field,
            f"call {call_id!r} of messages[{calls[call_id]}] is already answered",
            "one tool message per call",
        )
    else:
        known = ", ".join(repr(c) for c in pending) or "none unanswered"
        yield _Problem(
            field,
            f"{call_id!r} names no earlier tool call",
            f"the id of an unanswered call of the latest assistant message ({known})",
        )


def _check_ending(messages: list[Any], started: bool, pending: dict[str, str]) -> Iterator[_Problem]:
    last = len(messages) - 1
    if not started:
        # a message of no known role is already a problem, which may be the user message meant
        if all(isinstance(m, dict) and m.get("role") in ROLES for m in messages):
            accepted = "a chat with a user message after any system messages"
            yield _Problem("messages", "no user message", accepted)
        return
    role = messages[last].get("role") if isinstance(messages[last], dict) else None
    if role in _SYSTEM_ROLES:
        yield _Problem(
            f"messages[{last}].role",
            f"the conversation ends on a {role} message",
            "a conversation that ends on a user, assistant or tool message",
        )
    if role == "tool":
        # the final turn would send a call without its answer
        for call_id, field in pending.items():
            yield _Problem(
                field,
                f"call {call_id!r} is not answered before the final turn",
                "a tool message answering each call",
            )


# --- replay -----------------------------------------------------------------------------------------


def replay_turns(conversation: Conversation) -> tuple[ReplayTurn, ...]:
    """The conversation's turns, as recorded (the module's replay rule)."""
    messages = conversation.messages
    turns = [(i, message) for i, message in enumerate(messages) if message.get("role") == "assistant"]
    spans: list[tuple[int, dict | None]] = list(turns)
    if messages and messages[-1].get("role") in ("user", "tool"):
        spans.append((len(messages), None))
    if not spans:
        raise ValueError(f"conversation {conversation.id!r} (line {conversation.line}) has no turn")
    return tuple(
        ReplayTurn(list(messages[:end]), recorded, _first_call(recorded), last=k == len(spans) - 1)
        for k, (end, recorded) in enumerate(spans)
    )


def _first_call(message: Mapping[str, Any] | None) -> ToolCall | None:
    calls = message.get("tool_calls") if message is not None else None
    if not calls:
        return None
    function = calls[0]["function"]
    return ToolCall(function["name"], json.loads(function["arguments"]))


def session_conversation(conversations: Sequence[Conversation], seed: int, index: int) -> Conversation:
    """The conversation session `index` replays: they cycle, offset by the seed, so a repetition (seed +
    r*7919) starts elsewhere in the file."""
    if not conversations:
        raise ValueError("no conversations to replay")
    return conversations[(seed + index) % len(conversations)]


def session_id(conversation: Conversation, seed: int, index: int) -> str:
    """Unique per session (a conversation replays in many) and readable: its id, then the built-in tasks'."""
    return f"{conversation.id}~s{seed}-{index:05d}"


# --- the answer oracle ------------------------------------------------------------------------------


def _normalised(text: str) -> str:
    return " ".join(text.split())


def answer_finding(text: str, expected: str | None) -> Finding | None:
    """`wrong_answer` when the last turn's answer `text` does not contain `expected` (whitespace runs
    collapsed and both ends stripped, case kept); None when it does or there is nothing expected."""
    if expected is None:
        return None
    want, got = _normalised(expected), _normalised(text or "")
    if want in got:
        return None
    return Finding("wrong_answer", f"expected {_clip(want, 80)}, not in the answer {_clip(got)}")
