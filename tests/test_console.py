"""The terminal of a study (orchestrator/report/console.py, run/progress.py): the lines shown as pure
functions of the progress, and real studies watched on a pseudo-terminal and through a pipe."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import re
import sys
from pathlib import Path

import pytest

from orchestrator.report import console
from orchestrator.report.console import (
    SweepDisplay,
    SweepView,
    TerminalInfo,
    finished_line,
    kept_lines,
    progress_lines,
    time_left,
    verdict_lines,
)
from orchestrator.run.progress import TERMINAL, ArmProgress, ProgressFile, progress_dir, read_progress
from tests import warm
from tests.conftest import local_cluster_overrides, seed_mlflow_store
from tests.shared_runs import DEFAULT_RUN
from tests.test_report import TYPED

T0 = 1_000_000.0


def arm(job: int, **kw) -> ArmProgress:
    base = dict(job=job, label="baseline" if job % 2 == 0 else "multi_stream=off", repetition=job // 2)
    return ArmProgress(**{**base, "started": T0 + 60 * job, "updated": T0 + 60 * job, **kw})


def view(*arms: ArmProgress, planned: int = 6, **kw) -> SweepView:
    return SweepView(study="quick", planned=planned, started=T0, arms=arms, **kw)


# --- pure ---------------------------------------------------------------------------------------------


def test_the_display_shows_arms_done_the_running_arm_its_phase_sessions_and_time_left():
    first = arm(0, phase="done", status="FINISHED", sessions_done=80, sessions_planned=80, corrupted=12)
    first = dataclasses.replace(first, updated=T0 + 50)
    running = arm(1, phase="stress", sessions_done=30, sessions_planned=80, corrupted=1)
    lines = progress_lines(view(first, running), now=T0 + 80)
    assert lines[0] == "study quick: 1/6 arms done, 1:20 elapsed, about 3:50 left"  # 5 x 50 s - 20 s
    assert lines[1] == "  arm 2/6 multi_stream=off #0: stress 30/80 sessions, 1 corrupted (0:20)"
    assert lines[2] == "  sessions so far 110, corrupted 13"


def test_before_the_first_arm_ends_the_time_left_is_not_guessed():
    lines = progress_lines(view(arm(0)), now=T0 + 5)
    assert lines[0].endswith("time left known after the first arm")
    assert lines[1] == "  arm 1/6 baseline #0: start-up (0:05)"  # no session counts before the stress


def test_time_left_counts_the_arm_under_way_and_shares_the_work_of_arms_run_at_once():
    done = dataclasses.replace(arm(0, phase="done", status="FINISHED"), updated=T0 + 100)
    assert time_left(view(done, planned=3), now=T0 + 100) == 200
    # two at once (the Ray launcher), each 50 s in: (5 to run x 100 - 2 x 50) / 2
    a, b = arm(1, started=T0 + 100), arm(2, started=T0 + 100)
    assert time_left(view(done, a, b), now=T0 + 150) == 200
    # skipped arms (resume) took no time: they estimate nothing
    skipped = dataclasses.replace(arm(0, phase="done", status="SKIPPED"), updated=T0 + 1)
    assert time_left(view(skipped), now=T0 + 2) is None


def test_an_adaptive_study_says_more_rounds_may_follow():
    lines = progress_lines(view(arm(0), planned=5, more_rounds=True), now=T0 + 1)
    assert lines[0].startswith("study quick: 0/5+ arms done") and lines[0].endswith("(this round)")


def test_one_line_per_arm_finished_says_how_it_ended_and_why():
    ok = arm(2, phase="done", status="FINISHED", sessions_done=80, sessions_planned=80, corrupted=3)
    ok = dataclasses.replace(ok, updated=ok.started + 75)
    assert finished_line(ok, view()) == "arm 3/6 baseline #1: FINISHED, 80/80 sessions, 3 corrupted (1:15)"
    failed = arm(1, phase="done", status="FAILED", reason="decode: exited with code 1")
    assert finished_line(failed, view()) == (
        "arm 2/6 multi_stream=off #0: FAILED (0:00): decode: exited with code 1"
    )
    skipped = arm(0, phase="done", status="SKIPPED")
    assert finished_line(skipped, view()) == "arm 1/6 baseline #0: SKIPPED (already FINISHED: resume)"


def test_the_verdict_is_the_reports_headline_its_hypotheses_table_and_its_path():
    from orchestrator.report.render import hypotheses_section

    lines = verdict_lines(TYPED, Path("reports/tiny/report.md"), "arms in the MLflow UI: ...")
    assert lines[0] == "tiny: Implicated: H-ms (ms=off); baseline corruption 27/180 (15.0%)."
    table = hypotheses_section(TYPED)
    assert lines[2 : 2 + len(table)] == table  # the report's own rows, not a table of its own
    assert lines[-2:] == ["arms in the MLflow UI: ...", "report: reports/tiny/report.md"]


def test_a_study_stopped_early_says_what_was_kept_and_how_to_resume():
    arms = (
        arm(0, phase="done", status="FINISHED"),
        arm(1, phase="done", status="FINISHED"),
        arm(2, phase="done", status="KILLED"),
    )
    v = view(*arms, tracking_uri="sqlite:///m.db", report_dir="reports")
    kept, resume = kept_lines(v)
    assert kept.startswith("heisenhunt: kept 2 of 6 arm runs FINISHED, 1 KILLED, in MLflow sqlite:///m.db")
    assert "python -m orchestrator.report --tracking-uri sqlite:///m.db --study quick --out reports" in kept
    assert "resume=true" in resume


# --- the edges: files, logging ------------------------------------------------------------------------


def test_the_progress_file_is_replaced_whole_and_read_back(tmp_path):
    folder = progress_dir(tmp_path)
    sink = ProgressFile(folder / "3.json", 3, "baseline", 1)
    sink.phase("stress")
    sink.sessions_planned(4)
    for status in ("clean", "corrupted", "clean"):
        sink.session(status)
    sink.phase("bench")  # a phase is written at once (and with it the counts held back)
    [back] = read_progress(folder)
    assert (back.job, back.phase, back.sessions_done, back.corrupted) == (3, "bench", 3, 1)
    sink.finish("FAILED", "decode died\nthe traceback")
    [back] = read_progress(folder)
    assert back.done and back.status == "FAILED" and back.reason == "decode died"
    assert [p.name for p in folder.iterdir()] == ["3.json"]  # no temp file left
    (folder / "4.json").write_text("{half")  # a file caught mid-write elsewhere is skipped
    assert [p.job for p in read_progress(folder)] == [3]


def test_a_display_off_a_terminal_prints_one_plain_line_per_arm_finished(tmp_path):
    out = io.StringIO()
    stale = ProgressFile(progress_dir(tmp_path) / "1.json", 1, "multi_stream=off", 0)
    stale.finish("FINISHED")  # an earlier sweep's, in the same sweep dir: not this one's
    display = SweepDisplay(view(sweep_dir=str(tmp_path)), out=out, poll_s=60).start()
    sink = ProgressFile(progress_dir(tmp_path) / "0.json", 0, "baseline", 0)
    display.poll()
    sink.finish("FINISHED")
    display.poll()
    display.poll()  # printed once
    display.stop()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("study quick: 6 arm runs")
    assert lines[1:] == ["arm 1/6 baseline #0: FINISHED (0:00)"]
    assert "\x1b" not in out.getvalue()


def test_the_terminal_gets_info_only_when_marked_or_verbose(monkeypatch):
    def shown(**extra) -> bool:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
        record.__dict__.update(extra)
        return TerminalInfo().filter(record)

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    assert not shown() and shown(**TERMINAL)
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert shown()
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    assert not shown()


def test_the_sweep_log_holds_records_until_its_folder_exists(tmp_path):
    handler = console.SweepLogFile(str(tmp_path / "sweep" / "multirun.log"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "before", None, None))
    assert not (tmp_path / "sweep").exists()
    (tmp_path / "sweep").mkdir()
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "after", None, None))
    assert (tmp_path / "sweep" / "multirun.log").read_text() == "before\nafter\n"


# --- real studies --------------------------------------------------------------------------------------

SHORT = [
    "workload.sessions=8",
    "workload.rounds=2",
    "bench.concurrency=[1,4]",
    "bench.requests_per_worker=2",
    "bench.output_len=16",
    "bench.input_len=64",
]
ANSI = "\x1b["


def study_argv(tmp_path: Path, *overrides: str) -> list[str]:
    """`python -m orchestrator` as a user types it (the default study: 2 arms x 3 repetitions), short
    (`overrides` replace SHORT's)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    short = [o for o in SHORT if o.split("=", 1)[0] not in keys]
    return [
        sys.executable, "-m", "orchestrator", *local_cluster_overrides(tmp_path),
        f"tracking.uri={seed_mlflow_store(tmp_path / 'mlflow.db')}", f"report.dir={tmp_path}/reports",
        f"hydra.sweep.dir={tmp_path}/multirun", *short, *overrides,
    ]  # fmt: skip


def quiet_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != console.VERBOSE_ENV}


