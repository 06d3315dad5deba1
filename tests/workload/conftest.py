"""Fixtures for the workload tests: the simulated SGLang server as a real process on loopback.

Started through `LocalTransport.start_detached` (its own process group) and always stopped with
`stop_group` in a `finally`, so no test leaves a server behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import server_launch, wait_healthy
from tests.conftest import free_port

# a server with no fault rule matching: eager decode (the built-in model needs captured graphs)
HEALTHY_ARGS = ("--disable-cuda-graph",)


@pytest.fixture
def unused_port() -> int:
    """A loopback port nothing listens on (just released by the OS)."""
    return free_port()


@dataclass
class SimServer:
    url: str
    port: int
    pid: int
    log_path: Path
    transport: LocalTransport

    def stop(self, grace_s: float = 5.0) -> None:
        self.transport.stop_group(self.pid, grace_s=grace_s)

    def log_tail(self) -> str:
        return self.transport.read_text_tail(str(self.log_path), 4000)


@pytest.fixture
def start_sim(tmp_path: Path) -> Iterator[Callable[..., SimServer]]:
    """start_sim(args=HEALTHY_ARGS, env={}, time_scale=0.0) -> a healthy SimServer; all stopped after."""
    transport = LocalTransport()
    started: list[SimServer] = []

    def _start(
        args: Sequence[str] = HEALTHY_ARGS, env: Mapping[str, str] | None = None, time_scale: float = 0.0
    ) -> SimServer:
        port = free_port()
        n = len(started)
        log_path, pid_path = tmp_path / f"sim{n}.log", tmp_path / f"sim{n}.pid"
        launch = server_launch(port, time_scale=time_scale, flags=args, env=env)
        pid = transport.start_detached(launch.argv, launch.env, str(log_path), str(pid_path))
        server = SimServer(launch.url, port, pid, log_path, transport)
        started.append(server)
        wait_healthy(server.url, alive=lambda: transport.is_alive(pid), log_tail=server.log_tail)
        return server

    try:
        yield _start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def sim_server(start_sim: Callable[..., SimServer]) -> SimServer:
    """A healthy simulated server with no modelled latency."""
    return start_sim()
