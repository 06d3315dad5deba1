"""Write tests/durations.json from the output of `python -m pytest --durations=0` on stdin: each test's
seconds (setup + call + teardown), for the tests that take a second or more. The suite runs its tests
longest first from this file (tests/conftest.py); a test missing from it runs after the ones listed.

    python -m pytest --durations=0 | python scripts/record-test-durations.py
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (?:setup|call|teardown)\s+(\S+)")


def durations(lines) -> dict[str, float]:
    total: dict[str, float] = defaultdict(float)
    for line in lines:
        if found := LINE.match(line):
            total[found.group(2)] += float(found.group(1))
    return {test: round(s, 1) for test, s in sorted(total.items(), key=lambda kv: -kv[1]) if s >= 1.0}


if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
    out.write_text(json.dumps(durations(sys.stdin), indent=0) + "\n")
    print(f"wrote {out}")
