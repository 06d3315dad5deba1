"""Your own reproducer (`workload=reproducer`): your code judges each session; the orchestrator runs it
against every arm's router and pools, tests and reports its outcomes as it does the built-in oracle's.

Exactly one of two forms (docs/reproducer.md):

- A Python callable, `workload.call: {_target_: module.function, ...}` (the other keys are its keyword
  arguments, as Hydra's `instantiate` passes them). It is called once per session as
  `fn(url=<the router's base URL>, session=<the session's id, s<seed>-<i:05d>>, settings=<these
  ReproducerSettings>)`, at most `concurrency` sessions at once, each in a thread of its own (an
  `async def` is awaited on the run's loop instead), and returns the session's outcome: "clean",
  "corrupted" or "errored", or `{"outcome": ..., "detail": <any JSON>}`. An exception it raises makes
  that session errored (a client's failure is no corruption), and so does a session past `timeout_s`
  (its thread cannot be stopped and is left to end: let the callable bound its own requests).
- Any executable, `workload.command: [argv...]`, started once per arm with HEISENHUNT_URL,
  HEISENHUNT_SESSIONS, HEISENHUNT_CONCURRENCY, HEISENHUNT_SEED and HEISENHUNT_MODEL in its environment
  (and PYTHONUNBUFFERED=1 unless set: a Python script's lines then arrive as it prints them). It prints one
  JSON object per session on stdout, `{"session": "<id>", "outcome": ..., "detail": ...}` (ids its own,
  unique); blank lines are skipped. Its stderr goes to `<out_dir>/reproducer.stderr`. `timeout_s` bounds
  the whole run.

Every outcome is checked against reproducer.schema.json and written at once, as the stress workload writes
its own (stress.Outputs): `sessions.jsonl`, `summary.json`, and `corrupted/<id>.json` with the detail in
full. A reproducer that breaks the protocol (a line that is no such object, a session reported twice, more
or fewer sessions than planned, a non-zero exit, a run past its timeout, a callable's invalid return)
raises ReproducerError naming the line, the exit status or the timeout: the arm is then FAILED and never
pooled. The command's process group is killed however the run ends, so nothing it started is left
running. A deployment that dies meanwhile (`server_gone`) stops the run early (its summary partial; the
arm then fails on the dead server); an interrupt writes the partial outputs and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import inspect
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from orchestrator.workload.client import run_sync
from orchestrator.workload.fill import fill
from orchestrator.workload.results import BadTurn, SessionOutcome, StressSummary
from orchestrator.workload.stress import Outputs, SessionRun, quiet_on_interrupt

log = logging.getLogger(__name__)

SCHEMA_FILE = Path(__file__).with_name("reproducer.schema.json")
OUTCOMES = ("clean", "corrupted", "errored")
DETECTOR = FAMILY = "reproducer"  # detect.FAMILIES: the one detector of the reproducer's family
STDERR_FILE = "reproducer.stderr"
ENV_NAMES = ("HEISENHUNT_URL", "HEISENHUNT_SESSIONS", "HEISENHUNT_CONCURRENCY", "HEISENHUNT_SEED")
MODEL_ENV = "HEISENHUNT_MODEL"
# the keys of a `_target_` node that are Hydra's, not keyword arguments
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_convert_", "_recursive_")
PASSED = ("url", "session", "settings")  # what the workload passes the callable itself

LINE_LIMIT = 1 << 20  # bytes of one stdout line; a longer one is a protocol error, not a reason to grow
SHOWN = 200  # characters of a line or a value quoted in an error
REASON_CHARS = 200  # a corrupted session's reason (one line a person reads)
RAW_CHARS = 4000  # its detail's JSON in the outcome line; corrupted/<id>.json keeps it whole
ERROR_CHARS = 500  # an errored session's error, as the stress workload bounds its own
STDERR_KEPT = 1 << 20  # bytes of the command's stderr kept in reproducer.stderr
STDERR_QUOTED = 800  # characters of its stderr's end quoted in an error
STOP_GRACE_S = 2.0  # between SIGTERM and SIGKILL to the command's process group

# names that look like credentials (as config/redact.py has them; workload imports nothing of config)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)
REDACTED = "***"


class ReproducerError(RuntimeError):
    """The reproducer broke its protocol (or could not start): the arm fails with this message."""


# --- settings and the checks before anything starts -----------------------------------------------------


def session_id(seed: int, index: int) -> str:
    """The id of the callable's session `index` (the example command numbers its own the same way)."""
    return f"s{seed}-{index:05d}"


