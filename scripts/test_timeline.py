"""Where a test run's wall time went: read the file HEISENHUNT_TEST_TIMELINE names (tests/conftest.py writes
a line per test: worker, start, end, CPU seconds, id) and print each worker's busy time, its idle time
before the run's end, the tests that used the most CPU (on a machine the suite keeps busy, CPU is what
the run's length is made of), and the tests running in the run's last minutes. With `--cpu-since FILE`
(the first line of /proc/stat, saved when the run began), how busy the whole machine was since: the
servers the tests start detached count there and nowhere else. A machine far from busy has room for
another worker; a busy one only runs faster with less work.

    head -1 /proc/stat > /tmp/cpu-before
    HEISENHUNT_TEST_TIMELINE=/tmp/timeline.tsv python -m pytest
    python scripts/test_timeline.py /tmp/timeline.tsv --cpu-since /tmp/cpu-before
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple


class Row(NamedTuple):
    worker: str
    start: float
    end: float
    nodeid: str
    cpu_s: float = 0.0  # the test process's and the processes it waited for


def read(path: Path) -> list[Row]:
    rows = []
    for line in path.read_text().splitlines():
        worker, start, end, cpu, nodeid = line.split("\t", 4)
        rows.append(Row(worker, float(start), float(end), nodeid, float(cpu)))
    return rows


def summary(rows: list[Row], tail_s: float, top: int = 0) -> str:
    t0, t1 = min(r.start for r in rows), max(r.end for r in rows)
    cpu = sum(r.cpu_s for r in rows)
    lines = [
        f"{len(rows)} tests, {t1 - t0:.0f} s from the first start to the last end, "
        f"{cpu:.0f} CPU-s in the tests and what they waited for"
    ]
    by_worker: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for worker, start, end, nodeid, _ in rows:
        by_worker[worker].append((start, end, nodeid))
    for worker, tests in sorted(by_worker.items()):
        busy = sum(e - s for s, e, _ in tests)
        last = max(e for _, e, _ in tests)
        lines.append(
            f"  {worker}: {len(tests)} tests, busy {busy:.0f} s, done {t1 - last:.0f} s before the end"
        )
    if top:
        lines.append(f"the {top} tests that used the most CPU (CPU-s, wall s):")
        for r in sorted(rows, key=lambda r: -r.cpu_s)[:top]:
            lines.append(f"  {r.cpu_s:7.1f} {r.end - r.start:6.1f}  {r.nodeid}")
    lines.append(f"running in the last {tail_s:.0f} s (start and end from the first start):")
    for worker, start, end, nodeid, _ in sorted(rows, key=lambda r: r.start):
        if end > t1 - tail_s:
            lines.append(f"  {worker} {start - t0:7.1f} {end - t0:7.1f} {end - start:6.1f}  {nodeid}")
    return "\n".join(lines)


def cpu_ticks(stat_line: str) -> tuple[int, int]:
    """(busy, total) clock ticks of /proc/stat's first line ("cpu  user nice system idle iowait irq softirq
    steal ..."): idle and iowait are not busy; guest time is inside user already."""
    ticks = [int(x) for x in stat_line.split()[1:9]]
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def cpu_line() -> str:
    """/proc/stat's first line now: the whole machine's clock ticks since boot."""
    return Path("/proc/stat").read_text().splitlines()[0]


def machine_busy(before: str, after: str, cores: int) -> str:
    """How busy the machine's cores were between two readings of /proc/stat's first line."""
    (busy0, total0), (busy1, total1) = cpu_ticks(before), cpu_ticks(after)
    busy, total = busy1 - busy0, total1 - total0
    hz = os.sysconf("SC_CLK_TCK")
    return (
        f"the whole machine since the run began: {busy / hz:.0f} CPU-s busy of {total / hz:.0f} "
        f"({busy / total:.0%} of {cores} cores)"
    )


def durations(rows: list[Row], min_s: float = 1.0) -> str:
    """tests/durations.tsv's text: the wall seconds of each test that took `min_s` or more, longest
    first, each id without pytest-xdist's `@group` (tests/conftest.py orders a run by it, longest first)."""
    lines = [
        "# seconds\ttest: wall time in a whole run; tests/conftest.py sends the longest out first",
        "# written by `python scripts/test_timeline.py TIMELINE --write-durations tests/durations.tsv`",
    ]
    for r in sorted(rows, key=lambda r: (r.start - r.end, r.nodeid)):
        if r.end - r.start >= min_s:
            lines.append(f"{r.end - r.start:.1f}\t{_GROUP_SUFFIX.sub('', r.nodeid)}")
    return "\n".join(lines) + "\n"


_GROUP_SUFFIX = re.compile(r"@[^\]\[/]+$")  # as tests/conftest.py's plain_nodeid


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--tail", type=float, default=180.0, help="seconds before the end to list (180)")
    parser.add_argument("--top", type=int, default=15, help="how many of the most CPU-hungry tests to list")
    parser.add_argument("--cpu-since", type=Path, help="/proc/stat's first line, saved as the run began")
    parser.add_argument(
        "--write-durations", type=Path, help="write each test's wall time to this file (tests/durations.tsv)"
    )
    args = parser.parse_args()
    if args.write_durations:
        args.write_durations.write_text(durations(read(args.timeline)))
    print(summary(read(args.timeline), args.tail, args.top))
    if args.cpu_since:
        print(machine_busy(args.cpu_since.read_text(), cpu_line(), os.cpu_count() or 1))


if __name__ == "__main__":
    main()
