"""Your own reproducer (workload/reproducer.py): its protocol checked line by line, and real runs of it, a
command as real subprocesses of tiny scripts and a callable against the simulated server on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import pytest

from orchestrator.config.schema import StressConf
from orchestrator.workload.reproducer import (
    OUTCOMES,
    SCHEMA_FILE,
    ReproducerError,
    ReproducerSettings,
    command_env,
    end_problem,
    outcome_of,
    parse_line,
    redact_argv,
    redact_mapping,
    reproducer_problems,
    reproducer_settings,
    returned_report,
    run_reproducer,
    run_reproducer_sync,
)
from orchestrator.workload.results import BadTurn, SessionOutcome, SessionStatus
from orchestrator.workload.stress import outcome_dict

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "reproducer" / "greedy_twice.py"
EXAMPLE_TARGET = "examples.reproducer.greedy_twice.check_session"
HERE = "tests.workload.test_reproducer"


def settings(tmp_path: Path, **fields) -> ReproducerSettings:
    """A quiet run against a URL nothing needs to answer, writing under tmp_path/out."""
    return ReproducerSettings(
        **{"url": "http://127.0.0.1:9", "out_dir": tmp_path / "out", "progress": False, **fields}
    )


def script(tmp_path: Path, body: str, name: str = "repro.py") -> tuple[str, ...]:
    """The argv of a Python script with `body` (dedented), written to tmp_path."""
    path = tmp_path / name
    path.write_text("import json, os, sys, time\n" + textwrap.dedent(body))
    return (sys.executable, str(path))


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]


def summary_json(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")


# --- a line of the protocol ------------------------------------------------------------------------------


def test_a_valid_line_parses_and_a_blank_one_is_skipped():
    assert parse_line(1, b'{"session": "a-1", "outcome": "clean"}\n') == {
        "session": "a-1",
        "outcome": "clean",
    }
    line = b'{"session": "s0-00002", "outcome": "corrupted", "detail": {"first": "x", "second": "y"}}'
    assert parse_line(2, line)["detail"] == {"first": "x", "second": "y"}
    assert parse_line(3, b"  \n") is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"hello world", "is not JSON"),
        (
            b'{"session": "a", "outcome": "fine"}',
            "'outcome' must be one of clean, corrupted, errored, not 'fine'",
        ),
        (b'{"outcome": "clean"}', "'session' is a required property"),
        (b'{"session": "a", "outcome": "clean", "details": 1}', "('details' was unexpected)"),
        (b'{"session": "../etc", "outcome": "clean"}', "'session' must be 1 to 128 letters"),
        (b'{"session": 7, "outcome": "clean"}', "'session': 7 is not of type 'string'"),
        (b'["a", "clean"]', "must be a JSON object, not an array"),
        (b'{"session": "a", "outcome": "corrupted", "detail": NaN}', "is not JSON"),
        (b'{"session": "a\xff", "outcome": "clean"}', "is not UTF-8"),
    ],
)
def test_a_bad_line_is_named_with_its_number_and_text(raw, says):
    with pytest.raises(ReproducerError) as caught:
        parse_line(3, raw)
    message = str(caught.value)
    assert message.startswith("reproducer line 3: "), message
    assert says in message
    if b"\xff" not in raw:
        assert raw.decode() in message  # the line as it was


def test_a_long_bad_line_is_quoted_bounded():
    with pytest.raises(ReproducerError) as caught:
        parse_line(1, b'{"session": "a", "outcome": "' + b"x" * 5000 + b'"}')
    assert len(str(caught.value)) < 800


def test_a_callables_return_is_checked_against_the_same_schema():
    assert returned_report("s0-00001", "clean") == {"session": "s0-00001", "outcome": "clean"}
    got = returned_report("s0-00001", {"outcome": "errored", "detail": "HTTP 500"})
    assert got == {"session": "s0-00001", "outcome": "errored", "detail": "HTTP 500"}
    for bad, says in [
        (None, 'return "clean", "corrupted" or "errored"'),
        ("ok", "'outcome' must be one of clean, corrupted, errored, not 'ok'"),
        ({"outcome": "clean", "session": "other"}, "not this session's id 's0-00001'"),
        ({"outcome": "corrupted", "detail": object()}, "'detail' is not JSON"),
    ]:
        with pytest.raises(ReproducerError) as caught:
            returned_report("s0-00001", bad)
        assert str(caught.value).startswith("reproducer call for session s0-00001 returned "), caught.value
        assert says in str(caught.value)


def test_outcomes_map_to_the_stress_workloads_session_outcomes():
    clean = outcome_of({"session": "a", "outcome": "clean"}, latency_s=0.25)
    assert clean.outcome == SessionOutcome("a", "clean", 1, 1, turn_latency_s=[0.25])
    assert clean.corrupted is None

    detail = {"first": "x", "second": "y" * 10_000}
    corrupted = outcome_of({"session": "b", "outcome": "corrupted", "detail": detail})
    bad = corrupted.outcome.bad_turn
    assert corrupted.outcome.status == "corrupted" and corrupted.outcome.rounds_done == 0
    assert isinstance(bad, BadTurn) and (bad.round_index, bad.detector, bad.family) == (
        0,
        "reproducer",
        "reproducer",
    )
    assert bad.reason.startswith('{"first":"x"') and len(bad.reason) <= 200
    assert bad.raw.startswith(json.dumps(detail)[:100]) and len(bad.raw) <= 4000
    assert corrupted.corrupted == {"session_id": "b", "outcome": "corrupted", "detail": detail}  # whole

    text = outcome_of({"session": "c", "outcome": "corrupted", "detail": "answers differ\nmore"}).outcome
    assert text.bad_turn.reason == "answers differ" and text.bad_turn.raw == json.dumps(
        "answers differ\nmore"
    )
    bare = outcome_of({"session": "d", "outcome": "corrupted"}).outcome
    assert bare.bad_turn.reason and bare.bad_turn.raw == ""

    errored = outcome_of({"session": "e", "outcome": "errored", "detail": "HTTP 503"}).outcome
    assert (errored.status, errored.error, errored.bad_turn) == ("errored", "reproducer: HTTP 503", None)
    assert outcome_of({"session": "f", "outcome": "errored"}).outcome.error.startswith("reproducer: ")


def test_the_schemas_outcomes_are_the_session_statuses():
    schema = json.loads(SCHEMA_FILE.read_text())
    assert tuple(schema["properties"]["outcome"]["enum"]) == OUTCOMES == get_args(SessionStatus)


def test_how_a_command_ended_is_judged():
    assert end_problem(0, 3, 3, "") is None
    assert end_problem(2, 1, 3, "; its stderr ends: boom") == (
        "reproducer exited with status 2 after 1 of 3 sessions; its stderr ends: boom"
    )
    assert end_problem(-9, 1, 3, "") == "reproducer was killed by signal 9 (SIGKILL) after 1 of 3 sessions"
    assert end_problem(0, 2, 3, "") == "reproducer printed 2 of 3 sessions and exited 0"


# --- the checks before anything starts -------------------------------------------------------------------


def check_session_of_the_test(url, session, settings=None, n=1):
    return "clean"


NOT_CALLABLE = 42


def conf(**fields) -> StressConf:
    return StressConf(**{"oracle": "reproducer", **fields})


def test_a_good_call_or_command_has_no_problems():
    assert reproducer_problems(conf(call={"_target_": EXAMPLE_TARGET})) == []
    assert reproducer_problems(conf(call={"_target_": f"{HERE}.check_session_of_the_test", "n": 3})) == []
    assert reproducer_problems(conf(command=[sys.executable, str(EXAMPLE)])) == []
    assert reproducer_problems(conf(command=["python"])) == []  # a program on PATH
    assert reproducer_problems(StressConf()) == []  # another oracle, nothing of the reproducer's set


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({}, "needs exactly one of workload.call"),
        ({"call": {"_target_": EXAMPLE_TARGET}, "command": ["python"]}, "got both"),
        ({"call": "examples.reproducer.greedy_twice.check_session"}, "workload.call: 'examples"),
        ({"call": {"n": 1}}, "must be a mapping with a `_target_`"),
        ({"call": {"_target_": "no_such_module_here.fn"}}, "no module named 'no_such_module_here'"),
        ({"call": {"_target_": "examples.reproducer.greedy_twice.nothing"}}, "has no attribute 'nothing'"),
        ({"call": {"_target_": f"{HERE}.NOT_CALLABLE"}}, "is a int, not a callable"),
        ({"call": {"_target_": "os.getcwd"}}, "cannot be called as fn(url=..., session=..., settings=...)"),
        ({"call": {"_target_": EXAMPLE_TARGET, "retries": 3}}, "retries=..."),
        ({"call": {"_target_": EXAMPLE_TARGET, "url": "x"}}, "workload.call.url: the workload passes"),
        ({"command": []}, "workload.command: [] must be a non-empty list"),
        ({"command": "python x.py"}, "must be a non-empty list of non-empty strings"),
        ({"command": ["python", 3]}, "must be a non-empty list of non-empty strings"),
        ({"command": ["/no/such/program"]}, "workload.command[0]: '/no/such/program' is not an executable"),
    ],
)
def test_each_problem_names_the_key_and_what_is_accepted(fields, says):
    problems = reproducer_problems(conf(**fields))
    assert len(problems) == 1 and says in problems[0], problems
    assert problems[0].startswith(("workload.call", "workload.command", "workload=reproducer"))


def test_a_reproducer_given_to_another_oracle_is_named():
    problems = reproducer_problems(StressConf(command=["python"]))
    assert problems == [
        "workload.command: set, but workload.oracle is 'tool_calls'; only the reproducer oracle runs it "
        "(workload=reproducer)"
    ]


def test_settings_fill_from_the_workload_section_by_name(tmp_path):
    section = conf(sessions=7, seed=3, timeout_s=9.0, command=["python", "x.py"], concurrency=2)
    s = reproducer_settings(section, url="http://r", out_dir=tmp_path, model="m", seed=11, progress=False)
    assert (s.sessions, s.seed, s.timeout_s, s.command, s.workers, s.model) == (
        7, 11, 9.0, ("python", "x.py"), 2, "m"
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"needs exactly one of workload\.call"):
        reproducer_settings(conf(), url="u", out_dir=tmp_path)
    with pytest.raises(ValueError, match="sessions must be >= 1"):
        settings(tmp_path, sessions=0, command=("python",))


def test_the_record_names_the_reproducer_and_never_a_secret(tmp_path):
    argv = ("repro", "--api-key", "sk-1", "--token=abc", "HF_TOKEN=xyz", "--rounds", "3")
    assert redact_argv(argv) == ["repro", "--api-key", "***", "--token=***", "HF_TOKEN=***", "--rounds", "3"]
    call = {"_target_": "m.f", "api_key": "sk-1", "headers": {"Authorization": "Bearer x"}, "n": 2}
    assert redact_mapping(call) == {
        "_target_": "m.f",
        "api_key": "***",
        "headers": {"Authorization": "***"},
        "n": 2,
    }
    record = settings(tmp_path, call=call, sessions=4, concurrency=8).record()
    assert record["reproducer"] == {"call": redact_mapping(call)} and record["concurrency"] == 4
    assert record["count"] == ["reproducer"] and record["timeout_of"] == "each session"
    assert settings(tmp_path, command=argv).record()["reproducer"] == {"command": redact_argv(argv)}


class _Recorder:
    def log_stress(self, summary, out_dir) -> None:
        self.summary = summary


class _Alive:
    def dead_role(self) -> None:
        return None

    def check_alive(self, during: str) -> None:
        pass


def test_the_arm_fills_the_settings_from_its_workload_section_by_name(compose_cfg, monkeypatch, tmp_path):
    from orchestrator import arm
    from orchestrator.workload import reproducer
    from orchestrator.workload.results import StressSummary
    from tests.conftest import plan_of

    overrides = ("workload.sessions=7", "workload.concurrency=2", "workload.seed=5", "workload.timeout_s=33")
    plan = plan_of(
        compose_cfg(
            "workload=reproducer",
            f"+workload.call._target_={EXAMPLE_TARGET}",
            *overrides,
            "bench.enabled=false",
        )
    )
    seen = {}

    def run(settings, server_gone=None, on_outcome=None):
        seen.update(settings=settings, gone=server_gone())
        return StressSummary(7, 7, 0, 0, 7)

    monkeypatch.setattr(reproducer, "run_reproducer_sync", run)
    monkeypatch.setattr(arm, "decode_load_monitor", lambda plan: SimpleNamespace(stop=lambda: None))
    monkeypatch.setattr(arm, "log_decode_load", lambda tracker, load, out_dir: None)
    recorder = _Recorder()
    arm.StressThenBench(repetition=1).measure(plan, _Alive(), recorder, tmp_path)

    s = seen["settings"]
    fields = {f.name for f in dataclasses.fields(ReproducerSettings)}
    # what the arm gives; the rest is the workload section's, by name, or the settings' default
    assert fields - {f.name for f in dataclasses.fields(StressConf)} == {
        "url", "out_dir", "model", "progress", "watch_interval_s"
    }  # fmt: skip
    assert (s.sessions, s.concurrency, s.timeout_s, s.call, s.command) == (
        7,
        2,
        33.0,
        {"_target_": EXAMPLE_TARGET},
        None,
    )
    assert (s.url, s.model, s.out_dir, s.seed) == (
        plan.router_url,
        plan.served_model,
        tmp_path / "stress",
        5 + 7919,
    )
    assert seen["gone"] is None and recorder.summary.sessions == 7


def test_the_commands_environment_carries_the_protocols_variables(tmp_path):
    s = settings(tmp_path, url="http://r:1", sessions=12, concurrency=5, seed=7919, model="m", command=("x",))
    env = command_env(s, {"PATH": "/bin", "PYTHONUNBUFFERED": "0"})
    assert env == {
        "PATH": "/bin",
        "PYTHONUNBUFFERED": "0",  # the caller's own kept
        "HEISENHUNT_URL": "http://r:1",
        "HEISENHUNT_SESSIONS": "12",
        "HEISENHUNT_CONCURRENCY": "5",
        "HEISENHUNT_SEED": "7919",
        "HEISENHUNT_MODEL": "m",
    }
    assert command_env(s, {})["PYTHONUNBUFFERED"] == "1"


# --- the command, as a real subprocess -------------------------------------------------------------------


def test_a_command_runs_and_its_outcomes_are_written_as_the_stress_workloads(tmp_path):
    argv = script(
        tmp_path,
        """
        env = {k: v for k, v in os.environ.items() if k.startswith("HEISENHUNT_")}
        print("starting", file=sys.stderr)
        print(json.dumps({"session": "a", "outcome": "clean"}))
        print()
        print(json.dumps({"session": "b", "outcome": "corrupted", "detail": {"env": env}}))
        print(json.dumps({"session": "c", "outcome": "errored", "detail": "HTTP 503"}))
        """,
    )
    s = settings(tmp_path, sessions=3, concurrency=2, seed=5, model="m", command=argv)
    seen: list[str] = []
    summary = run_reproducer_sync(s, on_outcome=seen.append)

    out = s.out_dir
    assert (summary.sessions, summary.clean, summary.corrupted, summary.errored) == (3, 1, 1, 1)
    assert summary.by_detector == {"reproducer": 1} and summary.by_family == {"reproducer": 1}
    assert seen == ["clean", "corrupted", "errored"]
    written = [SessionOutcome.from_dict(d) for d in lines(out)]
    assert [o.session_id for o in written] == ["a", "b", "c"]
    assert [outcome_dict(o) for o in written] == lines(out)
    env = json.loads((out / "corrupted" / "b.json").read_text())["detail"]["env"]
    # the protocol's variables (the command inherits the rest of the environment: CI sets HEISENHUNT_* too)
    protocol = ("URL", "SESSIONS", "CONCURRENCY", "SEED", "MODEL")
    assert {k: v for k, v in env.items() if k.removeprefix("HEISENHUNT_") in protocol} == {
        "HEISENHUNT_URL": s.url,
        "HEISENHUNT_SESSIONS": "3",
        "HEISENHUNT_CONCURRENCY": "2",
        "HEISENHUNT_SEED": "5",
        "HEISENHUNT_MODEL": "m",
    }
    document = summary_json(out)
    assert (document["sessions"], document["planned"], document["partial"]) == (3, 3, False)
    assert document["by_error"] == {"reproducer": 1} and document["counted_families"] == ["reproducer"]
    assert document["settings"]["reproducer"] == {"command": list(argv)}
    assert (out / "reproducer.stderr").read_text() == "starting\n"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            print('{"session": "c", "outcome": "maybe"}')
            time.sleep(30)
            """,
            """reproducer line 3: {"session": "c", "outcome": "maybe"} is not valid: 'outcome' must be """
            "one of clean, corrupted, errored, not 'maybe'",
        ),
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            print("all good so far")
            """,
            "reproducer line 3: all good so far is not JSON",
        ),
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            print(json.dumps({"session": "a", "outcome": "corrupted"}))
            """,
            """reproducer line 3: {"session": "a", "outcome": "corrupted"} reports session 'a' again """
            "(first on line 1)",
        ),
        (
            """
            for s in "abcd":
                print(json.dumps({"session": s, "outcome": "clean"}))
            """,
            """reproducer line 4: {"session": "d", "outcome": "clean"} is one session more than the 3 """
            "planned",
        ),
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            print("Traceback: boom", file=sys.stderr)
            sys.exit(2)
            """,
            "reproducer exited with status 2 after 2 of 3 sessions; its stderr ends: Traceback: boom",
        ),
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            """,
            "reproducer printed 2 of 3 sessions and exited 0; its stderr is empty",
        ),
        (
            # killed as it wrote its third line: the signal is the news, not the line cut short
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            sys.stdout.write('{"session": "c", "outc')
            sys.stdout.flush()
            os.kill(os.getpid(), 9)
            """,
            "reproducer was killed by signal 9 (SIGKILL) after 2 of 3 sessions; its stderr is empty",
        ),
        (
            """
            print(json.dumps({"session": "a", "outcome": "clean"}))
            print(json.dumps({"session": "b", "outcome": "clean"}))
            sys.stdout.write('{"session": "c", "outc')
            """,
            """reproducer line 3: {"session": "c", "outc is not JSON""",
        ),
    ],
    ids=["bad line", "not json", "duplicate", "too many", "exit status", "too few", "torn", "torn, exit 0"],
)
def test_a_command_that_breaks_the_protocol_fails_naming_why_and_keeps_what_it_reported(tmp_path, body, says):
    s = settings(tmp_path, sessions=3, command=script(tmp_path, body), timeout_s=20.0)
    started = time.monotonic()
    with pytest.raises(ReproducerError) as caught:
        run_reproducer_sync(s)
    assert says in str(caught.value), caught.value
    assert time.monotonic() - started < 10  # a bad line stops it at once, not at its timeout
    # the sessions reported before it are kept, the summary partial
    assert [d["session_id"] for d in lines(s.out_dir)][:2] == ["a", "b"]
    document = summary_json(s.out_dir)
    assert document["planned"] == 3 and document["sessions"] in (2, 3)