@dataclass(frozen=True)
class ReproducerSettings:
    """What one reproducer run does. The run's record (`record()`) goes into summary.json."""

    url: str  # the router's base URL, e.g. http://127.0.0.1:8000
    out_dir: Path  # where sessions.jsonl, summary.json, corrupted/ and reproducer.stderr are written
    sessions: int = 60
    concurrency: int | None = None  # sessions at once; None (or 0) means all of them
    seed: int = 0  # the callable's ids are s<seed>-<i:05d>; the command gets it as HEISENHUNT_SEED
    model: str = "default"  # the served model name (settings.model, HEISENHUNT_MODEL)
    timeout_s: float = 120.0  # the callable: per session; the command: the whole run
    call: Mapping[str, Any] | None = None  # a Hydra `_target_` node
    command: tuple[str, ...] | None = None  # an executable's argv
    progress: bool | None = None  # live display on stderr; None: exactly when stderr is a terminal
    watch_interval_s: float = 2.0  # how often `server_gone` is polled

    def __post_init__(self) -> None:
        if self.sessions < 1:
            raise ValueError(f"workload.sessions must be >= 1: {self.sessions}")
        if not self.timeout_s > 0:
            raise ValueError(f"workload.timeout_s must be > 0: {self.timeout_s}")
        problems = form_problems(self.call, self.command, resolve=False)
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.command is not None:
            object.__setattr__(self, "command", tuple(self.command))
        if self.call is not None:
            object.__setattr__(self, "call", dict(self.call))

    @property
    def workers(self) -> int:
        """Sessions that run at once."""
        return min(self.sessions, self.concurrency or self.sessions)

    def identity(self) -> dict[str, Any]:
        """Which reproducer ran, secret-looking values redacted."""
        if self.call is not None:
            return {"call": redact_mapping(self.call)}
        return {"command": redact_argv(self.command or ())}

    def record(self) -> dict[str, Any]:
        """The settings that shape the result, as summary.json keeps them (`count` as stress writes it)."""
        return {
            "url": self.url,
            "sessions": self.sessions,
            "concurrency": self.workers,
            "seed": self.seed,
            "model": self.model,
            "timeout_s": self.timeout_s,
            "timeout_of": "each session" if self.call is not None else "the whole run",
            "oracle": "reproducer",
            "count": [FAMILY],
            "reproducer": self.identity(),
        }


def reproducer_settings(source: object, **given: Any) -> ReproducerSettings:
    """The one mapping to ReproducerSettings (fill.py): every field from `source` by name (a job's
    `workload` section), but those `given` (what the caller computes: url, out_dir, ...)."""
    return fill(ReproducerSettings, source, **given)


def reproducer_problems(workload: Any) -> list[str]:
    """Why a job's workload section cannot run its reproducer (empty: it can), before any restart. Reads
    `oracle`, `call` and `command`; imports the callable's module (its import errors are named here) and
    looks the command's program up, since both run on this machine."""
    oracle, call, command = workload.oracle, workload.call, workload.command
    if oracle != "reproducer":
        return [
            f"workload.{key}: set, but workload.oracle is {oracle!r}; only the reproducer oracle runs it "
            "(workload=reproducer)"
            for key, value in (("call", call), ("command", command))
            if value is not None
        ]
    return form_problems(call, command, resolve=True)


def form_problems(call: object, command: object, resolve: bool) -> list[str]:
    """Exactly one of `call` and `command`, well formed; with `resolve`, the callable importable and
    callable as the workload calls it, the program found."""
    if (call is None) == (command is None):
        got = "both" if call is not None else "neither"
        return [
            "workload=reproducer needs exactly one of workload.call (a Python callable: "
            "{_target_: module.function}) and workload.command (an executable's argv: [program, args...]); "
            f"got {got}"
        ]
    return call_problems(call, resolve) if call is not None else command_problems(command, resolve)


