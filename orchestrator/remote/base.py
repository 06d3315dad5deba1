"""The Transport interface: how the orchestrator touches a host, local or remote.

Every host operation the deployment needs (run a command, start a detached server, check and stop
it, read its log) goes through this interface. Process control is written once, as POSIX shell
built with `shlex`, on top of two primitives each transport implements: `run_shell` (run one shell
command line on the host) and `read_file` / `write_file`. The local transport runs `sh -c` through
subprocess; the SSH transport runs the same lines through paramiko's exec_command and SFTP. So the
local transport exercises exactly the shell the remote hosts will see.

Lifecycle: a transport is built at the edge (from the cluster config), used for one arm, and closed
in a `finally` (it is a context manager).
"""

from __future__ import annotations

import shlex
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from orchestrator.config.shell import command_line


class TransportError(RuntimeError):
    """A host could not be reached, or a command on it could not be run as asked."""


class CommandFailed(TransportError):
    def __init__(self, host: str, command: str, result: CommandResult):
        self.result = result
        tail = (result.stderr or result.stdout).strip()[-2000:]
        super().__init__(f"on {host}: `{command}` exited {result.returncode}: {tail}")


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


def detached_command(
    argv: Sequence[str], env: Mapping[str, str], log_path: str, pid_path: str, cwd: str | None = None
) -> str:
    """A shell line that starts `argv` in a new session (so its pid is its process group id),
    stdout+stderr appended to `log_path`, stdin from /dev/null, writes the pid and its start time to
    `pid_path` (two lines) and prints the pid. The process survives the shell (and the SSH channel)
    that started it. The start time tells a later run whether the pid was recycled, so a pid file is
    never written without one: a process already gone leaves none (there is nothing to stop)."""
    if not argv:
        raise ValueError("empty command")
    launch = command_line(argv, env)
    cd = f"cd {shlex.quote(cwd)} || exit 1; " if cwd else ""
    log, pid = shlex.quote(log_path), shlex.quote(pid_path)
    parent = shlex.quote(str(_parent(log_path)))
    pid_parent = shlex.quote(str(_parent(pid_path)))
    # Plain `;` sequencing: with `A && B & C`, the shell would background the whole `A && B` list and
    # $! would name a subshell, not the server.
    return (
        f"mkdir -p {parent} {pid_parent} || exit 1; {cd}"
        f"setsid nohup {launch} >>{log} 2>&1 </dev/null & "
        f'p=$!; t=$(ps -o lstart= -p "$p"); '
        f'if [ -n "$t" ]; then printf "%s\\n%s\\n" "$p" "$t" >{pid} || exit 1; fi; echo "$p"'
    )


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."


class Transport(ABC):
    """One host. Subclasses provide `run_shell`, `read_file`, `write_file`; the rest is shared."""

    #: a short name for messages ("local", "gpu-node-1")
    host: str

    @abstractmethod
    def run_shell(self, command: str, timeout: float | None = 60.0) -> CommandResult:
        """Run one POSIX shell command line on the host and wait for it."""

    @abstractmethod
    def read_file(self, path: str) -> bytes:
        """The bytes of a file on the host; FileNotFoundError if it does not exist."""

    @abstractmethod
    def write_file(self, path: str, data: bytes) -> None:
        """Write a file on the host, creating parent directories."""

    def close(self) -> None:  # noqa: B027 - a transport without connections has nothing to release
        """Release connections. Processes started detached keep running."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared behaviour, all through run_shell -------------------------------------------

    def run(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float | None = 60.0,
        check: bool = True,
        cwd: str | None = None,
    ) -> CommandResult:
        """Run `argv` (quoted for the shell) with extra `env`, wait for it."""
        line = command_line(argv, env)
        if cwd:
            line = f"cd {shlex.quote(cwd)} && {line}"
        result = self.run_shell(line, timeout=timeout)
        if check and result.returncode != 0:
            raise CommandFailed(self.host, line, result)
        return result

    def start_detached(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: str,
        pid_path: str,
        cwd: str | None = None,
    ) -> int:
        """Start `argv` detached in its own session; returns its pid (= its process group id)."""
        line = detached_command(argv, env, log_path, pid_path, cwd)
        result = self.run_shell(line, timeout=30.0)
        if result.returncode != 0 or not result.stdout.strip().isdigit():
            raise CommandFailed(self.host, line, result)
        return int(result.stdout.strip())

    def is_alive(self, pid: int) -> bool:
        """True if `pid` exists and is not a zombie."""
        result = self.run_shell(f"ps -o stat= -p {int(pid)}", timeout=15.0)
        state = result.stdout.strip()
        return result.returncode == 0 and bool(state) and not state.startswith("Z")

    def start_time(self, pid: int) -> str:
        """The process's start time as `ps -o lstart=` prints it ('' when it is gone)."""
        return self.run_shell(f"ps -o lstart= -p {int(pid)}", timeout=15.0).stdout.strip()

    def group_alive(self, pgid: int) -> bool:
        """True if any non-zombie process is left in process group `pgid`."""
        result = self.run_shell(
            f"ps -e -o pgid=,stat= | awk '$1 == {int(pgid)} && $2 !~ /^Z/' ", timeout=15.0
        )
        return bool(result.stdout.strip())

    def stop_group(self, pgid: int, grace_s: float = 10.0, poll_s: float = 0.1) -> bool:
        """TERM the process group, wait up to `grace_s`, then KILL. Returns True if it had to KILL."""
        pgid = int(pgid)
        if pgid <= 1:
            raise ValueError(f"refusing to signal process group {pgid}")
        self.run_shell(f"kill -TERM -{pgid} 2>/dev/null; true", timeout=15.0)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self.group_alive(pgid):
                return False
            time.sleep(poll_s)
        self.run_shell(f"kill -KILL -{pgid} 2>/dev/null; true", timeout=15.0)
        kill_deadline = time.monotonic() + 5.0
        while self.group_alive(pgid) and time.monotonic() < kill_deadline:
            time.sleep(poll_s)
        return True

    def read_text_tail(self, path: str, max_bytes: int = 8192) -> str:
        """The last `max_bytes` of a text file, or '' when it does not exist."""
        result = self.run_shell(f"tail -c {int(max_bytes)} {shlex.quote(path)} 2>/dev/null", timeout=15.0)
        return result.stdout if result.returncode == 0 else ""

    def port_listening(self, port: int) -> bool:
        """True if something listens on TCP `port` on this host (any address)."""
        listeners = "(ss -Htln 2>/dev/null || netstat -tln 2>/dev/null) | awk '{print $4}'"
        result = self.run_shell(f"{listeners} | grep -E ':{int(port)}$'", timeout=15.0)
        return bool(result.stdout.strip())
