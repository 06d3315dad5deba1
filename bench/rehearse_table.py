"""Family-wise false implication on null models and the seed story, for the dsv4 study shape, each cell a
`python -m orchestrator.study.rehearse` run (the command is printed with it).

    flock /tmp/hh/heavy.lock timeout 600 python bench/rehearse_table.py [STUDIES] [EXPERIMENT] [OVERRIDE ...]

STUDIES per cell, default 2000; EXPERIMENT `dsv4_corruption` (the fixed design, default) or
`dsv4_sequential` (the sequential one); OVERRIDEs go to every cell, e.g. a real cluster's cost model
(`study.cost.restart_s=480 study.cost.session_s=1 study.cost.gpus=8`) or sized runs
(`study.stopping.max_run_sessions=600`). Prints markdown tables with the sessions, starts and GPU hours
per study (by the cost model: the deployment's unless overridden, analysis/cost.py) and the GPU time
against the fixed design's; every null cell must stay at or under 0.05, the seed story "all right" at or
over 0.95.
"""

from __future__ import annotations

import sys

from orchestrator.study.rehearse import from_config

BENCH = "bench/rehearse"


def cell(args: list[str]) -> tuple[str, dict]:
    return "python -m orchestrator.study.rehearse " + " ".join(args), from_config(args)


def gpu_time(result: dict) -> str:
    """GPU hours per study, its starts, and the ratio to the fixed design of as many starts per arm."""
    hours, fixed = result["gpu_hours_per_study"], result.get("fixed_design_gpu_hours")
    ratio = f", {hours / fixed:.2f}x the fixed design" if fixed else ""
    return f"{hours:.2f} h ({result['starts_per_study']:.1f} starts{ratio})"


def main() -> int:
    studies = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    experiment = sys.argv[2] if len(sys.argv) > 2 else "dsv4_corruption"
    common = [f"+experiment={experiment}", f"rehearse.studies={studies}", "rehearse.seed=13", *sys.argv[3:]]
    print("| rate | restart ICC | family-wise false implication | sessions per study | GPU time | command |")
    print("|---|---|---|---|---|---|")
    for pct in (3, 15):
        for icc in ("0", "0.02", "0.1"):
            command, result = cell(
                [*common, f"fault_model={BENCH}/null_{pct}pct.yaml", f"rehearse.restart_icc={icc}"]
            )
            false, spent = result["family_false_implication"], result["sessions_per_study"]
            print(f"| {pct}% | {icc} | {false:.2%} | {spent:.0f} | {gpu_time(result)} | `{command}` |")
    print()
    per_header = "per hypothesis (implicated/partial/inconclusive)"
    head = ["seed story", "restart ICC", "all right", "all as expected", "sessions", "GPU time", per_header]
    print(f"| {' | '.join(head)} | command |")
    print("|---|---|---|---|---|---|---|---|")
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
            f"{result['all_expected']:.2%} | {result['sessions_per_study']:.0f} | {gpu_time(result)} | "
            f"{per} | `{command}` |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
