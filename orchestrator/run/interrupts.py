"""The one rule for interrupts: SIGINT and SIGTERM stop a study in every phase, under every launcher.

Before the first arm, between arms, between a sequential design's rounds, in the report's callbacks and
while a Ray pool waits for its jobs, either signal raises KeyboardInterrupt in the main thread; during an
arm, `arm.InterruptGuard` takes over so that the teardown runs once and is not cut short. The same holds
for a SIGINT the process inherited as ignored, as a background job of a script does: a terminal's Ctrl-C
never reaches a background job (it is not in the foreground process group), so a SIGINT that does
arrive was sent on purpose (`kill -INT`), and dropping it in some phases and honouring it in others (as
the launchers used to) made a stop depend on the moment. `nohup` is left to mean what it says: it
ignores SIGHUP, which is not touched here.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from orchestrator.workload.client import INTERRUPT_SIGNALS


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def honour_interrupts() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt from here on, whatever the process inherited or a
    library installed (Ray's `init` makes SIGTERM a `sys.exit`, which would skip the launcher's
    cancelling of its jobs). Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in INTERRUPT_SIGNALS:
        signal.signal(signum, interrupt)
