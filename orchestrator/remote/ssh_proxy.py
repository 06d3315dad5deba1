"""ProxyCommand for the SSH transport: the local command whose stdin and stdout carry the connection to
the first hop, run as OpenSSH runs it (`$SHELL -c 'exec <command>'`). Its tokens are expanded where
the route is resolved (ssh_route.expand_proxy_command); this module runs the command and reads it.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import tempfile
import threading

import paramiko

from orchestrator.remote.ssh_errors import SSHConfigError


class ProxyCommandSocket(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, run as OpenSSH runs it (`$SHELL -c 'exec <command>'`) in its own session
    (a Ctrl-C at the orchestrator must not cut the connection its teardown still needs). Two changes:
    EOF from the command ends the connection at once (paramiko's recv spins until the banner timeout),
    and its stderr goes to a file (paramiko's unread pipe could fill and block it), quoted when it fails."""

    def __init__(self, command: str):
        # paramiko's __init__ is not called: it would start the command with stderr on a pipe
        self.command = command
        self.cmd = [os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"]
        self.timeout: float | None = None
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the proxy; closed in close()
        self._stderr_tail = ""
        # paramiko's transport thread and the caller may close the proxy at once (a refused host key):
        # the file is read and closed by one of them at a time
        self._stderr_lock = threading.Lock()
        try:
            self.process = subprocess.Popen(
                self.cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                bufsize=0,
                start_new_session=True,
            )
        except OSError as e:
            self._stderr.close()
            raise SSHConfigError(f"cannot start ProxyCommand {command!r}: {e}") from e

    def recv(self, size: int) -> bytes:
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError  # socket.timeout, what paramiko expects of a socket
        # b"" at EOF: the connection has ended, as a socket says it
        return os.read(self.process.stdout.fileno(), size)  # type: ignore[union-attr]

    def failure(self, wait_s: float = 1.0) -> str:
        """How the command ended ('' while it runs): its exit status and the tail of its stderr."""
        try:
            code = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return ""
        return f"ProxyCommand `{self.command}` exited {code}: {self._read_stderr() or '(no stderr)'}"

    def _read_stderr(self, then_close: bool = False) -> str:
        with self._stderr_lock:
            if not self._stderr.closed:
                self._stderr.seek(0)
                self._stderr_tail = self._stderr.read()[-2000:].decode(errors="replace").strip()
                if then_close:
                    self._stderr.close()
        return self._stderr_tail

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        self._read_stderr(then_close=True)
