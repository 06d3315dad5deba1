"""How fast is the stress client? Today's client (from git) and this tree's, side by side, in CPU per turn.

Starts the simulated server with no modelled latency (HEISENHUNT_SIM_TIME_SCALE=0, eager: no faults),
extracts today's client from git (`git archive <rev> orchestrator`, default 3d03c97, into a temporary
directory: no old code in the repo) and runs the real stress workload of each client in a subprocess of
its own (PYTHONPATH=<that tree>, `python -P`, so the child imports exactly that tree's `orchestrator`)
against the same server, at each level of concurrent sessions (100 and 1,000 by default), interleaved
and repeated (the median is shown: a shared host drifts). Both are driven through what both
revisions have: `StressSettings(url, out_dir, sessions, rounds, model, timeout_s, progress=False)` and
`run_stress_sync` (the current tree's runs on uvloop where installed; the row "this tree, asyncio"
is the same code on asyncio's own loop, HEISENHUNT_UVLOOP=0).

The figure is CPU time of the client process (`time.process_time()` around `run_stress_sync`; imports
and start-up are outside it), which a busy host disturbs far less than wall time:

    CPU ms/turn        = client CPU / turns
    turns/s per core   = turns / client CPU      (what one core of client sustains)
    ratio              = this tree's turns/s per core / today's

Every run must lose nothing: each planned session has an outcome and, against the healthy sim, every
session is clean (the script exits 1 otherwise). It also replays one recorded turn through each
revision's SSE parser and oracle in a loop (one event per piece, and in 64-byte pieces): the client's
own ceiling per core, without any HTTP.

    python bench/bench_stress_client.py [--levels 100,1000] [--rounds 2] [--repeat 5] [--old-rev 3d03c97]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OLD_REV = "3d03c97"  # the client before issue 17 part 5 (its parent 24798de has the same client)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sim(transport, work: Path, extra_args: list[str]) -> tuple[int, str]:
    from orchestrator.sim.launch import server_launch, wait_healthy

    launch = server_launch(free_port(), time_scale=0, flags=["--disable-decode-cuda-graph", *extra_args])
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
    from orchestrator.workload.client import chat_payload, open_session, stream_chat
    from orchestrator.workload.tasks import TOOLS, initial_messages, make_task

    task = make_task(0, 0, 4)
    async with open_session(1) as http:
        turn = await stream_chat(http, url, chat_payload("m", initial_messages(task), TOOLS), 30.0)
    return turn.raw


# --- the child: one revision's client, one measurement, a JSON line on stdout -----------------------


def child_replay(raw: bytes, seconds: float) -> dict:
    """Turns/s of SSE parsing + oracle on one core, fed one event per piece (as servers send them) and
    in 64-byte pieces (a pessimistic chunking)."""
    try:  # this tree: the parser has a module of its own
        from orchestrator.workload.sse import SSEParser
    except ImportError:  # an older revision's client.py holds it
        from orchestrator.workload.client import SSEParser
    from orchestrator.workload.detect import check_turn
    from orchestrator.workload.tasks import make_task

    task = make_task(0, 0, 4)
    result = {}
    chunkings = {
        "events": [e + b"\n\n" for e in raw.split(b"\n\n") if e],
        "64B": [raw[i : i + 64] for i in range(0, len(raw), 64)],
    }
    for name, pieces in chunkings.items():
        n, start = 0, time.process_time()
        while time.process_time() - start < seconds / 2:
            parser = SSEParser()
            for piece in pieces:
                parser.feed(piece, 0.0)
            assert check_turn(parser.finish(0.0), task.expected(0), check_plan=True) is None
            n += 1
        result[name] = n / (time.process_time() - start)
    return result


def child_stress(url: str, sessions: int, rounds: int, out: Path) -> dict:
    from orchestrator.workload.stress import StressSettings, run_stress_sync

    settings = StressSettings(
        url=url, out_dir=out, sessions=sessions, rounds=rounds, model="m", timeout_s=300.0, progress=False
    )
    cpu0, wall0 = time.process_time(), time.monotonic()
    summary = run_stress_sync(settings)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    turns = sum(len(json.loads(line)["turn_latency_s"]) for line in (out / "sessions.jsonl").open())
    return {
        "turns": turns,
        "cpu_s": cpu,
        "wall_s": wall,
        "sessions": summary.sessions,
        "planned": summary.planned,
        "clean": summary.clean,
        "corrupted": summary.corrupted,
        "errored": summary.errored,
    }


def child_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING)
    import orchestrator

    if args.replay:
        result = child_replay(Path(args.replay).read_bytes(), args.seconds)
    else:
        result = child_stress(args.url, args.sessions, args.rounds, Path(args.out))
    result["orchestrator"] = str(Path(orchestrator.__file__).resolve().parent)
    print(json.dumps(result))
    return 0


# --- the parent -------------------------------------------------------------------------------------


class Client:
    """One revision's client: its tree (PYTHONPATH) and the environment its child runs in."""

    def __init__(self, label: str, tree: Path, env: dict[str, str] | None = None):
        self.label, self.tree, self.env = label, tree, env or {}

    def run(self, *child_args: str) -> dict:
        env = {**os.environ, "PYTHONPATH": str(self.tree), **self.env}
        argv = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", *child_args]
        done = subprocess.run(argv, env=env, cwd=self.tree, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"{self.label}: the child failed ({done.returncode}):\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        expected = (self.tree / "orchestrator").resolve()
        if Path(result["orchestrator"]) != expected:  # the child must run the tree it was given
            raise RuntimeError(f"{self.label}: the child imported {result['orchestrator']}, not {expected}")
        return result


def extract(rev: str, into: Path) -> Path:
    """`git archive rev orchestrator` unpacked under `into`; the tree's root."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "orchestrator"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="100,1000", help="concurrent sessions per level")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="runs per client and level (median shown)")
    parser.add_argument("--old-rev", default=DEFAULT_OLD_REV, help="git revision of today's client")
    parser.add_argument("--no-asyncio-row", action="store_true", help="skip this tree on asyncio's loop")
    # the child's side
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--sessions", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)

    sys.path.insert(0, str(REPO))
    from orchestrator.remote.local import LocalTransport

    logging.basicConfig(level=logging.WARNING)
    levels = [int(x) for x in args.levels.split(",")]
    transport = LocalTransport()
    lost = failed = 0
    with tempfile.TemporaryDirectory(prefix="bench-stress-") as tmp:
        work = Path(tmp)
        old = Client(f"today ({args.old_rev})", extract(args.old_rev, work / "old"))
        clients = [old, Client("this tree", REPO)]
        if not args.no_asyncio_row:
            clients.append(Client("this tree, asyncio", REPO, {"HEISENHUNT_UVLOOP": "0"}))
        pid, url = start_sim(transport, work, [])
        try:
            raw = asyncio.run(record_turn(url))
            (work / "turn.sse").write_bytes(raw)
            replay = {c.label: c.run("--replay", str(work / "turn.sse")) for c in clients}
            print(f"parser+oracle replay of one recorded turn ({len(raw)} B), turns/s per core:")
            print(f"  {'':<22} {'one event per piece':>21} {'64-byte pieces':>19}")
            for c in clients:
                cells = [
                    f"{replay[c.label][k]:>9,.0f} ({replay[c.label][k] / replay[old.label][k]:.2f}x)"
                    for k in ("events", "64B")
                ]
                print(f"  {c.label:<22} {cells[0]:>21} {cells[1]:>19}")
            print(
                f"\nstress workload, {args.rounds} rounds per session, median of {args.repeat} "
                f"(client CPU = time.process_time of the client process)"
            )
            print(
                f"{'sessions':>8}  {'client':<22} {'turns':>6} {'CPU ms/turn':>11} {'turns/s/core':>12} "
                f"{'ratio':>6} {'wall s':>7} {'CPU share':>9}  outcomes"
            )
            for sessions in levels:
                runs: dict[str, list[dict]] = {c.label: [] for c in clients}
                for i in range(args.repeat):  # interleaved: drift of the host hits every client alike
                    for c in clients:
                        out = work / f"run-{sessions}-{len(runs[c.label])}-{clients.index(c)}-{i}"
                        runs[c.label].append(
                            c.run("--url", url, "--sessions", str(sessions), "--rounds", str(args.rounds),
                                  "--out", str(out))
                        )  # fmt: skip
                base = None
                for c in clients:
                    rs = runs[c.label]
                    ms = statistics.median(1e3 * r["cpu_s"] / max(1, r["turns"]) for r in rs)
                    per_core = 1e3 / ms
                    base = base or per_core
                    wall = statistics.median(r["wall_s"] for r in rs)
                    share = statistics.median(r["cpu_s"] / r["wall_s"] for r in rs)
                    missing = sum(r["planned"] - r["sessions"] for r in rs)
                    unclean = [r for r in rs if r["clean"] != r["planned"]]
                    lost += missing
                    failed += len(unclean)
                    outcome = (
                        f"{rs[-1]['sessions']}/{rs[-1]['planned']} with an outcome, clean {rs[-1]['clean']}, "
                        f"lost {missing}"
                    )
                    if unclean:
                        counts = [(r["clean"], r["corrupted"], r["errored"]) for r in unclean]
                        outcome += f"; NOT ALL CLEAN (clean, corrupted, errored): {counts}"
                    print(
                        f"{sessions:>8}  {c.label:<22} {rs[-1]['turns']:>6} {ms:>11.3f} {per_core:>12,.0f} "
                        f"{per_core / base:>5.2f}x {wall:>7.2f} {share:>9.0%}  {outcome}"
                    )
        finally:
            transport.stop_group(pid)
    print(f"\nlost outcomes: {lost}; runs with a session not clean: {failed}")
    return 1 if lost or failed else 0


if __name__ == "__main__":
    sys.exit(main())
