"""What a study shows on the terminal: its progress while it runs, its verdict at the end, and what was
kept when it stops early. The raw logs go to the log files, not the terminal.

- While the sweep runs: on a terminal, a live display (rich) of the arms done of planned, each running
  arm with its phase (start-up, stress, bench, teardown) and sessions, the sessions so far with their
  corruption count, and the time left; above it, one line per arm finished. Not on a terminal (CI, a
  pipe): only the line per arm finished, plain text, no control codes. The display reads the arms'
  progress files (`run/progress.py`), so it follows arms run in other processes too (the Ray launcher).
- At the end: the report's headline, the hypotheses table and the report's path, on stdout.
- A study that fails or is interrupted: what was kept and how to resume (`kept_lines`), on stderr.
- The logs: each job's in `<job dir>/__main__.log`, the sweep's own (the sweeper, the study callback,
  the launcher) in `<sweep dir>/multirun.log` (conf/hydra/job_logging and hydra_logging, `heisenhunt`).
  The terminal gets warnings and errors (stderr) and the few records marked for it (`TERMINAL`: a
  sequential study's rounds). `HEISENHUNT_VERBOSE=1` brings every log record back to the terminal.

The lines shown are pure functions of the state (`progress_lines`, `finished_line`, `verdict_lines`,
`kept_lines`); `SweepDisplay` is the edge that polls the files and writes.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from orchestrator.run.progress import ArmProgress, progress_dir, read_progress

if TYPE_CHECKING:
    from orchestrator.analysis.result import StudyResult

VERBOSE_ENV = "HEISENHUNT_VERBOSE"
DRIVER_LOG = "multirun.log"


def verbose(environ: Any = os.environ) -> bool:
    """Whether the raw logs go to the terminal too (HEISENHUNT_VERBOSE=1)."""
    return environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


# --- logging: named in conf/hydra/{job,hydra}_logging/heisenhunt.yaml ----------------------------------


class TerminalInfo(logging.Filter):
    """The terminal's share of the records under WARNING (those at WARNING and above have a handler of
    their own, on stderr): the ones marked `TERMINAL`, or all of them with HEISENHUNT_VERBOSE=1."""

    def __init__(self) -> None:
        super().__init__()
        self.verbose = verbose()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING and (self.verbose or bool(getattr(record, "terminal", False)))


class TerminalFormatter(logging.Formatter):
    """A record on the terminal: its message alone, or, with HEISENHUNT_VERBOSE=1, as the log files
    have it (time, logger, level)."""

    def __init__(self, fmt: str = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s") -> None:
        super().__init__(fmt if verbose() else "%(message)s")


_HELD: dict[str, list[str]] = {}  # a driver log's records from before its folder existed


class SweepLogFile(logging.Handler):
    """The sweep's own log, `<sweep dir>/multirun.log`: written once the sweep dir exists (Hydra makes
    it as the sweep starts), with the records from before then held till that moment (or the exit).
    Opened per record: the driver logs a few dozen."""

    def __init__(self, filename: str) -> None:
        super().__init__()
        self.path = Path(filename)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            held = _HELD.setdefault(str(self.path), [])
            held.append(self.format(record) + "\n")
            del held[:-10000]  # bounded, should the dir never come
            self.flush()
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        """Write the records held, if the sweep dir exists now (also at exit: logging.shutdown)."""
        held = _HELD.get(str(self.path))
        if held and self.path.parent.is_dir():
            with self.path.open("a") as f:
                f.writelines(held)
            held.clear()


# --- progress: pure ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepView:
    """What the display knows of a sweep: its jobs planned so far and every job's progress."""

    study: str
    planned: int  # the jobs of the rounds accepted so far
    started: float  # time.time() when the sweep was accepted
    arms: tuple[ArmProgress, ...] = ()
    more_rounds: bool = False  # an adaptive design: later rounds may plan more
    tracking_uri: str = ""
    report_dir: str = ""
    sweep_dir: str = ""
    gpus: int = 0  # the GPUs an arm's deployment holds (analysis/cost.py): the display's GPU time

    @property
    def done(self) -> list[ArmProgress]:
        return [a for a in self.arms if a.done]

    @property
    def running(self) -> list[ArmProgress]:
        return [a for a in self.arms if not a.done]