def assert_ends_with_the_verdict(lines: list[str], tmp_path: Path) -> None:
    report = tmp_path / "reports" / "quick" / "report.md"
    md = report.read_text().splitlines()
    assert lines[-1] == f"report: {report}"
    headline = md[0].removeprefix("# ")
    at = next(i for i, line in enumerate(lines) if line.endswith(headline))
    table = [line for line in md if line.startswith("| H-multistream")]
    assert table and table[0] in lines[at:], lines[at:]


@pytest.mark.slow
@pytest.mark.xdist_group(DEFAULT_RUN)
def test_a_piped_study_prints_a_few_plain_lines_and_ends_with_the_verdict(default_run):
    # the default run, its stdout and stderr one pipe (tests/shared_runs.py; test_dsv4_study.py judges its
    # study and report): a pipe is what tests read a study through
    tmp_path, out = default_run.root, default_run.out
    assert default_run.returncode == 0, out[-4000:]
    assert ANSI not in out
    lines = out.splitlines()
    assert len(lines) <= 30, out
    assert sum(line.startswith("arm ") and ": FINISHED" in line for line in lines) == 6, out
    assert_ends_with_the_verdict(lines, tmp_path)
    # the logs went to the log files
    logs = (tmp_path / "multirun" / "multirun.log").read_text()
    assert "Launching 6 jobs locally" in logs and "report: " in logs
    assert "stress: " in (tmp_path / "multirun" / "0" / "__main__.log").read_text()