def test_a_command_past_its_timeout_is_stopped_with_everything_it_started(tmp_path):
    pids = tmp_path / "pids"
    argv = script(
        tmp_path,
        f"""
        import subprocess
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        print(json.dumps({{"session": "a", "outcome": "clean"}}))
        print("working on b", file=sys.stderr)
        time.sleep(60)
        """,
    )
    s = settings(tmp_path, sessions=3, command=argv, timeout_s=1.5)
    with pytest.raises(ReproducerError) as caught:
        run_reproducer_sync(s)
    assert str(caught.value) == (
        "reproducer ran past its timeout of 1.5 s (workload.timeout_s) after 1 of 3 sessions; stopped; its "
        "stderr ends: working on b"
    )
    leader, child = map(int, pids.read_text().split())
    deadline = time.monotonic() + 5
    while (alive(leader) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(leader) and not alive(child)
    assert [d["session_id"] for d in lines(s.out_dir)] == ["a"]


def test_a_command_that_cannot_start_says_so(tmp_path):
    s = settings(tmp_path, command=(str(tmp_path / "missing"),))
    with pytest.raises(ReproducerError, match=r"reproducer could not start '.*missing'"):
        run_reproducer_sync(s)
    assert summary_json(s.out_dir)["sessions"] == 0


def test_a_dead_server_stops_the_command_and_leaves_a_partial_summary(tmp_path):
    argv = script(
        tmp_path,
        """
        print(json.dumps({"session": "a", "outcome": "clean"}))
        time.sleep(60)
        """,
    )
    s = settings(tmp_path, sessions=3, command=argv, watch_interval_s=0.2)
    polls = []

    def server_gone():
        polls.append(1)
        return "decode is no longer running" if (s.out_dir / "sessions.jsonl").read_text() else None

    started = time.monotonic()
    summary = run_reproducer_sync(s, server_gone=server_gone)
    assert time.monotonic() - started < 10
    assert (summary.sessions, summary.planned, summary.partial) == (1, 3, True)


def test_cancelling_a_command_run_writes_the_partial_outputs_and_kills_it(tmp_path):
    pid_file = tmp_path / "pid"
    argv = script(
        tmp_path,
        f"""
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        print(json.dumps({{"session": "a", "outcome": "corrupted", "detail": "differs"}}))
        time.sleep(60)
        """,
    )
    s = settings(tmp_path, sessions=3, command=argv)

    async def cancel_after_one_line() -> None:
        run = asyncio.ensure_future(run_reproducer(s))
        while not (s.out_dir / "sessions.jsonl").is_file() or not (s.out_dir / "sessions.jsonl").read_text():
            await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run

    asyncio.run(cancel_after_one_line())
    document = summary_json(s.out_dir)
    assert (document["sessions"], document["corrupted"], document["planned"], document["partial"]) == (
        1, 1, 3, True
    )  # fmt: skip
    assert not alive(int(pid_file.read_text()))


# --- the callable ----------------------------------------------------------------------------------------


def counted(url, session, settings, pause=0.05, log=None):
    """Clean, after `pause`; appends when it ran to the file `log` (a callable named by `_target_` is
    imported by its module's name, which may be another copy of this module than pytest's)."""
    started = time.monotonic()
    time.sleep(pause)
    if log:
        with open(log, "a") as f:
            f.write(f"{started} {time.monotonic()}\n")
    return {"outcome": "clean", "detail": {"url": url, "seed": settings.seed}}


def most_at_once(log: Path) -> int:
    """The most intervals of `log` that overlap at one moment."""
    edges = sorted(
        (float(t), step)
        for line in log.read_text().splitlines()
        for t, step in zip(line.split(), (1, -1), strict=True)
    )
    now = most = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def judged_by_index(url, session, settings):
    """Each outcome in turn by the session's index; the fourth raises, the fifth hangs."""
    index = int(session.rsplit("-", 1)[1])
    if index == 3:
        raise ConnectionResetError("reset by peer")
    if index == 4:
        time.sleep(30)
    return ("clean", "corrupted", "errored")[index % 3]


async def async_judge(url, session, settings, verdict="corrupted"):
    await asyncio.sleep(0.01)
    return {"outcome": verdict, "detail": f"{session} seen"}


def returns_garbage(url, session, settings):
    return 42 if session.endswith("00002") else "clean"


def test_a_callable_is_called_per_session_at_the_planned_concurrency(tmp_path):
    call = {"_target_": f"{HERE}.counted", "pause": 0.2, "log": str(tmp_path / "log")}
    s = settings(tmp_path, sessions=8, concurrency=3, seed=4, call=call)
    summary = run_reproducer_sync(s)
    assert (summary.sessions, summary.clean) == (8, 8)
    assert most_at_once(tmp_path / "log") == 3
    assert sorted(d["session_id"] for d in lines(s.out_dir)) == [f"s4-{i:05d}" for i in range(8)]
    assert all(len(d["turn_latency_s"]) == 1 and d["turn_latency_s"][0] >= 0.2 for d in lines(s.out_dir))
    assert summary_json(s.out_dir)["settings"]["reproducer"] == {"call": call}


def test_a_callables_exception_or_timeout_is_that_session_errored_not_the_runs(tmp_path):
    s = settings(
        tmp_path, sessions=6, concurrency=6, call={"_target_": f"{HERE}.judged_by_index"}, timeout_s=1.0
    )
    started = time.monotonic()
    summary = run_reproducer_sync(s)
    assert time.monotonic() - started < 10  # the hung session was left behind at its timeout
    by_id = {d["session_id"]: d for d in lines(s.out_dir)}
    assert [by_id[f"s0-{i:05d}"]["status"] for i in range(6)] == [
        "clean", "corrupted", "errored", "errored", "errored", "errored"
    ]  # fmt: skip
    assert by_id["s0-00003"]["error"] == "reproducer: ConnectionResetError('reset by peer')"
    assert by_id["s0-00004"]["error"] == "reproducer: ran past its timeout of 1 s (workload.timeout_s)"
    assert by_id["s0-00001"]["bad_turn"]["detector"] == "reproducer"
    assert by_id["s0-00002"]["error"] == "reproducer: errored (no detail)"
    assert (summary.clean, summary.corrupted, summary.errored) == (1, 1, 4)


def test_an_async_callable_is_awaited_with_its_keyword_arguments(tmp_path):
    s = settings(tmp_path, sessions=3, call={"_target_": f"{HERE}.async_judge", "verdict": "errored"})
    summary = run_reproducer_sync(s)
    assert summary.errored == 3
    assert {d["error"] for d in lines(s.out_dir)} == {f"reproducer: s0-{i:05d} seen" for i in range(3)}


def test_a_callables_invalid_return_fails_the_run_naming_the_session(tmp_path):
    s = settings(tmp_path, sessions=4, concurrency=1, call={"_target_": f"{HERE}.returns_garbage"})
    with pytest.raises(ReproducerError) as caught:
        run_reproducer_sync(s)
    assert str(caught.value).startswith(
        "reproducer call for session s0-00002 returned 42, not a valid outcome"
    )
    assert [d["session_id"] for d in lines(s.out_dir)] == ["s0-00000", "s0-00001"]
    assert summary_json(s.out_dir)["partial"] is True


def test_a_dead_server_ends_the_callables_sessions_in_flight_as_errored(tmp_path):
    s = settings(
        tmp_path,
        sessions=6,
        concurrency=2,
        call={"_target_": f"{HERE}.counted", "pause": 30},
        watch_interval_s=0.2,
    )
    summary = run_reproducer_sync(s, server_gone=lambda: "router is no longer running")
    assert (summary.sessions, summary.errored, summary.planned) == (2, 2, 6)
    assert {d["error"] for d in lines(s.out_dir)} == {"server_gone: router is no longer running"}


# --- the example, against the simulated server -----------------------------------------------------------


def test_the_example_as_a_callable_and_as_a_command_judges_every_session(sim_server, tmp_path):
    as_call = settings(
        tmp_path / "call",
        url=sim_server.url,
        sessions=6,
        concurrency=3,
        model="m",
        call={"_target_": EXAMPLE_TARGET},
    )
    as_command = settings(
        tmp_path / "command",
        url=sim_server.url,
        sessions=6,
        concurrency=3,
        model="m",
        command=(sys.executable, str(EXAMPLE)),
    )
    for s in (as_call, as_command):
        summary = run_reproducer_sync(s)
        # a healthy server answers (no errored) and every session is judged; clean or not is the server's
        assert (summary.sessions, summary.errored, summary.clean + summary.corrupted) == (6, 0, 6), lines(
            s.out_dir
        )
        assert sorted(d["session_id"] for d in lines(s.out_dir)) == [f"s0-{i:05d}" for i in range(6)]


def test_the_example_calls_a_session_errored_when_the_server_is_not_there(unused_port):
    result = __import__("examples.reproducer.greedy_twice", fromlist=["check_session"]).check_session(
        f"http://127.0.0.1:{unused_port}", "s0-00000", SimpleNamespace(model="m", timeout_s=5)
    )
    assert result["outcome"] == "errored" and "Connection refused" in result["detail"]
