"""What the sweep's process costs after its report is written: a small study (two arms of 12 sessions, a
tiny throughput sweep) run by `python -m orchestrator`, which ends without Python's teardown of its
modules (orchestrator/run/fast_exit.py), against the same study run by the same `cli()` ending the usual way,
side by side in one run, alternating.

    flock /tmp/heavy.lock python bench/bench_exit.py [--repeats 3]

Each run gets free ports, its own work dirs and a fresh sqlite store, and must exit 0 with both arm runs
FINISHED. Prints, per run, the wall time of the orchestrator's process and the CPU it and the processes it
reaped used; then the medians and the ratios fast / usual.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.conftest import orchestrator_argv  # noqa: E402

STUDY = [
    "factor/multi_stream=on,off", "repetition=0", "workload.sessions=12", "workload.rounds=2",
    "bench.concurrency=[1,4]", "bench.requests_per_worker=2", "bench.output_len=16", "bench.input_len=64",
]  # fmt: skip
# the same command line and the same `cli()`, ending as Python ends a process
USUAL = ["-c", "import sys; from orchestrator.__main__ import cli; sys.argv[0] = 'orchestrator'; cli()"]
VARIANTS = {"fast exit (python -m orchestrator)": ["-m", "orchestrator"], "usual exit (cli() from -c)": USUAL}


def run_once(entry: list[str]) -> tuple[float, float]:
    """One sweep: (wall s, CPU s of the orchestrator and what it reaped)."""
    with tempfile.TemporaryDirectory(prefix="hh-bench-exit-") as tmp:
        root = Path(tmp)
        argv = orchestrator_argv(root, "-m", *STUDY, entry=entry)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0 or "2 arm runs" not in proc.stdout or "FAILED" in proc.stdout:
            raise SystemExit(f"{entry}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name, entry in VARIANTS.items():
            wall, cpu = run_once(entry)
            results[name].append((wall, cpu))
            print(f"#{repeat} {name}: wall {wall:.2f} s, CPU {cpu:.2f} s", flush=True)
    medians = {
        name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
        for name, runs in results.items()
    }
    for name, (wall, cpu) in medians.items():
        print(f"median {name}: wall {wall:.2f} s, CPU {cpu:.2f} s")
    (fast_wall, fast_cpu), (usual_wall, usual_cpu) = medians.values()
    print(
        f"fast / usual: wall {fast_wall / usual_wall:.3f}x ({usual_wall - fast_wall:+.2f} s per sweep), "
        f"CPU {fast_cpu / usual_cpu:.3f}x ({usual_cpu - fast_cpu:+.2f} s per sweep)"
    )


if __name__ == "__main__":
    main()
