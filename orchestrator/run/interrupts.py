"""The one rule for interrupts: SIGINT and SIGTERM stop a study in every phase, under every launcher.

Before the first arm, between arms, between a sequential design's rounds, in the report's callbacks and
while a Ray pool waits for its jobs, either signal raises KeyboardInterrupt in the main thread; during an
arm, `arm.InterruptGuard` takes over so that the teardown runs once and is not cut short. The same holds
for a SIGINT the process inherited as ignored, as a background job of a script does: a terminal's Ctrl-C
never reaches a background job (it is not in the foreground process group), so a SIGINT that does
arrive was sent on purpose (`kill -INT`), and dropping it in some phases and honouring it in others (as
the launchers used to) made a stop depend on the moment. `nohup` is left to mean what it says: it
ignores SIGHUP, which is not touched here.

An interrupt that lands while Hydra composes a config (between arms: the next job's) is handed back a few
milliseconds later, until it lands outside: OmegaConf's restore-on-exit blocks walk the node the cut-short
update left half-built, and Hydra's own `finally`s read names never bound, so the KeyboardInterrupt came
out as an AttributeError or a ConfigCompositionException and the study exited 1, not 130 (found by
tests/test_reliability.py under four pytest workers; 14 in 200 interrupts of a compose loop).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from orchestrator.workload.client import INTERRUPT_SIGNALS

# the code an interrupt must not cut short: OmegaConf, and Hydra's composition (all of it below the
# config loader)
UNSAFE_MODULES = ("omegaconf", "hydra._internal.config_loader_impl")
REDELIVER_S = 0.02
# past this, the interrupt is raised wherever it lands: a composition that never ends must still stop
DEFER_AT_MOST_S = 5.0
_deferred_since: dict[int, float] = {}


def in_unsafe_code(frame: FrameType | None) -> bool:
    """True when `frame` or any caller of it runs in one of UNSAFE_MODULES."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if any(name == m or name.startswith(m + ".") for m in UNSAFE_MODULES):
            return True
        frame = frame.f_back
    return False


def interrupt(signum: int, frame: Any) -> None:
    now = time.monotonic()
    first = _deferred_since.setdefault(signum, now)
    if in_unsafe_code(frame) and now - first < DEFER_AT_MOST_S:
        threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
        return
    _deferred_since.pop(signum, None)
    raise KeyboardInterrupt(f"signal {signum}")


def honour_interrupts() -> None:
    """Make SIGINT and SIGTERM raise KeyboardInterrupt from here on, whatever the process inherited or a
    library installed (Ray's `init` makes SIGTERM a `sys.exit`, which would skip the launcher's
    cancelling of its jobs). Only the main thread may set handlers; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in INTERRUPT_SIGNALS:
        signal.signal(signum, interrupt)
