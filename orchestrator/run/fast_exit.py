"""End a command's process without Python's teardown of its modules.

A sweep's process has imported MLflow, SQLAlchemy, pandas, SciPy and matplotlib by its end, and freeing them
one object at a time cost 1.7 s of wall time and 1.6 s of CPU per sweep on the embedded default (medians,
`bench/bench_exit.py`, side by side), after the report was written and nothing was left to do. The test
suite and the fault campaign start a study in many such processes.

Only the teardown is skipped: the process still ends the way Python ends it up to that point. Threads that
are not daemons are joined first, every exit handler registered after this one runs (MLflow's, Ray's
`shutdown`, executors' joins), and the logs and the standard streams are flushed; the exit code is the one
the command exited with. Files a command left open would lose what they buffer, so every file the
orchestrator writes is closed where it is written (a `with` block), as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Callable


def exit_code(code: object) -> int:
    """The status Python gives `sys.exit(code)`: None is 0, an int itself, anything else (a message) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def run_then_exit_fast(main: Callable[[], None]) -> None:
    """Run `main` as the process's command, and when the interpreter shuts down end the process once the
    threads are joined and every other exit handler has run. Only for a process's own entry point (the
    `__main__` block): the process ends with `main`'s status, whatever would have run after."""
    status = [1]  # an exception that is not SystemExit: Python prints it and exits 1

    def end_now() -> None:
        logging.shutdown()  # registered before this handler: it would run after it, so never
        for stream in (sys.stdout, sys.stderr):
            # a closed pipe: what it would have said is lost either way
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status[0])

    # registered before any handler of what `main` imports: handlers run last-registered first
    atexit.register(end_now)
    try:
        main()
        status[0] = 0
    except SystemExit as e:
        status[0] = exit_code(e.code)
        raise
