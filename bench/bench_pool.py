"""Wall time of one sweep run serially on one cluster against the same sweep in parallel on a pool of two,
side by side in one run, on the embedded default (real sim servers and routers on loopback).

    flock /tmp/heavy.lock timeout 2400 python bench/bench_pool.py [--study NAME] [--sessions N]
        [--time-scale X] [--before DIR] [--repeat R]

Default sweep: `+experiment=dsv4_corruption` (5 arms x 4 starts = 20 jobs) with its throughput sweep off
and N sessions per start (default 80). Serial: Hydra's basic launcher on `cluster=local`. Parallel:
`hydra/launcher=heisenhunt_ray cluster_pool=local2`, twice: the launcher starting its own Ray on this
machine (Ray's start-up counted), and joined to a Ray head already running on loopback (as a team's
long-lived Ray cluster; its start-up not counted). Each into a fresh MLflow store; prints each wall time,
the ratios, and checks that every job FINISHED.

Where the CPU went: the machine's CPU time in each run (/proc/stat), and how much of it each kind of
process took (sampled from /proc every second: the sim servers, the routers, the jobs in Ray's workers,
Ray itself, the driver, "other"; what lived under a second is "unsampled"). A parallel run cannot end
sooner than its CPU time over the cores: that floor, next to the ratio, says whether the cores are what
limit it.

`--before DIR`: the same setups run with the code of DIR too (e.g. `git archive <commit> | tar -x -C DIR`),
each with its own serial run, so that the ratios before and after a change come from one run.

`--repeat R`: every setup R times, interleaved (serial, pools, serial, pools, ...), each ratio taken
against the serial run of its own repetition; prints each setup's median ratio and its range. Identical
sweeps on a 2-core machine differ by 10% in wall time: one run's ratio says little about a difference of
a few hundredths.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' loopback Ray head
from tests.conftest import sim_clock
from tests.pool.ray_head import RAY_ENV, local_ray_head

POOL = ["hydra/launcher=heisenhunt_ray", "cluster_pool=local2"]
HERE = str(Path(__file__).resolve().parents[1])
# what a process is, from its command line (the first that matches; the rest is "other")
KINDS = (
    ("sim servers", ("orchestrator.sim.server",)),
    ("routers", ("sglang::router", "orchestrator.sim.router")),
    ("host checks", ("orchestrator.sim.check", "The host side of the preflight")),
    ("Ray itself", ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "/ray/", "ray start", "gcs_server")),
    ("jobs in Ray's workers", ("ray::",)),
    ("driver", ("-m orchestrator ",)),
)  # other: the rest (the system's own processes, kernel threads)
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_cpu_s() -> float:
    """CPU seconds the machine's cores have been busy since boot (every process), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split(maxsplit=9)[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / TICK


def kind_of(cmdline: str) -> str:
    return next((kind for kind, marks in KINDS if any(m in cmdline for m in marks)), "other")


