"""The local transport: the host is this machine, commands run through `sh -c`.

Used by the embedded default cluster and by any role whose host is `localhost`. It runs the same shell
lines as the SSH transport (see base.py), so what passes locally is what a remote host will see.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.remote.base import CommandResult, Transport, TransportError, brief


class LocalTransport(Transport):
    def __init__(self, host: str = "localhost"):
        self.host = host

    def run_shell(self, command: str, timeout: float | None = 60.0) -> CommandResult:
        try:
            done = subprocess.run(
                ["sh", "-c", command],
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
                errors="replace",
            )
        except subprocess.TimeoutExpired as e:
            raise TransportError(
                f"on {self.host}: `{brief(command)}` did not finish within {timeout}s"
            ) from e
        return CommandResult(done.returncode, done.stdout, done.stderr)

    def read_file(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def write_file(self, path: str, data: bytes) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
