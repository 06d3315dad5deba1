"""What does one command over SSH cost? A session per command vs the persistent shell, side by side.

Starts a private sshd on 127.0.0.1 with `scripts/ci-ssh-setup.sh start` (own keys and known_hosts, in
a temporary directory; your ~/.ssh is not touched), opens two SSH transports to it, one per path,
and times the same commands through each: `true`, and `is_alive(pid)` (the `ps` line the deployment
polls while it waits for a server). The old path (`ssh.persistent_shell: false`) opens a session per
command, so the server starts the login shell every time (bash reads ~/.bashrc under sshd); the new
path writes each command to one long-lived `sh`. Each transport's connection and first command are
made before timing. The two paths alternate in rounds, so a slow spell of the shared machine hits both.

    python bench/bench_ssh_latency.py [--commands 40] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from orchestrator.remote import make_transport
from orchestrator.remote.base import Transport

SETUP = Path(__file__).resolve().parent.parent / "scripts" / "ci-ssh-setup.sh"


def start_sshd(directory: str) -> dict[str, str]:
    """The HH_SSH_* settings the setup script prints for the sshd it started."""
    env = {**os.environ, "HH_SSHD_DIR": directory}
    out = subprocess.run([str(SETUP), "start"], env=env, check=True, capture_output=True, text=True).stdout
    settings = {}
    for line in out.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        settings[name] = value
    return settings


def stop_sshd(directory: str) -> None:
    subprocess.run([str(SETUP), "stop"], env={**os.environ, "HH_SSHD_DIR": directory}, check=False)


def host_config(settings: dict[str, str], persistent_shell: bool) -> dict:
    return {
        "transport": "ssh",
        "address": "127.0.0.1",
        "ssh": {
            "user": settings["HH_SSH_USER"],
            "port": int(settings["HH_SSH_PORT"]),
            "key_file": settings["HH_SSH_KEY_FILE"],
            "known_hosts": settings["HH_SSH_KNOWN_HOSTS"],
            "config_file": settings["HH_SSH_CONFIG"],
            "persistent_shell": persistent_shell,
        },
    }


def time_calls(call: Callable[[], object], n: int) -> list[float]:
    """Seconds per call, each timed on its own."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def summary_ms(times: list[float]) -> tuple[float, float, float]:
    """(median, p90, mean) in ms."""
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return statistics.median(ordered) * 1e3, p90 * 1e3, statistics.fmean(ordered) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", type=int, default=40, help="commands per path, command and round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="hh-bench-sshd-") as directory:
        settings = start_sshd(directory)
        try:
            paths: dict[str, Transport] = {
                "session per command": make_transport(host_config(settings, persistent_shell=False)),
                "persistent shell": make_transport(host_config(settings, persistent_shell=True)),
            }
            my_pid = os.getpid()
            commands: dict[str, Callable[[Transport], object]] = {
                "true": lambda t: t.run_shell("true"),
                "is_alive(pid)": lambda t: t.is_alive(my_pid),
            }
            times: dict[tuple[str, str], list[float]] = {(p, c): [] for p in paths for c in commands}
            try:
                for t in paths.values():
                    t.run_shell("true")  # connect, and start the persistent shell, before timing
                for _ in range(args.rounds):
                    for path, t in paths.items():
                        for name, command in commands.items():
                            times[path, name] += time_calls(
                                lambda t=t, command=command: command(t), args.commands
                            )
                for t in paths.values():
                    assert t.connects == 1, "a connection was reopened during the benchmark"
            finally:
                for t in paths.values():
                    t.close()
        finally:
            stop_sshd(directory)

    login = subprocess.run(
        ["sh", "-c", 'getent passwd "$(id -un)" | cut -d: -f7'], capture_output=True, text=True
    )
    n = args.commands * args.rounds
    print(f"SSH to 127.0.0.1, login shell {login.stdout.strip() or '?'}, {n} commands per cell")
    print(f"{'command':<15} {'path':<21} {'median ms':>10} {'p90 ms':>8} {'mean ms':>8}")
    for name in commands:
        for path in paths:
            median, p90, mean = summary_ms(times[path, name])
            print(f"{name:<15} {path:<21} {median:>10.2f} {p90:>8.2f} {mean:>8.2f}")
        old = summary_ms(times["session per command", name])[0]
        new = summary_ms(times["persistent shell", name])[0]
        print(f"{name:<15} {'ratio (old / new)':<21} {old / new:>10.1f}x")


if __name__ == "__main__":
    main()