@pytest.mark.slow
def test_a_study_on_a_terminal_shows_its_progress_live_and_ends_with_the_verdict(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    # one start of each arm: what the display shows of an arm, and the estimate once one has ended, need
    # no more (each start is ~2 CPU-s of co-restart and checks, on a 2-core CI machine)
    argv = study_argv(tmp_path, "hydra.sweeper.default_params.repetition=0")
    child = pexpect.spawn(
        argv[0], argv[1:], cwd=str(tmp_path), env=quiet_env(), encoding="utf-8", timeout=300,
        dimensions=(40, 200),
    )  # fmt: skip
    try:
        # mid-run: the first arm, its phase, its sessions
        child.expect(r"arm 1/2 baseline #0: start-up")
        child.expect(r"arm 1/2 baseline #0: stress \d+/8 sessions, \d+ corrupted")
        child.expect(r"sessions so far \d+, corrupted \d+")
        child.expect(r"arm 1/2 baseline #0: FINISHED, 8/8 sessions")
        child.expect(r"about \d+:\d\d left")  # an estimate, once an arm has ended
        child.expect(r"arm 2/2 ")
        child.expect(pexpect.EOF, timeout=300)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before[-3000:]
    # the screen ends with the verdict: the live part cleared (its erased text is left in the stream,
    # before the verdict's first line), plain lines after it
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\r", "", child.before)
    lines = [line for line in plain.splitlines() if line.strip()]
    assert_ends_with_the_verdict(lines, tmp_path)


@pytest.mark.slow
def test_ctrl_c_on_a_terminal_stops_the_live_display_cleanly_and_says_what_was_kept(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    argv = study_argv(tmp_path, "workload.sessions=200", "workload.concurrency=2", "bench.enabled=false")
    child = pexpect.spawn(
        argv[0], argv[1:], cwd=str(tmp_path), env=quiet_env(), encoding="utf-8", timeout=300,
        dimensions=(40, 200),
    )  # fmt: skip
    child.logfile_read = transcript = io.StringIO()
    try:
        child.expect(r"arm 1/6 baseline #0: stress [1-9]\d*/200 sessions")
        child.sendintr()  # Ctrl-C, as a terminal sends it: to the whole foreground process group
        child.expect(pexpect.EOF, timeout=120)
    finally:
        child.close(force=True)
    out = transcript.getvalue()
    assert child.exitstatus == 130, out[-3000:]
    assert "heisenhunt: signal 2: stopped arm baseline #0" in out and "Traceback" not in out
    assert "heisenhunt: kept 0 of 6 arm runs FINISHED, 1 KILLED" in out
    assert "to resume, run the same command with resume=true" in out
    # the live display was stopped before those lines: the cursor it hid is shown again, nothing redrawn
    stopped = out.rindex("\x1b[?25h")
    assert out.rindex("\x1b[?25l") < stopped < out.index("heisenhunt: signal 2")


def test_the_verbose_flag_brings_the_logs_back_to_the_terminal(tmp_path):
    """A dry run (nothing started) logs the default sweep it chose: to the sweep's log file, and to the
    terminal only with HEISENHUNT_VERBOSE=1."""

    def dry_run(env: dict[str, str]) -> str:
        argv = [*study_argv(tmp_path), "dry_run=true"]
        proc = warm.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout + proc.stderr

    chosen = "no sweep given: running the default study sweep"
    quiet = dry_run(quiet_env())
    assert chosen not in quiet and "2 arm(s), 6 job(s)" in quiet
    assert chosen in (tmp_path / "multirun" / "multirun.log").read_text()
    assert chosen in dry_run({**quiet_env(), console.VERBOSE_ENV: "1"})
