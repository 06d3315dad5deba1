"""`python -m orchestrator.sim.up`: the PD sim by hand, for the standalone tools, and nothing left after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from orchestrator.workload.stress import StressSettings, run_stress_sync
from tests.conftest import free_port


def _free_run_of_ports(count: int = 5) -> int:
    """A base port with `count` free ports from it (the router's and the four after it), below the
    ephemeral range (conftest.free_port): a port there is never the local port of an outgoing
    connection, which no connect() check sees but which makes the bind fail."""
    for _ in range(50):
        base = free_port()
        if all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError("no run of free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _start(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator.sim.up", "--port", str(port), "--time-scale", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # SIGINT as a terminal sends it, also when pytest itself runs in the background (ignored SIGINT
        # would be inherited)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_the_sim_comes_up_serves_the_stress_tool_and_stops_on_ctrl_c(tmp_path):
    # five ports in a row: another test's server may take one between the check and the bind; try again
    for _ in range(3):
        port = _free_run_of_ports()
        proc = _start(port)
        line = proc.stdout.readline()
        if "PD sim up" in line:
            break
        line += proc.stdout.read()  # it failed to start and is exiting: why?
        proc.wait()
        if "address already in use" not in line:
            break
    try:
        assert f"router http://127.0.0.1:{port}" in line, line
        children = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 3
        settings = StressSettings(
            url=f"http://127.0.0.1:{port}", out_dir=tmp_path / "stress", sessions=6, rounds=2, progress=False
        )
        summary = run_stress_sync(settings)
        assert summary.sessions == 6 and summary.errored == 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_alive(int(pid)) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(int(pid)) for pid in children)
        assert all(_free(port + i) for i in range(3))
    finally:
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
