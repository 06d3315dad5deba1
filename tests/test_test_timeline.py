"""Where a test run's time went: the timeline tests/conftest.py writes under HEISENHUNT_TEST_TIMELINE, read by
scripts/test_timeline.py (which `.ci/run` prints at its end)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import order_items, plain_nodeid, read_durations, script_module

ROOT = Path(__file__).resolve().parents[1]
timeline = script_module("scripts/test_timeline.py", "test_timeline_script")


def timeline_of(tmp_path: Path, target: str, workers: str) -> list:
    """Run `target` in a pytest of its own on `workers` workers with the timeline on; its rows."""
    path = tmp_path / "timeline.tsv"
    env = {**os.environ, "HEISENHUNT_TEST_TIMELINE": str(path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", workers, "-p", "no:cacheprovider", target],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:]
    return timeline.read(path)


def test_a_run_writes_a_line_per_test_and_the_script_sums_each_worker(tmp_path: Path):
    target = "tests/test_fast_exit.py::test_exit_code_is_pythons"
    rows = timeline_of(tmp_path, target, "2")
    assert len(rows) == 4 and {r[3].split("[")[0] for r in rows} == {target}
    assert {r[0] for r in rows} <= {"gw0", "gw1"} and all(r[1] <= r[2] for r in rows)
    text = timeline.summary(rows, tail_s=600, top=2)
    assert text.startswith("4 tests, ")
    assert "the 2 tests that used the most CPU" in text
    assert all(f"{worker}: " in text for worker in {r[0] for r in rows})
    assert text.split("running in the last")[1].count(target) == 4  # every test ran in the last 600 s


def test_a_test_is_charged_the_cpu_of_the_processes_it_waited_for(tmp_path: Path):
    target = (
        "tests/test_fast_exit.py::test_the_process_ends_with_the_commands_status_and_nothing_it_said_is_lost"
    )
    rows = timeline_of(tmp_path, target, "0")
    # each runs a python child to its end: its start-up alone is tens of milliseconds of CPU
    assert rows and all(r.cpu_s >= 0.02 for r in rows), rows


def test_the_summary_names_the_tests_of_the_last_minutes_and_each_workers_idle_end():
    rows = [
        timeline.Row("gw0", 100.0, 400.0, "tests/a.py::long", 20.0),
        timeline.Row("gw1", 100.0, 150.0, "tests/b.py::short", 45.0),
        timeline.Row("gw1", 150.0, 160.0, "tests/b.py::shorter", 1.0),
    ]
    text = timeline.summary(rows, tail_s=100, top=1)
    assert "3 tests, 300 s from the first start to the last end, 66 CPU-s" in text
    assert "the 1 tests that used the most CPU (CPU-s, wall s):\n     45.0   50.0  tests/b.py::short" in text
    assert "gw0: 1 tests, busy 300 s, done 0 s before the end" in text
    assert "gw1: 2 tests, busy 60 s, done 240 s before the end" in text
    tail = text.split("running in the last")[1]
    assert "tests/a.py::long" in tail and "tests/b.py::short" not in tail


def test_the_machine_is_busy_for_its_non_idle_ticks_and_a_real_busy_loop_shows():
    # user nice system idle iowait irq softirq steal: idle and iowait are the only ticks not busy
    before, after = "cpu  100 0 50 800 50 0 0 0 0 0", "cpu  400 0 150 1300 150 0 0 0 0 0"
    assert timeline.cpu_ticks(before) == (150, 1000)
    assert "(40% of 2 cores)" in timeline.machine_busy(before, after, 2)
    # a real reading around a busy loop: at least some of it counted busy, never more than all
    first = timeline.cpu_line()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass
    (busy0, total0), (busy1, total1) = timeline.cpu_ticks(first), timeline.cpu_ticks(timeline.cpu_line())
    assert 0 < busy1 - busy0 <= total1 - total0


def test_the_durations_file_lists_the_long_tests_longest_first_without_their_group(tmp_path: Path):
    rows = [
        timeline.Row("gw0", 0.0, 3.0, "tests/a.py::mid", 1.0),
        timeline.Row("gw1", 0.0, 90.0, "tests/b.py::long[x@y]@ray", 9.0),
        timeline.Row("gw1", 90.0, 90.2, "tests/b.py::short", 0.1),
        timeline.Row("gw2", 0.0, 40.0, "tests/c.py::docs[README.md:54:python -m x]@docs-33378152", 2.0),
    ]
    path = tmp_path / "durations.tsv"
    path.write_text(timeline.durations(rows))
    assert read_durations(path) == {
        "tests/b.py::long[x@y]": 90.0,
        "tests/c.py::docs[README.md:54:python -m x]": 40.0,
        "tests/a.py::mid": 3.0,
    }
    assert next(iter(read_durations(path))) == "tests/b.py::long[x@y]"  # longest first
    # the suite's own file reads, and names tests by the ids the ordering looks up
    known = read_durations()
    assert known and all("::" in nodeid and plain_nodeid(nodeid) == nodeid for nodeid in known)


def test_a_run_sends_the_longest_tests_first_a_group_by_its_whole_time_and_alone_tests_last():
    def item(nodeid: str, *marks: pytest.MarkDecorator) -> SimpleNamespace:
        found = {m.name: m.mark for m in marks}
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=found.get)

    known = {"t.py::a": 5.0, "t.py::b": 50.0, "g.py::one": 20.0, "g.py::two": 20.0, "s.py::alone": 99.0}
    items = [
        item("t.py::a"),
        item("g.py::one@grp", pytest.mark.xdist_group("grp")),
        item("t.py::b"),
        item("s.py::alone", pytest.mark.alone),
        item("g.py::two@grp", pytest.mark.xdist_group("grp")),
        item("t.py::new_slow", pytest.mark.slow),  # unknown: guessed 20 s
        item("t.py::new"),  # unknown: guessed short
    ]
    order_items(items, known)
    assert [i.nodeid for i in items] == [
        "t.py::b", "g.py::one@grp", "g.py::two@grp", "t.py::new_slow", "t.py::a", "t.py::new", "s.py::alone",
    ]  # fmt: skip