def processes() -> dict[tuple[int, str], tuple[str, float]]:
    """(pid, start) -> (kind, CPU seconds so far) of every process now."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # fields 14, 15 and 22 of stat (utime, stime, starttime), counted after the command's ")"
        found[(int(proc.name), stat[19])] = (kind_of(cmdline), (int(stat[11]) + int(stat[12])) / TICK)
    return found


def merge(seen: dict, now: dict) -> None:
    """Each process's latest CPU time into `seen`, under the kind it was first known by: an exiting
    process (a zombie) shows no command line, and would end up as "other"."""
    for key, (kind, cpu) in now.items():
        known = seen.get(key, (kind,))[0]
        seen[key] = (known if kind == "other" else kind, cpu)


@contextmanager
def cpu_by_kind(every_s: float = 1.0) -> Iterator[dict[str, float]]:
    """CPU seconds per kind of process while the block runs, and the machine's ("machine"), filled in
    at the end."""
    out: dict[str, float] = {}
    before, seen = processes(), {}
    machine = machine_cpu_s()
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            merge(seen, processes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        stop.set()
        sampler.join()
        merge(seen, processes())
        for key, (kind, cpu) in seen.items():
            out[kind] = out.get(kind, 0.0) + cpu - before.get(key, (kind, 0.0))[1]
        out["machine"] = machine_cpu_s() - machine
        out["unsampled"] = out["machine"] - sum(v for k, v in out.items() if k != "machine")


@contextmanager
def python_path(code: str) -> Iterator[None]:
    """PYTHONPATH=code for what starts in the block: the Ray head's workers import the jobs' code from it
    (with the head's own environment, they would import whichever heisenhunt is installed)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = code
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def run(extra: list[str], sweep: list[str], tmp: Path, code: str) -> tuple[float, dict, list[str], dict]:
    argv = [
        sys.executable, "-m", "orchestrator", *sweep, *extra,
        f"tracking.uri=sqlite:///{tmp}/m.db", f"hydra.sweep.dir={tmp}/multirun", f"report.dir={tmp}/reports",
    ]  # fmt: skip
    env = {**os.environ, **RAY_ENV, "PYTHONPATH": code}
    started = time.monotonic()
    with cpu_by_kind() as cpu:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp, env=env)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(extra) or 'serial'} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    report = json.loads(next((tmp / "reports").glob("*/report.json")).read_text())
    client = mlflow.MlflowClient(f"sqlite:///{tmp}/m.db")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    statuses = [r.info.status for r in runs if r.data.tags.get("heisenhunt.kind") == "arm"]
    return wall, report, statuses, cpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--study", default="dsv4_corruption")
    parser.add_argument("--sessions", type=int, default=80)
    # the sim's clock (HEISENHUNT_SIM_TIME_SCALE): 1.0 is the modelled hardware's own (model loads and
    # decode steps as long as on the GPUs modelled); the shipped 0.2 runs five times faster
    parser.add_argument("--time-scale", type=float, default=None)
    parser.add_argument("--before", help="a checkout to run the same setups with, for a before/after")
    parser.add_argument("--repeat", type=int, default=1, help="every setup this many times, interleaved")
    args = parser.parse_args()
    sweep = [f"workload.sessions={args.sessions}", "bench.enabled=false"]
    if args.study != "quick":  # quick: the default study, `python -m orchestrator` with no experiment
        sweep.insert(0, f"+experiment={args.study}")
    if args.time_scale is not None:
        sweep += sim_clock(args.time_scale)
    cores = os.cpu_count() or 1
    print(f"sweep: python -m orchestrator {' '.join(sweep)}  ({cores} CPUs seen)")
    codes = {"": HERE} if not args.before else {"before: ": str(Path(args.before).resolve()), "after: ": HERE}

    def measure(name: str, extra: list[str], code: str) -> float:
        with tempfile.TemporaryDirectory() as tmp:
            wall, report, statuses, cpu = run(extra, sweep, Path(tmp), code)
        assert statuses and set(statuses) == {"FINISHED"}, statuses
        verdicts = {h["id"]: h["verdict"] for h in report["hypotheses"]}
        print(f"{name}: {len(statuses)} jobs FINISHED in {wall:.1f} s; verdicts {verdicts}", flush=True)
        machine = cpu.pop("machine")
        kinds = ", ".join(f"{kind} {s:.0f}" for kind, s in sorted(cpu.items(), key=lambda kv: -kv[1]))
        print(
            f"  CPU: the machine's {machine:.0f} s ({machine / wall:.2f} of {cores} cores busy; "
            f"{machine / len(statuses):.1f} s per job): {kinds}; its floor on {cores} cores "
            f"{machine / cores:.0f} s",
            flush=True,
        )
        return wall

    ratios: dict[str, list[float]] = {}
    for rep in range(args.repeat):
        suffix = f" (repetition {rep + 1} of {args.repeat})" if args.repeat > 1 else ""
        for label, code in codes.items():
            serial = measure(f"{label}serial, one cluster (basic launcher){suffix}", [], code)
            own_ray = f"{label}parallel, pool of two, Ray started by the launcher"
            running = f"{label}parallel, pool of two, Ray head already running"
            pools = {own_ray: measure(own_ray + suffix, POOL, code)}
            with python_path(code), local_ray_head(free_port) as address:
                joined = [*POOL, f"hydra.launcher.ray.init.address={address}"]
                pools[running] = measure(running + suffix, joined, code)
            for name, wall in pools.items():
                ratios.setdefault(name, []).append(wall / serial)
    for name, values in ratios.items():
        spread = f" (median of {len(values)}: {min(values):.2f}-{max(values):.2f})" if len(values) > 1 else ""
        print(f"wall-time ratio, {name} / serial: {statistics.median(values):.2f}{spread}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
