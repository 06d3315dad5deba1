"""Wall time of one sweep run serially on one cluster against the same sweep in parallel on a pool of two,
side by side in one run, on the embedded default (real sim servers and routers on loopback).

    flock /tmp/hh/heavy.lock timeout 1200 python bench/bench_pool.py [--study NAME] [--sessions N]
        [--time-scale X]

Default sweep: `+experiment=dsv4_corruption` (5 arms x 4 starts = 20 jobs) with its throughput sweep off
and N sessions per start (default 80). Serial: Hydra's basic launcher on `cluster=local`. Parallel:
`hydra/launcher=heisenhunt_ray cluster_pool=local2`, twice: the launcher starting its own Ray on this
machine (Ray's start-up counted), and joined to a Ray head already running on loopback (as a team's
long-lived Ray cluster; its start-up not counted). Each into a fresh MLflow store; prints each wall time,
the ratios, and checks that every job FINISHED.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' loopback Ray head
from tests.pool.ray_head import RAY_ENV, local_ray_head

POOL = ["hydra/launcher=heisenhunt_ray", "cluster_pool=local2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(extra: list[str], sweep: list[str], tmp: Path) -> tuple[float, dict, list[str]]:
    argv = [
        sys.executable, "-m", "orchestrator", *sweep, *extra,
        f"tracking.uri=sqlite:///{tmp}/m.db", f"hydra.sweep.dir={tmp}/multirun", f"report.dir={tmp}/reports",
    ]  # fmt: skip
    env = {**os.environ, **RAY_ENV}
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
    # the sim's clock (HEISENHUNT_SIM_TIME_SCALE): 1.0 is the modelled hardware's own (model loads and
    # decode steps as long as on the GPUs modelled); the shipped 0.2 runs five times faster
    parser.add_argument("--time-scale", type=float, default=None)
    args = parser.parse_args()
    sweep = [f"workload.sessions={args.sessions}", "bench.enabled=false"]
    if args.study != "quick":  # quick: the default study, `python -m orchestrator` with no experiment
        sweep.insert(0, f"+experiment={args.study}")
    if args.time_scale is not None:
        sweep += [
            f"deployment.roles.{role}.env.HEISENHUNT_SIM_TIME_SCALE='{args.time_scale}'"
            for role in ("prefill", "decode")
        ]
    print(f"sweep: python -m orchestrator {' '.join(sweep)}  (2 cores: {os.cpu_count()} CPUs seen)")
    walls = {}

    def measure(name: str, extra: list[str]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            wall, report, statuses = run(extra, sweep, Path(tmp))
        assert statuses and set(statuses) == {"FINISHED"}, statuses
        walls[name] = wall
        verdicts = {h["id"]: h["verdict"] for h in report["hypotheses"]}
        print(f"{name}: {len(statuses)} jobs FINISHED in {wall:.1f} s; verdicts {verdicts}", flush=True)

    measure("serial, one cluster (basic launcher)", [])
    measure("parallel, pool of two, Ray started by the launcher", POOL)
    with local_ray_head(free_port) as address:
        measure(
            "parallel, pool of two, Ray head already running",
            [*POOL, f"hydra.launcher.ray.init.address={address}"],
        )
    serial = next(iter(walls.values()))
    for name, wall in list(walls.items())[1:]:
        print(f"wall-time ratio, {name} / serial: {wall / serial:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
