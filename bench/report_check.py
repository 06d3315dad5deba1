"""Rehearsed studies of five shapes, each judged by `analysis.analyse` and checked by the report checker
(orchestrator/report/consistency.py): how many reports contradict themselves (the contract: none), how
often the hypotheses implicate every true fix, and how often the minimal cause is found.

    python bench/report_check.py [studies per shape, default 2000] [seed]
"""

from __future__ import annotations

import sys
import time

from orchestrator.report.consistency import SHAPES, check_shape


def main(studies: int = 2000, seed: int = 0) -> int:
    print("| shape | studies | contradicting | all fixes implicated | minimal cause found | s |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for name in SHAPES:
        started = time.perf_counter()
        r = check_shape(name, studies, seed)
        bad += r["contradicting"]
        print(
            f"| {name} | {studies} | {r['contradicting']} | "
            f"{'–' if r['all_fixes_implicated'] is None else format(r['all_fixes_implicated'], '.1%')} | "
            f"{r['minimal_cause_found']:.1%} | {time.perf_counter() - started:.0f} |",
            flush=True,
        )
        for line in r["examples"]:
            print(f"    {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(*(int(a) for a in sys.argv[1:3])))
