"""Where a test run's wall time went: read the file HEISENHUNT_TEST_TIMELINE names (tests/conftest.py writes
a line per test: worker, start, end, id) and print each worker's busy time, its idle time before the run's
end, and the tests running in the run's last minutes, which set how long the run takes.

    HEISENHUNT_TEST_TIMELINE=/tmp/timeline.tsv python -m pytest
    python scripts/test_timeline.py /tmp/timeline.tsv
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def read(path: Path) -> list[tuple[str, float, float, str]]:
    rows = []
    for line in path.read_text().splitlines():
        worker, start, end, nodeid = line.split("\t", 3)
        rows.append((worker, float(start), float(end), nodeid))
    return rows


def summary(rows: list[tuple[str, float, float, str]], tail_s: float) -> str:
    t0, t1 = min(r[1] for r in rows), max(r[2] for r in rows)
    lines = [f"{len(rows)} tests, {t1 - t0:.0f} s from the first start to the last end"]
    by_worker: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for worker, start, end, nodeid in rows:
        by_worker[worker].append((start, end, nodeid))
    for worker, tests in sorted(by_worker.items()):
        busy = sum(e - s for s, e, _ in tests)
        last = max(e for _, e, _ in tests)
        lines.append(
            f"  {worker}: {len(tests)} tests, busy {busy:.0f} s, done {t1 - last:.0f} s before the end"
        )
    lines.append(f"running in the last {tail_s:.0f} s (start and end from the first start):")
    for worker, start, end, nodeid in sorted(rows, key=lambda r: r[1]):
        if end > t1 - tail_s:
            lines.append(f"  {worker} {start - t0:7.1f} {end - t0:7.1f} {end - start:6.1f}  {nodeid}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--tail", type=float, default=180.0, help="seconds before the end to list (180)")
    args = parser.parse_args()
    print(summary(read(args.timeline), args.tail))


if __name__ == "__main__":
    main()