def clock(seconds: float) -> str:
    """0:42, 12:05, 1:02:03."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _planned(view: SweepView) -> str:
    return f"{view.planned}{'+' if view.more_rounds else ''}"


def _arm(arm: ArmProgress, view: SweepView) -> str:
    return f"arm {arm.job + 1}/{_planned(view)} {arm.label} #{arm.repetition}"


def _sessions(arm: ArmProgress) -> str:
    return f"{arm.sessions_done}/{arm.sessions_planned} sessions, {arm.corrupted} corrupted"


def time_left(view: SweepView, now: float) -> float | None:
    """Seconds until the planned jobs are done, from the mean time of the arms that ran (None before the
    first one ends); the running arms share the work (Ray runs several at once)."""
    measured = [a.updated - a.started for a in view.done if a.status != "SKIPPED"]
    if not measured:
        return None
    per_arm = sum(measured) / len(measured)
    to_run = max(0, view.planned - len(view.done))
    under_way = sum(min(now - a.started, per_arm) for a in view.running)
    return max(0.0, to_run * per_arm - under_way) / max(1, len(view.running))


def gpu_hours_held(view: SweepView, now: float) -> float:
    """GPU hours the sweep's arms have held so far: every arm's time from its start, a running one's to
    now, times the deployment's GPUs."""
    held = sum((a.updated if a.done else now) - a.started for a in view.arms if a.status != "SKIPPED")
    return view.gpus * max(0.0, held) / 3600


def gpu_hours_left(view: SweepView, now: float) -> float | None:
    """GPU hours the planned arms still need, at the mean time of the arms that ran (None before the first
    ends): unlike the wall time left, it does not shrink with more clusters."""
    left = time_left(view, now)
    return None if left is None else view.gpus * left * max(1, len(view.running)) / 3600


def progress_lines(view: SweepView, now: float) -> list[str]:
    """The live display: the sweep's line, one per running arm, the sessions so far."""
    left = time_left(view, now)
    estimate = f"about {clock(left)} left" if left is not None else "time left known after the first arm"
    if view.more_rounds:
        estimate += " (this round)"
    lines = [
        f"study {view.study}: {len(view.done)}/{_planned(view)} arms done, "
        f"{clock(now - view.started)} elapsed, {estimate}"
    ]
    for arm in view.running:
        counts = f" {_sessions(arm)}" if arm.phase not in ("start-up", "reference") else ""
        lines.append(f"  {_arm(arm, view)}: {arm.phase}{counts} ({clock(now - arm.started)})")
    if not view.running and len(view.done) < view.planned:
        lines.append("  the next arm is starting")
    sessions = sum(a.sessions_done for a in view.arms)
    corrupted = sum(a.corrupted for a in view.arms)
    gpu = ""
    if view.gpus:
        left = gpu_hours_left(view, now)
        gpu = f"; GPU time {gpu_hours_held(view, now):.2f} h on {view.gpus} GPU(s)" + (
            f", about {left:.2f} h more{' this round' if view.more_rounds else ''}"
            if left is not None
            else ""
        )
    lines.append(f"  sessions so far {sessions}, corrupted {corrupted}{gpu}")
    return lines


def finished_line(arm: ArmProgress, view: SweepView) -> str:
    """One line per arm done: how it ended, its sessions and time, and why it failed."""
    if arm.status == "SKIPPED":
        return f"{_arm(arm, view)}: SKIPPED (already FINISHED: resume)"
    took = clock(arm.updated - arm.started)
    sessions = f", {_sessions(arm)}" if arm.sessions_planned else ""
    why = f": {arm.reason}" if arm.reason else ""
    return f"{_arm(arm, view)}: {arm.status}{sessions} ({took}){why}"


def started_line(view: SweepView) -> str:
    rounds = " (more rounds as the evidence asks)" if view.more_rounds else ""
    where = f"; logs in {view.sweep_dir}" if view.sweep_dir else ""
    return f"study {view.study}: {view.planned} arm runs{rounds}{where} ({VERBOSE_ENV}=1 shows them here)"


# --- the end: pure ------------------------------------------------------------------------------------


def verdict_lines(result: StudyResult, report: Path, ui_hint: str = "") -> list[str]:
    """The report's headline, its hypotheses table (as report.md has them) and where the report is."""
    from orchestrator.report.render import hypotheses_section, minimal_cause_section, title_section

    table = hypotheses_section(result) or minimal_cause_section(result.minimal_cause)
    lines = [title_section(result)[0].removeprefix("# "), "", *table]
    if lines[-1]:
        lines.append("")
    return [*lines, *([ui_hint] if ui_hint else []), f"report: {report}"]


def rebuild_command(view: SweepView) -> str:
    """The command that writes the report of the runs a sweep kept."""
    return shlex.join(
        ["python", "-m", "orchestrator.report", "--tracking-uri", view.tracking_uri, "--study", view.study]
        + (["--out", view.report_dir] if view.report_dir else [])
    )


