"""Family-wise false implication on null models and the seed story, for the dsv4 study shape, each cell a
`python -m orchestrator.study.rehearse` run (the command is printed with it).

    flock /tmp/hh/heavy.lock timeout 600 python bench/rehearse_table.py [STUDIES] [EXPERIMENT]

STUDIES per cell, default 2000; EXPERIMENT `dsv4_corruption` (the fixed design, default) or
`dsv4_sequential` (the sequential one: the table then has the sessions per study too). Prints a markdown
table; every null cell must stay at or under 0.05, the seed story "all right" at or over 0.95.
"""

from __future__ import annotations

import sys

from orchestrator.study.rehearse import from_config

BENCH = "bench/rehearse"


def cell(args: list[str]) -> tuple[str, dict]:
    return "python -m orchestrator.study.rehearse " + " ".join(args), from_config(args)


def main() -> int:
    studies = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    experiment = sys.argv[2] if len(sys.argv) > 2 else "dsv4_corruption"
    common = [f"+experiment={experiment}", f"rehearse.studies={studies}", "rehearse.seed=13"]
    print("| rate | restart ICC | family-wise false implication | sessions per study | command |")
    print("|---|---|---|---|---|")
    for pct in (3, 15):
        for icc in ("0", "0.02", "0.1"):
            command, result = cell(
                [*common, f"fault_model={BENCH}/null_{pct}pct.yaml", f"rehearse.restart_icc={icc}"]
            )
            false, spent = result["family_false_implication"], result["sessions_per_study"]
            print(f"| {pct}% | {icc} | {false:.2%} | {spent:.0f} | `{command}` |")
    print()
    per_header = "per hypothesis (implicated/partial/inconclusive)"
    print(f"| seed story | restart ICC | all right | all as expected | sessions | {per_header} | command |")
    print("|---|---|---|---|---|---|---|")
    for icc in ("0", "0.02", "0.1"):
        command, result = cell(
            [*common, f"fault_model={BENCH}/seed_story.yaml", f"rehearse.restart_icc={icc}"]
        )
        per = "; ".join(
            f"{h['id']} {h['verdicts']['implicated']:.0%}/{h['verdicts']['partial']:.0%}/"
            f"{h['verdicts']['inconclusive']:.0%}"
            for h in result["hypotheses"]
        )
        print(
            f"| 15% / HiCache off 5% / others 0 | {icc} | {result['all_right']:.2%} | "
            f"{result['all_expected']:.2%} | {result['sessions_per_study']:.0f} | {per} | `{command}` |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
