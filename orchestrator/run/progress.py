"""Where a running arm stands, for the terminal: the arm writes its phase and session counts to a small JSON
file under the sweep dir, `<sweep_dir>/.heisenhunt/progress/<job>.json`, replaced atomically at every
change (session counts at most every `ProgressFile.min_interval_s`); the driver's display
(`report/console.py`) reads the folder. A file rather than a callback: under the Ray launcher the arm runs
in another process, and the display still sees it.

    start-up -> stress -> bench -> teardown -> done (with the arm's status: FINISHED, FAILED, KILLED,
    REFUSED, SKIPPED)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

TERMINAL = {"terminal": True}  # `log.info(..., extra=TERMINAL)`: shown on the terminal, not only logged

# "reference": the divergence oracle's batch-1 reference pass, before the sessions under load
PHASES = ("start-up", "reference", "stress", "bench", "teardown", "done")


@dataclass(frozen=True)
class ArmProgress:
    """One job's progress, as its file holds it."""

    job: int  # Hydra's job number in the sweep (0-based, across rounds)
    label: str
    repetition: int
    phase: str = "start-up"
    sessions_done: int = 0
    sessions_planned: int = 0
    corrupted: int = 0
    status: str | None = None  # set when phase is "done"
    reason: str = ""  # why a FAILED or REFUSED arm ended so
    started: float = 0.0  # wall-clock seconds (time.time()), comparable across processes
    updated: float = 0.0

    @property
    def done(self) -> bool:
        return self.phase == "done"


def progress_dir(sweep_dir: str | Path) -> Path:
    """The folder of a sweep's progress files."""
    return Path(sweep_dir) / ".heisenhunt" / "progress"


def read_progress(folder: Path) -> list[ArmProgress]:
    """Every job's progress in `folder`, by job number; a file being replaced or unreadable is left out
    (the next read sees it)."""
    found = []
    names = {f.name for f in dataclasses.fields(ArmProgress)}
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            document = json.loads(path.read_text())
            found.append(ArmProgress(**{k: v for k, v in document.items() if k in names}))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda p: p.job)


class ProgressSink(Protocol):
    """What the arm reports through (a `ProgressFile`, or `NO_PROGRESS` outside a sweep)."""

    def phase(self, name: str) -> None: ...
    def sessions_planned(self, planned: int) -> None: ...
    def session(self, status: str) -> None: ...
    def finish(self, status: str, reason: str = "") -> None: ...


class NoProgress:
    """Reports nowhere: a single run, or a test calling `run_arm` directly."""

    def phase(self, name: str) -> None:
        pass

    def sessions_planned(self, planned: int) -> None:
        pass

    def session(self, status: str) -> None:
        pass

    def finish(self, status: str, reason: str = "") -> None:
        pass


NO_PROGRESS = NoProgress()


class ProgressFile:
    """One job's progress file. Never fails the arm: a write that fails is skipped (the display is a
    convenience, the measurement is not)."""

    min_interval_s = 0.25  # session counts: a write at most this often (a session ends every few ms)

    def __init__(self, path: Path, job: int, label: str, repetition: int) -> None:
        now = time.time()
        self.path = path
        self.state = ArmProgress(job=job, label=label, repetition=repetition, started=now, updated=now)
        self._written = 0.0
        self._write()

    def phase(self, name: str) -> None:
        assert name in PHASES, name
        self._update(phase=name)

    def sessions_planned(self, planned: int) -> None:
        self._update(sessions_planned=planned)

    def session(self, status: str) -> None:
        s = self.state
        self._update(
            force=False,
            sessions_done=s.sessions_done + 1,
            corrupted=s.corrupted + (status == "corrupted"),
        )

    def finish(self, status: str, reason: str = "") -> None:
        self._update(phase="done", status=status, reason=reason.splitlines()[0][:300] if reason else "")

    def _update(self, force: bool = True, **changes: Any) -> None:
        self.state = dataclasses.replace(self.state, updated=time.time(), **changes)
        if force or time.monotonic() - self._written >= self.min_interval_s:
            self._write()

    def _write(self) -> None:
        """Atomically: a reader sees the old file or the new one, never half of one."""
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(dataclasses.asdict(self.state), f)
                os.replace(tmp, self.path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._written = time.monotonic()
