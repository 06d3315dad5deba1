"""A liveness look at a running server, side by side: the look as the transports run it (the leader's
/proc/PID/stat settles it) against the whole look (`kill -0`, `ps -e` of every process, the leader's
start, `kill -0` again), on a host with few processes and on one with many (sleeping processes stand in
for a busy GPU node's). CPU milliseconds per look (the shell and what it ran, RUSAGE_CHILDREN) and wall
milliseconds, interleaved, medians of the rounds.

    python bench/bench_liveness_look.py [--looks 200] [--rounds 5] [--crowd 0,1000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.remote.base import liveness_command, parse_group_look, whole_look_command


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cost(command: str, looks: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per run of `command` in `sh -c`, as LocalTransport runs a look."""
    cpu, wall = children_cpu_s(), time.perf_counter()
    for _ in range(looks):
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
        parse_group_look(out)
    return (children_cpu_s() - cpu) / looks * 1e3, (time.perf_counter() - wall) / looks * 1e3


@contextlib.contextmanager
def crowd(n: int) -> Iterator[None]:
    """`n` sleeping processes more on this host, for the block."""
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--looks", type=int, default=200, help="looks per round and kind")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--crowd", default="0,1000", help="extra processes on the host, per line")
    args = parser.parse_args(argv)
    server = subprocess.Popen(["sleep", "3600"], start_new_session=True)  # a running leader
    try:
        print(f"{'processes':>9} {'look':<22} {'CPU ms':>7} {'wall ms':>8}  ratio (CPU)")
        for extra in (int(n) for n in args.crowd.split(",")):
            with crowd(extra):
                total = len([p for p in os.listdir("/proc") if p.isdigit()])
                kinds = {"as run (leader seen)": liveness_command, "whole look": whole_look_command}
                figures: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
                for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
                    for kind, command in kinds.items():
                        figures[kind].append(cost(command(server.pid), args.looks))
                med = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v))
                       for k, v in figures.items()}  # fmt: skip
                whole_cpu = med["whole look"][0]
                for kind, (cpu, wall) in med.items():
                    print(f"{total:>9} {kind:<22} {cpu:>7.2f} {wall:>8.2f}  {cpu / whole_cpu:.2f}")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
