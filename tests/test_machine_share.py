"""The conftest's readers-writer lock over pytest-xdist workers (`machine_share`): an `alone` test waits
for the tests running beside it, and none starts beside it. flock is per open file, so threads of one
process stand in for the workers here."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.conftest import machine_share


def test_an_alone_test_waits_for_the_tests_beside_it_and_none_starts_beside_it(tmp_path: Path):
    events: list[str] = []
    sharing = machine_share(tmp_path, alone=False)
    sharing.__enter__()  # a test already running on another worker

    def alone():
        with machine_share(tmp_path, alone=True):
            events.append("alone starts")
            time.sleep(0.3)
            events.append("alone ends")

    def later():
        with machine_share(tmp_path, alone=False):
            events.append("later starts")

    first = threading.Thread(target=alone)
    first.start()
    time.sleep(0.3)
    assert events == []  # still waiting for the test beside it
    second = threading.Thread(target=later)
    second.start()
    time.sleep(0.2)
    assert events == []  # the gate is closed: the later test does not overtake the alone one
    sharing.__exit__(None, None, None)
    first.join(5)
    second.join(5)
    assert events == ["alone starts", "alone ends", "later starts"]


def test_tests_that_share_run_side_by_side(tmp_path: Path):
    with machine_share(tmp_path, alone=False), machine_share(tmp_path, alone=False):
        pass  # a second share does not wait for the first


def test_an_alone_test_held_off_past_its_patience_runs_with_a_warning(tmp_path: Path, recwarn):
    with machine_share(tmp_path, alone=False), machine_share(tmp_path, alone=True, patience_s=0.2):
        pass
    assert any("stayed shared" in str(w.message) for w in recwarn)
