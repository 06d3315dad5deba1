"""Where a pool sweep's time went, from what it left: its job logs' timestamps and its runs' lease tags.

    python bench/pool_phases.py SWEEP_ROOT

SWEEP_ROOT holds `multirun/` (hydra.sweep.dir) and `m.db` (tracking.uri=sqlite:///SWEEP_ROOT/m.db), as
the command of docs/ray-pool.md leaves them. Prints each arm phase's mean over the jobs (lease taken, run
started, hosts checked, servers up, stress done, teardown begun, last line), how long each member sat idle
between two arms, how many Ray workers ran the arms, and how long the sweep took to its launch and from
there to its first lease.
"""

from __future__ import annotations

import itertools
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

import mlflow

LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[([^\]]+)\]\[\w+\] - (.*)")
# (phase that ends here, the first record that marks it: logger, start of the message)
MARKS = (
    ("leased", "orchestrator.run.pool", "cluster pool: "),
    ("run started", "orchestrator", "arm "),
    ("checked", "orchestrator", "starting prefill"),
    ("servers up", "orchestrator", "router healthy"),
    ("stressed", "orchestrator.workload.stress", "stress: "),
    ("stopping", "orchestrator", "stopping router"),
)


def stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def records(text: str) -> list[tuple[float, str, str]]:
    """(time, logger, message) of each log record."""
    return [(stamp(m[1]), m[2], m[3]) for m in map(LINE.match, text.splitlines()) if m]


def job_marks(recs: list[tuple[float, str, str]]) -> dict[str, float]:
    """When each mark of MARKS was first logged, and the last record ("end")."""
    found = {}
    for name, logger, start in MARKS:
        first = next((t for t, who, msg in recs if who == logger and msg.startswith(start)), None)
        if first is not None:
            found[name] = first
    return {**found, "end": recs[-1][0]} if recs else {}


def phases(marks: list[dict[str, float]]) -> dict[str, list[float]]:
    names = [name for name, _, _ in MARKS] + ["end"]
    out: dict[str, list[float]] = {}
    for job in marks:
        for a, b in itertools.pairwise(names):
            if a in job and b in job:
                out.setdefault(f"{a} -> {b}", []).append(job[b] - job[a])
    return out


def leases(db: Path) -> dict[str, list[tuple[float, float, str]]]:
    """member -> (lease start, lease end, holder pid) of each arm's run, in order."""
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    by: dict[str, list[tuple[float, float, str]]] = {}
    for exp in client.search_experiments():
        for run in client.search_runs([exp.experiment_id]):
            tags = run.data.tags
            if tags.get("heisenhunt.kind") != "arm" or "lease.end" not in tags:
                continue
            pid = re.search(r"pid (\d+)", tags.get("lease.holder", ""))
            span = (
                datetime.fromisoformat(tags["lease.start"]).timestamp(),
                datetime.fromisoformat(tags["lease.end"]).timestamp(),
                pid[1] if pid else "?",
            )
            by.setdefault(tags["cluster_pool.member"], []).append(span)
    return {member: sorted(spans) for member, spans in by.items()}


def main(root: Path) -> None:
    jobs = [records(p.read_text()) for p in sorted((root / "multirun").glob("*/__main__.log"))]
    for phase, values in phases([job_marks(r) for r in jobs if r]).items():
        low, high = min(values), max(values)
        print(f"{phase:26s} mean {statistics.mean(values):5.2f} s  (min {low:.2f}, max {high:.2f})")
    held = leases(root / "m.db")
    idle = [b[0] - a[1] for spans in held.values() for a, b in itertools.pairwise(spans)]
    if idle:
        print(f"a member idle between two arms: mean {statistics.mean(idle):.2f} s, max {max(idle):.2f} s")
    print(f"Ray workers that ran arms: {len({pid for spans in held.values() for *_, pid in spans})}")
    sweep = records((root / "multirun" / "multirun.log").read_text())
    launch = next((t for t, who, msg in sweep if msg.startswith("Ray launcher: ")), None)
    first = min((spans[0][0] for spans in held.values()), default=None)
    if sweep and launch and first:
        before, after = launch - sweep[0][0], first - launch
        print(f"first record -> launch {before:.1f} s; launch -> first lease {after:.1f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
