"""Wall time of one sweep run serially on one cluster against the same sweep in parallel on a pool of two,
side by side in one run, on the embedded default (real sim servers and routers on loopback).

    flock /tmp/hh/heavy.lock timeout 1200 python bench/bench_pool.py [--study dsv4] [--sessions N]

Default sweep: `+experiment=dsv4_corruption` (5 arms x 3 starts = 15 jobs, the study the pool is for)
with its throughput sweep off and N sessions per start (default 80). Serial: Hydra's basic launcher on
`cluster=local`. Parallel: `hydra/launcher=heisenhunt_ray cluster_pool=local2`, the launcher starting
its own Ray on this machine (Ray's start-up is counted). Both into fresh MLflow stores; prints each wall
time, the ratio, and checks that both ran every job FINISHED with the same verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow

SETUPS = {
    "serial, one cluster (basic launcher)": [],
    "parallel, pool of two (Ray)": ["hydra/launcher=heisenhunt_ray", "cluster_pool=local2"],
}


def run(extra: list[str], sweep: list[str], tmp: Path) -> tuple[float, dict, list[str]]:
    argv = [
        sys.executable, "-m", "orchestrator", *sweep, *extra,
        f"tracking.uri=sqlite:///{tmp}/m.db", f"hydra.sweep.dir={tmp}/multirun", f"report.dir={tmp}/reports",
    ]  # fmt: skip
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(extra) or 'serial'} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads(next((tmp / "reports").glob("*/report.json")).read_text())
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/m.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    statuses = [r.info.status for r in runs if r.data.tags.get("heisenhunt.kind") == "arm"]
    return wall, report, statuses


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--study", default="dsv4_corruption")
    parser.add_argument("--sessions", type=int, default=80)
    args = parser.parse_args()
    sweep = [f"+experiment={args.study}", f"workload.sessions={args.sessions}", "bench.enabled=false"]
    print(f"sweep: python -m orchestrator {' '.join(sweep)}  (2 cores: {os.cpu_count()} CPUs seen)")
    walls, verdicts = {}, {}
    for name, extra in SETUPS.items():
        with tempfile.TemporaryDirectory() as tmp:
            wall, report, statuses = run(extra, sweep, Path(tmp))
        assert statuses and set(statuses) == {"FINISHED"}, statuses
        walls[name] = wall
        verdicts[name] = {h["id"]: h["verdict"] for h in report["hypotheses"]}
        print(f"{name}: {len(statuses)} jobs FINISHED in {wall:.1f} s; verdicts {verdicts[name]}")
    serial, parallel = walls.values()
    print(f"wall-time ratio, parallel on the pool / serial on one cluster: {parallel / serial:.2f}")
    same = len({json.dumps(v, sort_keys=True) for v in verdicts.values()}) == 1
    print("verdicts: the same" if same else "verdicts: differ (each study draws its own sessions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
