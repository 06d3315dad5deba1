"""A one-node Ray cluster on loopback for tests and benches: `ray start --head` with every port chosen by
the caller, a temp dir of its own, token authentication; stopped, with every process it started, at the
end (and only those: `ray stop` would stop every Ray on the machine)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.services import record_service_start

# Ray turns 127.0.0.1 into the machine's own address when it connects, unless it is told that this is a
# one-machine cluster (Ray's knob for Windows and macOS, honoured on Linux too): then all of it is loopback.
# Token authentication, as Ray has it by default, with a token of this process's own.
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}
# Ray's workers each bind a port of this range when they start, long after `ray start`: above Linux's
# ephemeral range (which ends at 60999) and away from the ports tests draw for servers (10000-32000), one
# slice per pytest-xdist worker
_SLICE = 61000 + 400 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
WORKER_PORTS = range(_SLICE, _SLICE + 200)
PORT_FLAGS = (
    "--node-manager-port", "--object-manager-port", "--ray-client-server-port",
    "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
    "--metrics-export-port",
)  # fmt: skip


@contextlib.contextmanager
def local_ray_head(free_port: Callable[[], int], num_cpus: int = 2) -> Iterator[str]:
    """Yields the head's address (127.0.0.1:PORT); clients need RAY_ENV in their environment."""
    # unix socket paths must stay short: not under pytest's tmp_path
    temp = tempfile.mkdtemp(prefix="hhray-", dir="/tmp")
    try:
        yield _start(temp, free_port, num_cpus)
    finally:
        stop_processes_of(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _start(temp: str, free_port: Callable[[], int], num_cpus: int) -> str:
    """`ray start --head`, one at a time on this machine (two heads starting at once were seen to fail
    here, once), and tried twice, with other ports the second time."""
    failures = []
    with open("/tmp/heisenhunt-ray-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for _ in range(2):
            began = time.monotonic()
            port = free_port()
            argv = [
                shutil.which("ray") or "ray", "start", "--head", "--node-ip-address=127.0.0.1",
                f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
                f"--temp-dir={temp}", f"--port={port}", f"--min-worker-port={WORKER_PORTS.start}",
                f"--max-worker-port={WORKER_PORTS.stop - 1}",
                *(f"{flag}={free_port()}" for flag in PORT_FLAGS),
            ]  # fmt: skip
            env = {**os.environ, **RAY_ENV}
            # SIGINT as a terminal leaves it for the head and its workers: a suite started in the
            # background hands its children SIGINT ignored, and a cancelled arm's worker would run on
            started = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
            )
            if started.returncode == 0:
                record_service_start("ray head", time.monotonic() - began)
                return f"127.0.0.1:{port}"
            failures.append(started.stdout[-2000:] + started.stderr[-2000:])
            stop_processes_of(temp)
    raise RuntimeError("ray start failed twice:\n" + "\n---\n".join(failures))


def stop_processes_of(temp: str) -> None:
    """Every process whose command line names the cluster's temp dir, killed outright (a throwaway
    cluster; Ray's processes take over 10 s to honour SIGTERM)."""

    def ours() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and temp.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
        return found

    deadline = time.monotonic() + 10
    while (left := ours()) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
