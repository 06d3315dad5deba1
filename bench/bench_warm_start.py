"""What the tests' warm start (tests/warm.py) saves: the same commands started cold (`subprocess.Popen` of
`python -m orchestrator`) and forked from the warm zygote, side by side in one run, alternating.

    flock /tmp/heavy.lock python bench/bench_warm_start.py [--repeats 3]

Two commands: a small study (two arms of 12 sessions, a tiny throughput sweep: the shape of most of the
suite's studies) and a dry run of the dsv4 study (the shape of the suite's refusals, dry runs and help
pages). Each run gets free ports, its own work dirs and a fresh sqlite store, and must exit 0. CPU is that
of every process the run started (the orchestrator, its servers, its host checks), read from a cgroup this
bench puts itself in (`cpuacct`, cgroup v1, or cgroup v2's `cpu.stat`; root only: without one it prints
wall time alone). The zygote's own start is measured once and printed apart: a test process pays it once.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests import warm  # noqa: E402
from tests.conftest import orchestrator_argv  # noqa: E402

STUDY = [
    "-m", "factor/multi_stream=on,off", "repetition=0", "workload.sessions=12", "workload.rounds=2",
    "bench.concurrency=[1,4]", "bench.requests_per_worker=2", "bench.output_len=16", "bench.input_len=64",
]  # fmt: skip
DRY_RUN = ["-m", "+experiment=dsv4_corruption", "dry_run=true"]
COMMANDS = {"small study": STUDY, "dry run (dsv4)": DRY_RUN}
VARIANTS = ("cold", "warm")


def cgroup_cpu() -> Callable[[], float] | None:
    """Put this process (and so all it starts from now) in a cgroup of its own; its CPU seconds so far,
    or None where no cgroup can be made."""
    name = f"hh-bench-warm-{os.getpid()}"
    for root, usage in (("/sys/fs/cgroup/cpuacct", "cpuacct.usage"), ("/sys/fs/cgroup", "cpu.stat")):
        group = Path(root) / name
        try:
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            continue
        if usage == "cpuacct.usage":
            return lambda: int((group / usage).read_text()) / 1e9
        return lambda: int((group / usage).read_text().split()[1]) / 1e6  # usage_usec
    return None


def run_once(variant: str, args: list[str], cpu: Callable[[], float] | None) -> tuple[float, float | None]:
    """One command, cold or warm: (wall s, CPU s of everything it started, None without a cgroup)."""
    os.environ[warm.COLD_ENV] = "1" if variant == "cold" else "0"
    with tempfile.TemporaryDirectory(prefix="hh-bench-warm-") as tmp:
        root = Path(tmp)
        argv = orchestrator_argv(root, *args)
        before, started = (cpu() if cpu else None), time.monotonic()
        proc = warm.run(argv, cwd=root, capture_output=True, text=True, timeout=600)
        wall = time.monotonic() - started
        time.sleep(0.5)  # the servers' last moments after the sweep's teardown
        after = cpu() if cpu else None
        if proc.returncode != 0:
            raise SystemExit(
                f"{variant} {args}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        return wall, (after - before if cpu else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    cpu = cgroup_cpu()
    if cpu is None:
        print("no cgroup could be made (not root?): wall time only")
    before, started = (cpu() if cpu else None), time.monotonic()
    if not warm.zygote().ready():
        raise SystemExit("the zygote did not start")
    zygote_cpu = f", {cpu() - before:.2f} CPU-s" if cpu else ""
    print(f"zygote start: {time.monotonic() - started:.2f} s{zygote_cpu} (once per test process)")
    results: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
    for rep in range(repeats):
        for name, args in COMMANDS.items():
            for variant in VARIANTS if rep % 2 == 0 else reversed(VARIANTS):
                wall, used = run_once(variant, args, cpu)
                results.setdefault((name, variant), []).append((wall, used))
                shown = f", {used:.2f} CPU-s" if used is not None else ""
                print(f"  {name}, {variant}: {wall:.2f} s{shown}", flush=True)
    print("\nmedians (warm / cold):")
    for name in COMMANDS:
        med = {
            v: (
                statistics.median(w for w, _ in results[(name, v)]),
                statistics.median(c for _, c in results[(name, v)]) if cpu else None,
            )
            for v in VARIANTS
        }
        (cold_wall, cold_cpu), (warm_wall, warm_cpu) = med["cold"], med["warm"]
        line = f"  {name}: wall {cold_wall:.2f} s cold, {warm_wall:.2f} s warm ({warm_wall / cold_wall:.2f})"
        if cpu:
            line += f"; CPU {cold_cpu:.2f} s cold, {warm_cpu:.2f} s warm ({warm_cpu / cold_cpu:.2f})"
        print(line)


if __name__ == "__main__":
    main()