def call_problems(call: object, resolve: bool) -> list[str]:
    if not (isinstance(call, Mapping) and isinstance(call.get("_target_"), str) and call["_target_"].strip()):
        return [
            f"workload.call: {shown(repr(call))} must be a mapping with a `_target_` naming a Python "
            "callable (module.function); its other keys are the callable's keyword arguments"
        ]
    passed = [key for key in PASSED if key in call]
    if passed:
        return [f"workload.call.{passed[0]}: the workload passes {', '.join(PASSED)} itself; rename the key"]
    if not resolve:
        return []
    target = call["_target_"]
    try:
        fn = locate(target)
    except ImportError as e:
        return [f"workload.call._target_: {target!r} cannot be imported: {e}"]
    if not callable(fn):
        return [f"workload.call._target_: {target!r} is a {type(fn).__name__}, not a callable"]
    problem = signature_problem(fn, call)
    return [problem] if problem else []


def command_problems(command: object, resolve: bool) -> list[str]:
    words = command if isinstance(command, Sequence) and not isinstance(command, str) else None
    if not words or not all(isinstance(w, str) and w for w in words):
        return [
            f"workload.command: {shown(repr(command))} must be a non-empty list of non-empty strings, the "
            "executable's argv (e.g. workload.command=[python,my_reproducer.py])"
        ]
    if resolve and shutil.which(words[0]) is None:
        return [
            f"workload.command[0]: {words[0]!r} is not an executable: neither a file with execute "
            "permission nor a program on PATH"
        ]
    return []


def locate(path: str) -> Any:
    """The object a dotted path names (the longest importable module, then attributes); ImportError
    saying what is missing."""
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ImportError("not a dotted path of Python names (module.function)")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise ImportError(f"importing {name} failed: {e}") from e
        except Exception as e:  # the module exists and fails on import: that is the problem to name
            raise ImportError(f"importing {name} failed: {type(e).__name__}: {e}") from e
        for i, attr in enumerate(parts[end:], start=end):
            if not hasattr(obj, attr):
                raise ImportError(f"{'.'.join(parts[:i])} has no attribute {attr!r}")
            obj = getattr(obj, attr)
        return obj
    raise ImportError(
        f"no module named {parts[0]!r} (is its folder on the Python path? the working directory is)"
    )


def signature_problem(fn: Callable[..., Any], call: Mapping[str, Any]) -> str | None:
    """Why `fn` cannot be called as the workload calls it, with the node's keyword arguments (None: it can,
    or its signature cannot be read)."""
    extra = {k: v for k, v in call.items() if k not in HYDRA_KEYS}
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*(call.get("_args_") or ()), url="", session="", settings=None, **extra)
    except TypeError as e:
        keywords = ", ".join([*(f"{k}=..." for k in PASSED), *(f"{k}=..." for k in extra)])
        return f"workload.call: {call['_target_']} cannot be called as fn({keywords}): {e}"
    return None


def redact_mapping(node: Any) -> Any:
    """`node` with the values of secret-looking keys replaced by ***, at any depth."""
    if isinstance(node, Mapping):
        return {
            str(k): REDACTED if SECRET_NAME.search(str(k)) else redact_mapping(v) for k, v in node.items()
        }
    if isinstance(node, list | tuple):
        return [redact_mapping(v) for v in node]
    return node


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of a secret-looking flag (`--api-key X`, `--api-key=X`) or `NAME=VALUE`
    word replaced by ***."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        name, eq, _ = word.partition("=")
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif SECRET_NAME.search(name) and (eq or word.startswith("-")):
            out.append(f"{name}={REDACTED}" if eq else word)
            hide_next = not eq
        else:
            out.append(word)
    return out


# --- one outcome: checked, then as the stress workload writes it -----------------------------------------


