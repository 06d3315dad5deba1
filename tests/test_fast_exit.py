"""A command ended without Python's teardown (orchestrator/run/fast_exit.py) still ends as Python would have
ended it: its status, its threads joined, every exit handler run, its logs and streams flushed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.run.fast_exit import exit_code

CHILD = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from orchestrator.run.fast_exit import run_then_exit_fast

    def main():
        logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
        logging.info("logged before the end")
        # a handler registered as the command runs, as MLflow's and Ray's are
        atexit.register(lambda: print("handler ran", end=""))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", end=" "))).start()
        print("buffered", end=" ")  # no newline, no flush: still in the buffer at the end
        if sys.argv[2] == "return":
            return
        if sys.argv[2] == "raise":
            raise RuntimeError("boom")
        sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])

    run_then_exit_fast(main)
    """
)


@pytest.mark.parametrize(
    ("how", "status"), [("return", 0), ("3", 3), ("130", 130), ("a message", 1), ("raise", 1)]
)
def test_the_process_ends_with_the_commands_status_and_nothing_it_said_is_lost(tmp_path: Path, how, status):
    log = tmp_path / "command.log"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(log), how], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered thread joined handler ran", proc.stdout
    assert log.read_text() == "INFO:root:logged before the end\n"
    if how == "a message":
        assert proc.stderr.strip() == "a message"
    if how == "raise":
        assert "RuntimeError: boom" in proc.stderr


@pytest.mark.parametrize(("code", "status"), [(None, 0), (0, 0), (2, 2), ("refused", 1)])
def test_exit_code_is_pythons(code, status):
    assert exit_code(code) == status
