"""Sessions to a minimal cause: delta debugging against one-at-a-time sweeps over the same 20 differences,
measured side by side in one run on the same truths (the built-in fault model, through the same pure
code that judges real runs: `python -m orchestrator.study.rehearse`, which prints each cell).

    flock /tmp/hh/heavy.lock timeout 900 python bench/bench_ddmin.py [STUDIES] [--live]

STUDIES per case, default 1000. Cases: one culprit of 20 (`+experiment=ddmin_serve_script`), and two
that corrupt only together (`factor/index_k=fp8`: the good script kept fp8 index keys), split across
the halves of the list. Prints, per case: how often each design finds exactly the true minimal set and
the sessions it spends, and the ratios; then, per case, the trials of each role a study has (the
steering's, each check's) and the starts each pooled. `--live` also runs the one-culprit study once on
the embedded default (real servers, about four minutes on 2 cores) and prints what it spent.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.study.rehearse import describe_by_role, from_config

CASES = {"1 of 20": [], "2 of 20 (together)": ["factor/index_k=fp8"]}


def live() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        argv = [
            sys.executable,
            "-m",
            "orchestrator",
            "-m",
            "+experiment=ddmin_serve_script",
            f"tracking.uri=sqlite:///{tmp}/m.db",
            f"hydra.sweep.dir={tmp}/multirun",
            f"report.dir={tmp}/reports",
        ]
        subprocess.run(argv, check=True, capture_output=True, cwd=tmp)
        search = json.loads((Path(tmp) / "reports/ddmin_serve_script/report.json").read_text())["ddmin"]
        return (
            f"live, embedded default: minimal set {search['minimal']}, {search['sessions']} sessions in "
            f"{search['runs_started']} runs, {len(search['trials'])} subsets, "
            f"{time.monotonic() - started:.0f} s"
        )


def main() -> int:
    studies = int(next((a for a in sys.argv[1:] if a.isdigit()), 1000))
    print("| case | design | exact minimal set | sessions per study | vs fixed one-at-a-time | command |")
    print("|---|---|---|---|---|---|")
    results = {}
    for name, extra in CASES.items():
        args = ["+experiment=ddmin_serve_script", *extra, f"rehearse.studies={studies}", "rehearse.seed=5"]
        result = results[name] = from_config(args)
        fixed = result["one_at_a_time_sessions"]
        seq = result["one_at_a_time"]
        command = "python -m orchestrator.study.rehearse " + " ".join(args)
        print(
            f"| {name} | ddmin | {result['exact']:.1%} | {result['sessions_per_study']:.0f} | "
            f"{result['sessions_per_study'] / fixed:.2f} | `{command}` |"
        )
        print(
            f"| {name} | one at a time, sequential | {seq['exact']:.1%} | {seq['sessions_per_study']:.0f} | "
            f"{seq['sessions_per_study'] / fixed:.2f} | (same run) |"
        )
        print(f"| {name} | one at a time, fixed (21 arms x 4 starts) | - | {fixed} | 1.00 | - |")
        print(
            f"| {name} | ddmin / sequential one at a time | | "
            f"{result['sessions_per_study'] / seq['sessions_per_study']:.2f} | | |"
        )
    print()
    for name, result in results.items():
        print(f"{name}, trials per study x the starts each pooled: {describe_by_role(result['by_role'])}")
    if "--live" in sys.argv:
        print()
        print(live())
    return 0


if __name__ == "__main__":
    sys.exit(main())