def shown(value: Any, limit: int = SHOWN) -> str:
    """A value as an error quotes it: a line as it was, anything else as its repr; bounded."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def report_problems(document: object) -> list[str]:
    """Where one outcome departs from reproducer.schema.json, one phrase each (none: it is valid)."""
    errors = sorted(_validator().iter_errors(document), key=lambda e: ([str(p) for p in e.path], e.message))
    return [_phrase(e) for e in errors]


def _phrase(error: Any) -> str:
    key = f"'{error.path[0]}'" if error.path else ""
    value = shown(repr(error.instance), 60)
    if error.validator == "type" and not error.path:
        return f"must be a JSON object, not {_JSON_TYPES.get(type(error.instance), 'a number')}"
    if error.validator == "enum":
        return f"{key} must be one of {', '.join(error.validator_value)}, not {value}"
    if error.validator == "pattern":
        return (
            f"{key} must be 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' (it names a "
            f"file), not {value}"
        )
    return shown(f"{key}: {error.message}" if key else error.message)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_line(number: int, raw: bytes) -> dict[str, Any] | None:
    """Stdout line `number` of a command: its outcome object, None for a blank line; ReproducerError
    naming the line where it is anything else."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise ReproducerError(
            f"reproducer line {number}: {shown(repr(raw))} is not UTF-8 ({e.reason})"
        ) from None
    if not text:
        return None
    try:
        document = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise ReproducerError(
            f"reproducer line {number}: {shown(text)} is not JSON ({e}); the protocol is one JSON object per "
            "session, one per line (reproducer.schema.json)"
        ) from None
    problems = report_problems(document)
    if problems:
        raise ReproducerError(f"reproducer line {number}: {shown(text)} is not valid: {'; '.join(problems)}")
    return document


def returned_report(session: str, result: object) -> dict[str, Any]:
    """What a callable returned for `session`, as a checked outcome object; ReproducerError where it is
    not one."""
    document = {"outcome": result} if isinstance(result, str) else result
    problems = []
    if not isinstance(document, Mapping):
        problems.append('return "clean", "corrupted" or "errored", or {"outcome": ..., "detail": ...}')
    else:
        document = {"session": session, **document}
        problems += report_problems(document)
        if document["session"] != session:
            problems.append(f"'session' is {document['session']!r}, not this session's id {session!r}")
        try:
            json.dumps(document, allow_nan=False)
        except (TypeError, ValueError) as e:
            problems.append(f"'detail' is not JSON: {e}")
    if problems:
        raise ReproducerError(
            f"reproducer call for session {session} returned {shown(result)}, not a valid outcome: "
            + "; ".join(problems)
        )
    return dict(document)  # type: ignore[arg-type]


def _detail_line(detail: Any) -> str:
    """A detail as one short line: a string's first line, anything else as compact JSON."""
    text = detail.strip().splitlines()[0] if isinstance(detail, str) and detail.strip() else ""
    if not isinstance(detail, str) and detail is not None:
        text = json.dumps(detail, separators=(",", ":"))
    return shown(text, REASON_CHARS) if text else ""


def outcome_of(document: Mapping[str, Any], latency_s: float | None = None) -> SessionRun:
    """A checked outcome object as the stress workload's session outcome (one round), with the corrupted
    session's detail in full for corrupted/<id>.json."""
    session, status = document["session"], document["outcome"]
    detail = document.get("detail")
    outcome = SessionOutcome(session, status, rounds=1, rounds_done=int(status == "clean"))
    if latency_s is not None:
        outcome.turn_latency_s.append(round(latency_s, 6))
    if status == "corrupted":
        reason = _detail_line(detail) or "the reproducer called it corrupted (no detail)"
        raw = json.dumps(detail) if "detail" in document else ""
        outcome.bad_turn = BadTurn(0, DETECTOR, reason, shown(raw, RAW_CHARS), FAMILY)
        return SessionRun(outcome, corrupted={"session_id": session, "outcome": status, "detail": detail})
    if status == "errored":
        outcome.error = shown(f"reproducer: {_detail_line(detail) or 'errored (no detail)'}", ERROR_CHARS)
    return SessionRun(outcome)


# --- the command -----------------------------------------------------------------------------------------