def kept_lines(view: SweepView, report_written: bool = False) -> list[str]:
    """After a study failed or was interrupted: what was kept, where its report is, how to resume."""
    finished = sum(a.status in ("FINISHED", "SKIPPED") for a in view.done)
    other = {}
    for a in view.done:
        if a.status not in ("FINISHED", "SKIPPED"):
            other[a.status] = other.get(a.status, 0) + 1
    others = "".join(f", {n} {status}" for status, n in sorted(other.items()))
    report = (
        f"the report of the runs kept is in {view.report_dir}/{view.study}/report.md"
        if report_written
        else f"no report was written; `{rebuild_command(view)}` writes one from the runs kept"
    )
    return [
        f"heisenhunt: kept {finished} of {_planned(view)} arm runs FINISHED{others}, in MLflow "
        f"{view.tracking_uri} (study {view.study}); {report}",
        "heisenhunt: to resume, run the same command with resume=true (the FINISHED arm runs are skipped)",
    ]


# --- the edge ----------------------------------------------------------------------------------------


@dataclass
class SweepDisplay:
    """Polls the sweep's progress files and shows them: a live display on a terminal, a plain line per
    arm finished elsewhere. `stop` is safe to call at any point, and more than once."""

    view: SweepView
    out: TextIO = field(default_factory=lambda: sys.stdout)
    interactive: bool = False
    poll_s: float = 0.5
    shown: set[int] = field(default_factory=set)  # jobs whose finished line was printed
    _live: Any = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> SweepDisplay:
        # a sweep run again into the same sweep dir (a fixed hydra.sweep.dir) starts from no progress
        for stale in progress_dir(self.view.sweep_dir).glob("*.json"):
            stale.unlink(missing_ok=True)
        self._print(started_line(self.view))
        if self.interactive:
            from rich.console import Console
            from rich.live import Live

            # transient: the live part goes when it stops; the lines printed above it stay
            self._live = Live(console=Console(file=self.out), auto_refresh=False, transient=True)
            self._live.start()
        self._thread = threading.Thread(target=self._run, name="heisenhunt-progress", daemon=True)
        self._thread.start()
        return self

    def plan_more(self, jobs: int, more_rounds: bool) -> None:
        with self._lock:
            self.view = replace(self.view, planned=self.view.planned + jobs, more_rounds=more_rounds)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> None:
        """Read the progress files; print the arms newly finished; redraw the live part."""
        with self._lock:
            arms = tuple(read_progress(progress_dir(self.view.sweep_dir)))
            self.view = replace(self.view, arms=arms)
            for arm in self.view.done:
                if arm.job not in self.shown:
                    self.shown.add(arm.job)
                    self._print(finished_line(arm, self.view))
            if self._live is not None:
                from rich.text import Text

                self._live.update(Text("\n".join(progress_lines(self.view, time.time()))), refresh=True)

    def _print(self, line: str) -> None:
        if self._live is not None:
            self._live.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            print(line, file=self.out, flush=True)

    def stop(self) -> SweepView:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            self.poll()
        finally:
            with self._lock:
                live, self._live = self._live, None
            if live is not None:
                live.stop()  # restores the terminal: cursor shown, the live part cleared
        return self.view


_CURRENT: list[SweepDisplay] = []  # this process's sweep
_ENDED: list[SweepView] = []  # a sweep whose display stopped (the verdict, or what was kept, comes next)


def sweep_accepted(
    study: str,
    sweep_dir: str,
    jobs: int,
    more_rounds: bool,
    tracking_uri: str,
    report_dir: str,
    gpus: int = 0,
) -> None:
    """The sweeper accepted a round of `jobs`: the first starts the display, later ones add to it."""
    if _CURRENT:
        _CURRENT[-1].plan_more(jobs, more_rounds)
        return
    view = SweepView(
        study=study,
        planned=jobs,
        started=time.time(),
        more_rounds=more_rounds,
        tracking_uri=tracking_uri,
        report_dir=report_dir,
        sweep_dir=sweep_dir,
        gpus=gpus,
    )
    _CURRENT.append(SweepDisplay(view, interactive=sys.stdout.isatty()).start())
    _ENDED.clear()


def stop_display() -> SweepView | None:
    """Stop the sweep's display (the terminal restored); its last view, or None without a sweep."""
    if not _CURRENT:
        return _ENDED[-1] if _ENDED else None
    view = _CURRENT.pop().stop()
    _ENDED[:] = [view]
    return view


def sweep_ended() -> None:
    """The study ended and said so (its verdict): nothing is left to say on the way out."""
    stop_display()
    _ENDED.clear()


def show_verdict(result: StudyResult, report: Path, ui_hint: str = "") -> None:
    stop_display()
    print("\n".join(verdict_lines(result, report, ui_hint)), flush=True)
    sweep_ended()


def show_kept(out: TextIO | None = None, report_written: bool = False) -> None:
    """What a study that stopped early kept, and how to resume (nothing without a sweep under way)."""
    view = stop_display()
    if view is not None:
        print("\n".join(kept_lines(view, report_written)), file=out or sys.stderr, flush=True)
    _ENDED.clear()
