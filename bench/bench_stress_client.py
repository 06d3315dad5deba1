"""How fast is the stress client? Sustained turns/s and client CPU per turn against a zero-latency endpoint.

Starts the simulated server with no modelled latency (HEISENHUNT_SIM_TIME_SCALE=0, eager: no faults),
runs the real stress workload against it at a few concurrency levels (1,000 concurrent sessions
included) and prints, per level: turns/s, the client's CPU per turn (this process only; the server
is another process) and the client's CPU share of wall time. A client CPU share well below one core
at the top level means the client is not the bottleneck (the shared machine's server is).

It also replays one recorded turn through the SSE parser and the oracle in a loop: the client's own
ceiling in turns/s per core, independent of any server.

    python bench/bench_stress_client.py [--levels 100,1000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import server_launch, wait_healthy
from orchestrator.workload.client import SSEParser, chat_payload, open_session, stream_chat
from orchestrator.workload.detect import check_turn
from orchestrator.workload.stress import StressSettings, run_stress
from orchestrator.workload.tasks import TOOLS, initial_messages, make_task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(transport: LocalTransport, work: Path, extra_args: list[str]) -> tuple[int, str]:
    launch = server_launch(free_port(), time_scale=0, flags=["--disable-cuda-graph", *extra_args])
    pid = transport.start_detached(launch.argv, launch.env, str(work / "sim.log"), str(work / "sim.pid"))
    try:
        wait_healthy(
            launch.url, timeout_s=60, log_tail=lambda: transport.read_text_tail(str(work / "sim.log"))
        )
    except RuntimeError:
        transport.stop_group(pid)
        raise
    return pid, launch.url


async def record_turn(url: str) -> bytes:
    task = make_task(0, 0, 4)
    async with open_session(1) as http:
        turn = await stream_chat(http, url, chat_payload("m", initial_messages(task), TOOLS), 30.0)
    return turn.raw


def replay(raw: bytes, seconds: float = 2.0) -> float:
    """Turns/s of SSE parsing + oracle on one core, fed in 64-byte pieces (a pessimistic chunking)."""
    task = make_task(0, 0, 4)
    pieces = [raw[i : i + 64] for i in range(0, len(raw), 64)]
    n, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        parser = SSEParser()
        for piece in pieces:
            parser.feed(piece, 0.0)
        assert check_turn(parser.finish(0.0), task.expected(0), check_plan=True) is None
        n += 1
    return n / (time.process_time() - start)


async def level(url: str, sessions: int, rounds: int, out: Path) -> dict[str, float]:
    cpu0, wall0 = time.process_time(), time.monotonic()
    settings = StressSettings(
        url=url, out_dir=out, sessions=sessions, rounds=rounds, model="m", timeout_s=300.0, progress=False
    )
    summary = await run_stress(settings)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    turns = sum(len(json.loads(line)["turn_latency_s"]) for line in (out / "sessions.jsonl").open())
    return {
        "sessions": sessions,
        "turns": turns,
        "wall_s": wall,
        "turns_s": turns / wall,
        "cpu_ms_turn": 1000 * cpu / max(1, turns),
        "cpu_share": cpu / wall,
        "clean": summary.clean,
        "corrupted": summary.corrupted,
        "errored": summary.errored,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="100,1000", help="concurrent sessions per level")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    transport = LocalTransport()
    with tempfile.TemporaryDirectory(prefix="bench-stress-") as tmp:
        work = Path(tmp)
        pid, url = start_sim(transport, work, [])
        try:
            raw = asyncio.run(record_turn(url))
            print(f"parser+oracle replay: {replay(raw):,.0f} turns/s per core ({len(raw)} B per turn)")
            print(
                f"{'sessions':>8} {'turns':>6} {'wall s':>7} {'turns/s':>8} {'CPU ms/turn':>11} "
                f"{'client CPU':>10}  outcome"
            )
            for sessions in (int(x) for x in args.levels.split(",")):
                r = asyncio.run(level(url, sessions, args.rounds, work / f"run{sessions}"))
                print(
                    f"{r['sessions']:>8} {r['turns']:>6} {r['wall_s']:>7.2f} {r['turns_s']:>8.0f} "
                    f"{r['cpu_ms_turn']:>11.3f} {r['cpu_share']:>9.0%}  "
                    f"clean {r['clean']} corrupted {r['corrupted']} errored {r['errored']}"
                )
        finally:
            transport.stop_group(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
