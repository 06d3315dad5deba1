"""Wall time of the default study (`python -m orchestrator`: the `quick` study, 2 arms x 3 server starts x 80
sessions) run by Hydra's basic launcher on `cluster=local` against the same study with every arm a SLURM
job (`hydra/launcher=heisenhunt_slurm cluster=slurm`) on a real one-node SLURM on loopback, side by side
in one run, alternating.

    flock /tmp/heavy.lock python bench/bench_slurm.py [--repeats 1]

SLURM is started for the bench by `scripts/slurm-local.sh` (slurmctld, slurmd and munged on free loopback
ports, in a temporary directory) and stopped after it; it must be installed (`scripts/slurm-local.sh
install`) and the bench run as root. Each run gets free ports, its own work dirs and a fresh sqlite store;
every arm run must end FINISHED. Prints each wall time, the medians and the ratio SLURM / basic.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.conftest import free_port, local_cluster_overrides, seed_mlflow_store  # noqa: E402

SCRIPT = REPO / "scripts" / "slurm-local.sh"
VARIANTS = {
    "basic launcher, cluster=local": [],
    "SLURM launcher, cluster=slurm": ["cluster=slurm", "hydra/launcher=heisenhunt_slurm"],
}


@contextlib.contextmanager
def local_slurm() -> Iterator[dict[str, str]]:
    """A one-node SLURM on loopback for the bench's lifetime; the environment that reaches it."""
    work = Path(tempfile.mkdtemp(prefix="hh-bench-slurm-"))
    env = {**os.environ, "HH_SLURM_DIR": str(work), "HH_SLURM_CTLD_PORT": str(free_port()),
           "HH_SLURM_D_PORT": str(free_port())}  # fmt: skip
    started = time.monotonic()
    done = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"slurm-local.sh start failed:\n{done.stderr}")
    print(f"SLURM up in {time.monotonic() - started:.1f} s", flush=True)
    try:
        yield {**env, "SLURM_CONF": str(work / "slurm.conf")}
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=60)
        subprocess.run(["rm", "-rf", str(work)], capture_output=True)


def one_study(extra: list[str], env: dict[str, str]) -> float:
    """Wall seconds of the default study with `extra` overrides; fails unless every arm run FINISHED."""
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix="hh-bench-slurm-study-") as tmp:
        root = Path(tmp)
        uri = seed_mlflow_store(root / "mlflow.db")
        argv = [sys.executable, "-m", "orchestrator", *local_cluster_overrides(root), f"tracking.uri={uri}",
                f"report.dir={root}/reports", f"hydra.sweep.dir={root}/multirun", *extra]  # fmt: skip
        started = time.monotonic()
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.monotonic() - started
        if done.returncode != 0:
            raise SystemExit(
                f"the study failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name("quick")
        arms = [
            r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags
        ]
        states = sorted(r.info.status for r in arms)
        if not arms or set(states) != {"FINISHED"}:
            raise SystemExit(f"not every arm run FINISHED: {states}")
        return wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="studies per variant, alternating")
    args = ap.parse_args(argv)
    walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with local_slurm() as env:
        for repeat in range(args.repeats):
            for name, extra in VARIANTS.items():
                walls[name].append(one_study(extra, env))
                print(f"repeat {repeat}: {name}: {walls[name][-1]:.1f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in walls.items()}
    basic, slurm = medians.values()
    for name, value in medians.items():
        print(f"median {name}: {value:.1f} s")
    print(f"ratio SLURM / basic: {slurm / basic:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
