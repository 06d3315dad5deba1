"""Rebuilding a report from MLflow as studies grow: `python -m orchestrator.report` on a sqlite store
holding 100 and 1,000 arm runs (the dsv4 study's arms, repeated), side by side in one run.

Each store is filled the way real arms fill it (the project's own ArmTracker: params, per-session JSONL,
summary, launch.json, bench.json on each arm's first repetition), then the report CLI runs in a fresh
process; its wall time and peak memory are printed, with the ratio between the two sizes.

    python bench/bench_report_load.py [--sizes 100,1000]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from orchestrator.config.load import CONF_DIR, load_job
from orchestrator.config.plan import plan_arm
from orchestrator.tracking.write import ArmTracker, start_study_run
from orchestrator.workload.results import BenchResult, LevelResult, Percentiles, SessionOutcome, StressSummary

ARMS = ["", "factor/multi_stream=off", "factor/capture=eager", "factor/index_k=fp8", "factor/hicache=off"]
RATES = {"": 0.15, "factor/hicache=off": 0.05}
SESSIONS = 60


def _stress(out: Path, rng: random.Random, rate: float) -> StressSummary:
    out.mkdir(parents=True, exist_ok=True)
    corrupted = sum(rng.random() < rate for _ in range(SESSIONS))
    with (out / "sessions.jsonl").open("w") as f:
        for i in range(SESSIONS):
            status = "corrupted" if i < corrupted else "clean"
            f.write(json.dumps(SessionOutcome(f"s{i}", status, 4, 4).to_dict()) + "\n")
    summary = StressSummary(SESSIONS, SESSIONS - corrupted, corrupted, 0, SESSIONS)
    (out / "summary.json").write_text(json.dumps(summary.__dict__))
    return summary


def _bench(rng: random.Random) -> BenchResult:
    def pct(x: float) -> Percentiles:
        return Percentiles(x, x, x, x)

    levels = []
    for c in (1, 8, 32, 64):
        n = 4 * c
        tokens = [128] * n
        latency = [rng.uniform(0.9, 1.1) * (0.5 + c / 64) for _ in range(n)]
        levels.append(
            LevelResult(
                c, n, 0, 0, 2.0, sum(tokens), sum(tokens) / 2.0, n / 2.0, pct(0.05), pct(0.01), pct(0.01),
                float(c), 0.1, 0.001, [], tokens, latency,
            )
        )  # fmt: skip
    return BenchResult(levels)


def fill(uri: str, root: Path, runs: int) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        base = [f"tracking.uri={uri}", f"report.dir={root}/reports", "+experiment=dsv4_corruption"]
        cfgs = {arm: compose("config", overrides=[*base, *([arm] if arm else [])]) for arm in ARMS}
        jobs = {arm: load_job(cfg) for arm, cfg in cfgs.items()}
    study = jobs[""].study
    parent = start_study_run(jobs[""].tracking, study, root / "sweep", "ofat", [])
    rng = random.Random(0)
    for i in range(runs):
        arm = ARMS[i % len(ARMS)]
        repetition = i // len(ARMS)
        plan = plan_arm(jobs[arm])
        with ArmTracker.start(jobs[arm].tracking, study, plan, repetition, parent) as tracker:
            out = root / "runs" / str(i)
            tracker.log_stress(_stress(out, rng, RATES.get(arm, 0.0)), out)
            if repetition == 0:
                tracker.log_bench(_bench(rng), None)


# the report CLI, then this process's own peak memory (the child's, whatever ran before it)
_REPORT = (
    "import resource, sys; from orchestrator.report.__main__ import main; rc = main(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(rc)"
)


def rebuild(uri: str, root: Path) -> tuple[float, float]:
    """(seconds, peak MiB) of the report CLI in a fresh process."""
    args = ["--tracking-uri", uri, "--study", "dsv4_corruption", "--out", str(root / "reports"), "--no-plots"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _REPORT, *args], check=True, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    return seconds, int(proc.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000", help="arm runs per store, comma-separated")
    args = parser.parse_args()
    results = {}
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            uri = f"sqlite:///{root}/mlflow.db"
            t0 = time.perf_counter()
            fill(uri, root, size)
            print(f"{size} arm runs stored in {time.perf_counter() - t0:.0f}s", flush=True)
            results[size] = rebuild(uri, root)
    print(f"\n{'arm runs':>9} {'report s':>9} {'peak MiB':>9}")
    for size, (seconds, mib) in results.items():
        print(f"{size:>9} {seconds:>9.1f} {mib:>9.0f}")
    sizes = sorted(results)
    if len(sizes) > 1:
        small, large = results[sizes[0]], results[sizes[-1]]
        print(f"time ratio {sizes[-1]}/{sizes[0]} runs: {large[0] / small[0]:.2f}x")


if __name__ == "__main__":
    main()
