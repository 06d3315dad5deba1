"""`python -m orchestrator.sim.up`: the embedded default by hand, for the standalone tools.

Starts a simulated prefill and decode behind the real sglang-router on loopback, in the foreground, prints
the router's URL and the commands that use it, and stops all three on Ctrl-C (or SIGTERM, or when one of
them exits). The processes are this command's children: nothing outlives it.

    python -m orchestrator.sim.up --port 8000
    python -m orchestrator.workload.stress --url http://127.0.0.1:8000 --sessions 60 --out out/stress
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from orchestrator.sim.launch import Launch, router_launch, server_launch, wait_healthy


def launches(port: int, time_scale: str, fault_model: str | None) -> dict[str, Launch]:
    """The three processes of a PD deployment on loopback, on `port` and the four ports after it."""
    prefill = server_launch(
        port + 1, mode="prefill", bootstrap_port=port + 3, time_scale=time_scale, fault_model=fault_model
    )
    decode = server_launch(port + 2, mode="decode", time_scale=time_scale, fault_model=fault_model)
    router = router_launch(
        port, prefill_url=prefill.url, bootstrap_port=port + 3, decode_url=decode.url, metrics_port=port + 4
    )
    return {"prefill": prefill, "decode": decode, "router": router}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.sim.up", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="the router's port; the servers take the next 4"
    )
    parser.add_argument("--time-scale", default="0.2", help="the sim's clock (tok/s scale by 1/x)")
    parser.add_argument("--fault-model", default=None, help="a fault-model YAML (default: the built-in one)")
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="heisenhunt-sim-"))
    procs: dict[str, subprocess.Popen] = {}

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for role, launch in launches(args.port, args.time_scale, args.fault_model).items():
            log = (logs / f"{role}.log").open("w")
            env = {**os.environ, **launch.env}
            procs[role] = subprocess.Popen(launch.argv, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_healthy(
                launch.url,
                alive=lambda p=procs[role]: p.poll() is None,
                log_tail=lambda path=logs / f"{role}.log": path.read_text()[-2000:],
                name=role,
            )
        url = f"http://127.0.0.1:{args.port}"
        print(f"PD sim up: router {url} (logs in {logs}); Ctrl-C stops it", flush=True)
        print(
            f"  python -m orchestrator.workload.stress --url {url} --sessions 60 --rounds 4 --out out/stress"
        )
        print(
            f"  python -m orchestrator.workload.bench --url {url} --concurrency 1,8,32 --out out/bench",
            flush=True,
        )
        while all(p.poll() is None for p in procs.values()):
            time.sleep(0.5)
        gone = next(role for role, p in procs.items() if p.poll() is not None)
        print(f"{gone} exited ({procs[gone].returncode}); stopping the others; see {logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for p in reversed(list(procs.values())):
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    sys.exit(main())
