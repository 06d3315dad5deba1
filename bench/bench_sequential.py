"""Fixed vs sequential design on the embedded default: the dsv4 study both ways, in one run, side by side.

Runs `python -m orchestrator -m +experiment=dsv4_corruption` (5 arms x 4 starts x 60 sessions) and
`python -m orchestrator -m +experiment=dsv4_sequential` (the same arms, in rounds until the evidence
decides), each on its own free loopback ports, MLflow store and reports under a temporary directory,
one after the other, and prints per design: the verdicts, the sessions, the server starts, the wall
time, then the ratios sequential / fixed.

    python bench/bench_sequential.py [--order fixed,sequential] [--keep DIR] [extra Hydra overrides...]

Extra overrides go to both runs (e.g. `bench.concurrency=[1,8,32]` for a shorter throughput sweep).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DESIGNS = {"fixed": "dsv4_corruption", "sequential": "dsv4_sequential"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_cluster(root: Path) -> list[str]:
    out = []
    for role in ("prefill", "decode", "router"):
        out += [f"cluster.hosts.{role}.port={free_port()}", f"cluster.hosts.{role}.work_dir={root}/{role}"]
    out.append(f"cluster.hosts.prefill.bootstrap_port={free_port()}")
    out.append(f"cluster.hosts.router.metrics_port={free_port()}")
    return out


def run_design(name: str, root: Path, extra: list[str]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    study = DESIGNS[name]
    argv = [
        sys.executable,
        "-m",
        "orchestrator",
        f"+experiment={study}",
        *loopback_cluster(root),
        f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"report.dir={root}/reports",
        f"hydra.sweep.dir={root}/multirun",
        *extra,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{name} study failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    report = json.loads((root / "reports" / study / "report.json").read_text())
    runs = [r for a in report["arms"] for r in a["runs"]]
    return {
        "design": name,
        "wall_s": wall,
        "sessions": sum(a["n"] for a in report["arms"]),
        "starts": len(runs),
        "sweeps": sum(1 for a in report["arms"] if a["throughput"]),
        "verdicts": {h["id"]: h["verdict"] for h in report["hypotheses"]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--order", default="fixed,sequential")
    parser.add_argument("--keep", type=Path, help="keep the runs' stores and reports here")
    args, extra = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        results = {name: run_design(name, root / name, extra) for name in args.order.split(",")}
    for r in results.values():
        print(
            f"{r['design']:<11} {r['wall_s']:7.1f} s  {r['sessions']:5d} sessions  {r['starts']:3d} starts  "
            f"{r['sweeps']} arms swept  {r['verdicts']}"
        )
    if {"fixed", "sequential"} <= set(results):
        fixed, seq = results["fixed"], results["sequential"]
        print(
            f"sequential / fixed: sessions {seq['sessions'] / fixed['sessions']:.2f}, "
            f"starts {seq['starts'] / fixed['starts']:.2f}, wall time {seq['wall_s'] / fixed['wall_s']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