def command_env(settings: ReproducerSettings, base: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: `base` with the protocol's variables."""
    env = {"PYTHONUNBUFFERED": "1", **base}
    values = (settings.url, settings.sessions, settings.workers, settings.seed)
    env.update({name: str(value) for name, value in zip(ENV_NAMES, values, strict=True)})
    env[MODEL_ENV] = settings.model
    return env


def end_problem(status: int, printed: int, planned: int, stderr_end: str) -> str | None:
    """Why a command that ended with `status` after printing `printed` of `planned` sessions broke the
    protocol (None: it kept it)."""
    if status < 0:
        try:
            name = f"{-status} ({signal.Signals(-status).name})"
        except ValueError:
            name = str(-status)
        return f"reproducer was killed by signal {name} after {printed} of {planned} sessions{stderr_end}"
    if status:
        return f"reproducer exited with status {status} after {printed} of {planned} sessions{stderr_end}"
    if printed < planned:
        return f"reproducer printed {printed} of {planned} sessions and exited 0{stderr_end}"
    return None


class _Sessions:
    """The sessions a command has reported, by the line that did: none twice, none past the plan."""

    def __init__(self, planned: int):
        self.planned = planned
        self.lines: dict[str, int] = {}

    def add(self, number: int, session: str, text: str) -> None:
        first = self.lines.get(session)
        if first is not None:
            raise ReproducerError(
                f"reproducer line {number}: {shown(text)} reports session {session!r} again (first on line "
                f"{first}); each session is reported once"
            )
        if len(self.lines) >= self.planned:
            raise ReproducerError(
                f"reproducer line {number}: {shown(text)} is one session more than the {self.planned} "
                "planned (HEISENHUNT_SESSIONS)"
            )
        self.lines[session] = number


class _Stderr:
    """The command's stderr: the first STDERR_KEPT bytes to a file, its end kept for errors."""

    def __init__(self, path: Path):
        self.path = path
        self.file: BinaryIO = path.open("wb")
        self.written = 0
        self.end = b""
        self.cut = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(1 << 16):
            room = STDERR_KEPT - self.written
            if room > 0:
                self.file.write(chunk[:room])
                self.file.flush()
                self.written += min(room, len(chunk))
            self.cut = self.cut or len(chunk) > room
            self.end = (self.end + chunk)[-4 * STDERR_QUOTED :]

    def close(self) -> None:
        if self.cut:
            self.file.write(f"\n[stderr cut here: only its first {STDERR_KEPT} bytes are kept]\n".encode())
        self.file.close()

    def ending(self) -> str:
        """What an error quotes: the end of the stderr, or that there was none."""
        text = self.end.decode("utf-8", "replace").strip()
        if not text:
            return "; its stderr is empty"
        return f"; its stderr ends: {text[-STDERR_QUOTED:]}"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _CommandRun:
    """One run of the command: its lines read, checked and recorded as they come."""

    def __init__(self, settings: ReproducerSettings, outputs: Outputs):
        self.settings = settings
        self.outputs = outputs
        self.sessions = _Sessions(settings.sessions)
        self.stderr = _Stderr(settings.out_dir / STDERR_FILE)
        self.gone_reason = ""
        self.torn: ReproducerError | None = None  # the last line's error, where it ended without a newline

    async def run(self, server_gone: Callable[[], str | None] | None) -> None:
        settings = self.settings
        argv = list(settings.command or ())
        try:
            # a session of its own: the whole group is stopped at the end, nothing it started outlives it
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=command_env(settings, os.environ),
                start_new_session=True,
                limit=LINE_LIMIT,
            )
        except OSError as e:
            self.stderr.close()
            raise ReproducerError(f"reproducer could not start {argv[0]!r}: {e}") from e
        assert process.stdout is not None and process.stderr is not None
        log.info("reproducer: started %s (pid %d)", redact_argv(argv), process.pid)
        drain = asyncio.ensure_future(self.stderr.drain(process.stderr))
        watcher = asyncio.ensure_future(self.watch(process, server_gone)) if server_gone else None
        timeout = asyncio.timeout(settings.timeout_s)
        status = None
        try:
            async with timeout:
                await self.read(process.stdout)
                status = await process.wait()
        except TimeoutError:
            if not timeout.expired():
                raise
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.stop(process, drain)
        printed, planned = len(self.sessions.lines), settings.sessions
        if self.gone_reason:
            return  # the summary is partial; the arm fails on the dead server
        if status is None:
            raise ReproducerError(
                f"reproducer ran past its timeout of {settings.timeout_s:g} s (workload.timeout_s) after "
                f"{printed} of {planned} sessions; stopped{self.stderr.ending()}"
            )
        if self.torn is not None and status == 0:
            raise self.torn
        problem = end_problem(status, printed, planned, self.stderr.ending())
        if problem:
            raise ReproducerError(problem)

    async def read(self, stdout: asyncio.StreamReader) -> None:
        number = 0
        while True:
            try:
                raw = await stdout.readline()
            except ValueError:  # the line is over the stream's limit
                raise ReproducerError(
                    f"reproducer line {number + 1}: longer than {LINE_LIMIT} bytes; one session's outcome "
                    "per line"
                ) from None
            if not raw:
                return
            number += 1
            try:
                document = parse_line(number, raw)
            except ReproducerError as e:
                if raw.endswith(b"\n"):
                    raise
                # the last line, cut short: a reproducer killed mid-line; its exit status says so first
                self.torn = e
                return
            if document is not None:
                self.sessions.add(number, document["session"], raw.decode().strip())
                self.outputs.record(outcome_of(document))

    async def watch(self, process: asyncio.subprocess.Process, server_gone: Callable[[], str | None]) -> None:
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            reason = await asyncio.to_thread(server_gone)
            if reason:
                self.gone_reason = reason
                log.error("reproducer: %s; stopping the reproducer", reason)
                _signal_group(process.pid, signal.SIGKILL)
                return

    async def stop(self, process: asyncio.subprocess.Process, drain: asyncio.Future[None]) -> None:
        """SIGTERM to the command's process group, SIGKILL to whatever of it is left after a grace; its
        stderr read to the end (bounded: a process that left the group may hold it open)."""
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), STOP_GRACE_S)
        _signal_group(process.pid, signal.SIGKILL)  # the leader may be gone, its children not
        await process.wait()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(drain, STOP_GRACE_S)
        self.stderr.close()


# --- the callable ----------------------------------------------------------------------------------------


def callable_of(call: Mapping[str, Any]) -> Callable[..., Any]:
    """The session function a `_target_` node names, its keyword arguments bound (Hydra's instantiate)."""
    from hydra.utils import instantiate

    try:
        return instantiate(dict(call), _partial_=True, _convert_="all")
    except Exception as e:
        raise ReproducerError(
            f"workload.call: {call.get('_target_')!r} could not be instantiated: {e}"
        ) from e


def _is_async(fn: Callable[..., Any]) -> bool:
    # an object whose __call__ is async counts too
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def in_thread(fn: Callable[..., Any], **kwargs: Any) -> Any:
    """`fn(**kwargs)` in a daemon thread of its own, awaited. Not a pool: a session past its timeout
    cannot be stopped, and a pool's worker stuck in it would hold up the sessions queued behind it; a
    daemon thread is left to end by itself and never holds up the exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():  # the session timed out or was cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        value, error = None, None
        try:
            value = fn(**kwargs)
        except Exception as e:
            error = e
        except BaseException as e:  # a SystemExit in the thread: that session's failure, not the run's
            error = RuntimeError(repr(e))
        with contextlib.suppress(RuntimeError):  # the run's loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name="reproducer-session", daemon=True).start()
    return await future


def _errored(session: str, detail: str) -> SessionRun:
    return outcome_of({"session": session, "outcome": "errored", "detail": detail})


class _CallRun:
    """One run of the callable: `workers` workers take the sessions in index order until all have
    started or the watchdog aborts (it then cancels the sessions in flight, which end as errored); each
    records its session's outcome as soon as it ends (as stress._StressRun)."""

    def __init__(self, settings: ReproducerSettings, outputs: Outputs, fn: Callable[..., Any]):
        self.settings = settings
        self.outputs = outputs
        self.fn = fn
        self.is_async = _is_async(fn)
        self.next_index = 0
        self.abort = asyncio.Event()
        self.gone_reason = ""
        self.in_flight: set[asyncio.Future[SessionRun]] = set()

    async def run(self, server_gone: Callable[[], str | None] | None) -> None:
        watcher = asyncio.ensure_future(self.watch(server_gone)) if server_gone is not None else None
        workers = [asyncio.ensure_future(self.worker()) for _ in range(self.settings.workers)]
        try:
            await asyncio.gather(*workers)
        finally:  # a worker that raised (an invalid return) ends the others too
            for task in [*workers, *([watcher] if watcher else [])]:
                task.cancel()
            await asyncio.gather(*workers, *([watcher] if watcher else []), return_exceptions=True)

    async def watch(self, server_gone: Callable[[], str | None]) -> None:
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            reason = await asyncio.to_thread(server_gone)
            if reason:
                self.gone_reason = reason
                log.error("reproducer: %s; ending the sessions in flight as errored", reason)
                self.abort.set()
                for session in list(self.in_flight):
                    session.cancel()
                return

    async def worker(self) -> None:
        settings = self.settings
        while self.next_index < settings.sessions and not self.abort.is_set():
            index, self.next_index = self.next_index, self.next_index + 1
            sid = session_id(settings.seed, index)
            session = asyncio.ensure_future(self.one_session(sid))
            self.in_flight.add(session)
            try:
                run = await session
            except asyncio.CancelledError:
                # the watchdog ended the session (the server is gone), unless this worker is cancelled
                current = asyncio.current_task()
                if not (session.cancelled() and self.abort.is_set()) or (current and current.cancelling()):
                    raise
                run = SessionRun(
                    SessionOutcome(sid, "errored", 1, 0, error=shown(f"server_gone: {self.gone_reason}"))
                )
            finally:
                self.in_flight.discard(session)
            self.outputs.record(run)

    async def one_session(self, sid: str) -> SessionRun:
        settings = self.settings
        kwargs = {"url": settings.url, "session": sid, "settings": settings}
        started = time.monotonic()
        timeout = asyncio.timeout(settings.timeout_s)
        try:
            async with timeout:
                result = await (self.fn(**kwargs) if self.is_async else in_thread(self.fn, **kwargs))
        except TimeoutError as e:
            if not timeout.expired():  # the callable's own timeout: its exception, as any other
                return _errored(sid, repr(e))
            return _errored(sid, f"ran past its timeout of {settings.timeout_s:g} s (workload.timeout_s)")
        except Exception as e:  # a client's failure is no corruption: the session errored
            return _errored(sid, repr(e))
        return outcome_of(returned_report(sid, result), time.monotonic() - started)


# --- the run ---------------------------------------------------------------------------------------------


async def run_reproducer(
    settings: ReproducerSettings,
    server_gone: Callable[[], str | None] | None = None,
    on_outcome: Callable[[str], None] | None = None,
) -> StressSummary:
    """Run the reproducer and write the outputs under `settings.out_dir` (as `stress.run_stress` does;
    the same `server_gone` and `on_outcome`). Raises ReproducerError where it breaks its protocol; on
    that, and on cancellation, the outputs of the sessions reported so far are written first."""
    progress = sys.stderr.isatty() if settings.progress is None else settings.progress
    outputs = Outputs(settings.out_dir, settings.sessions, progress, on_outcome)
    started = time.monotonic()
    asyncio.get_running_loop().set_exception_handler(quiet_on_interrupt)
    try:
        if settings.call is not None:
            await _CallRun(settings, outputs, callable_of(settings.call)).run(server_gone)
        else:
            await _CommandRun(settings, outputs).run(server_gone)
    finally:
        summary = outputs.finish(time.monotonic() - started, settings.record())
        if summary.partial:
            log.warning("reproducer: %d of %d sessions have an outcome", summary.sessions, settings.sessions)
    log.info(
        "reproducer: %d clean, %d corrupted, %d errored in %.1fs",
        summary.clean,
        summary.corrupted,
        summary.errored,
        summary.duration_s,
    )
    return summary


def run_reproducer_sync(
    settings: ReproducerSettings,
    server_gone: Callable[[], str | None] | None = None,
    on_outcome: Callable[[str], None] | None = None,
) -> StressSummary:
    """`run_reproducer` in a fresh event loop (client.run_sync); Ctrl-C writes the partial outputs, kills
    the command's process group, then raises KeyboardInterrupt."""
    return run_sync(run_reproducer(settings, server_gone, on_outcome))
