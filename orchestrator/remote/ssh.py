"""The SSH transport: a host reached over OpenSSH-compatible SSH through paramiko.

It implements the three primitives of `Transport` (run one shell line, read a file, write a file);
process control (start detached, stop a process group, liveness) is inherited from base.py, so a
remote host runs exactly the shell lines the local transport runs. Every command runs as
`sh -c '<line>'` whatever the login shell, so the shell is the same POSIX `sh` as locally.

The parts, one concern each: where the host is and through which hops (ssh_route.py, from the host
config and ~/.ssh/config), its host key checked (ssh_hostkeys.py), a ProxyCommand's connection
(ssh_proxy.py), the persistent shell's protocol (ssh_shell.py), a channel read to its end
(ssh_channel.py), the errors (ssh_errors.py). This module connects and runs commands with them.

One connection per transport, opened on first use, kept alive (`ssh.keepalive_s`), reopened when it
dropped between commands (a command is never re-run), and reused for every command and SFTP transfer
of an arm. Failures are `TransportError` subclasses whose message says what to fix.

Commands go to persistent shells (ssh_shell.py says why and how). A thread takes an idle shell or
opens one (at most `ssh.max_sessions` commands at a time); a shell found dead is reopened, and a
command the shell never started is sent once more, on a fresh shell. A command that times out is
killed with its shell and what it started (SIGKILL to the shell's process group; servers started
detached have their own), and the next command opens a new shell. A host whose shell cannot start
falls back to a session per command, with a warning; `ssh.persistent_shell: false` asks for that.

Lifecycle: built at the edge from the cluster config (`remote.make_transport`), used for one arm,
closed in a `finally`; processes started detached keep running after `close()`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shlex
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.remote.base import CommandResult, Transport, TransportError, brief
from orchestrator.remote.ssh_channel import collect
from orchestrator.remote.ssh_errors import AuthenticationFailed, HostUnreachable, SSHConfigError, SSHError
from orchestrator.remote.ssh_hostkeys import host_key_changed, missing_host_key_policy
from orchestrator.remote.ssh_proxy import ProxyCommandSocket
from orchestrator.remote.ssh_route import (
    Endpoint,
    SSHOptions,
    load_ssh_config,
    resolve_route,
    ssh_options_from_host,
)
from orchestrator.remote.ssh_shell import (
    NoShell,
    PersistentShell,
    ShellGone,
    await_ready,
    kill_command,
    run_framed,
    shell_init,
)

log = logging.getLogger(__name__)


@dataclass
class _Connection:
    clients: list[paramiko.SSHClient] = field(default_factory=list)
    sftp: paramiko.SFTPClient | None = None
    proxy: ProxyCommandSocket | None = None

    @property
    def transport(self) -> paramiko.Transport | None:
        return self.clients[-1].get_transport() if self.clients else None

    def active(self) -> bool:
        t = self.transport
        return t is not None and t.is_active()

    def close(self) -> None:
        if self.sftp is not None:
            with contextlib.suppress(Exception):
                self.sftp.close()
            self.sftp = None
        # target first, then the jumps it was tunnelled through
        for client in reversed(self.clients):
            client.close()
        self.clients.clear()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None


class SSHTransport(Transport):
    """A host over SSH. Thread-safe: commands from several threads share the one connection."""

    def __init__(self, options: SSHOptions, host: str | None = None):
        self.options = options
        self.host = host or options.address
        self.route = resolve_route(options, load_ssh_config(options.config_file))
        # how many times a connection was opened: 1 for an arm unless the network dropped it
        self.connects = 0
        self._conn = _Connection()
        self._lock = threading.RLock()
        self._sftp_lock = threading.Lock()
        self._sessions = threading.BoundedSemaphore(options.max_sessions)
        # how many persistent shells were started: one per concurrent thread, unless one died
        self.shells = 0
        self._idle: list[PersistentShell] = []
        self._pool_lock = threading.Lock()
        # why this host has no persistent shell (then a session per command), None while it has
        self._no_shell: str | None = None

    @classmethod
    def from_host_config(cls, host_cfg: Any, host: str | None = None) -> SSHTransport:
        return cls(ssh_options_from_host(host_cfg), host=host)

    # --- connection ---------------------------------------------------------------------------------

    def connect(self) -> paramiko.Transport:
        """The live paramiko Transport, opening the connection (through any jumps) if needed."""
        with self._lock:
            if self._conn.active():
                return self._conn.transport  # type: ignore[return-value]
            if self._conn.clients:
                log.info("%s: connection dropped, reconnecting", self.host)
                self._conn.close()
            self._check_key_files()
            conn = _Connection()
            hops = (*self.route.jumps, self.route.target)
            try:
                sock: Any = None
                if self.route.proxy_command:
                    sock = conn.proxy = ProxyCommandSocket(self.route.proxy_command)
                for i, hop in enumerate(hops):
                    via = hops[i - 1] if i else None
                    try:
                        client = self._login(hop, sock, via)
                    except HostUnreachable as e:
                        ended = conn.proxy.failure() if conn.proxy is not None and i == 0 else ""
                        if ended:
                            raise HostUnreachable(f"{e}; {ended}") from e
                        raise
                    conn.clients.append(client)
                    sock = self._tunnel(client, hop, hops[i + 1]) if i + 1 < len(hops) else None
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            self.connects += 1
            return conn.transport  # type: ignore[return-value]

    def _check_key_files(self) -> None:
        for hop in (*self.route.jumps, self.route.target):
            for key in hop.key_files:
                if hop.explicit_key and not Path(key).is_file():
                    raise SSHConfigError(f"ssh.key_file {key!r} for {self.host} does not exist")
                if Path(key).is_file() and not os.access(key, os.R_OK):
                    raise SSHConfigError(f"key file {key!r} for {hop.label} is not readable")

    def _tunnel(self, jump: paramiko.SSHClient, via: Endpoint, nxt: Endpoint) -> paramiko.Channel:
        """A direct-tcpip channel from the jump host to the next hop (what `ssh -J` does)."""
        try:
            return jump.get_transport().open_channel(  # type: ignore[union-attr]
                "direct-tcpip",
                (nxt.hostname, nxt.port),
                ("127.0.0.1", 0),
                timeout=self.options.connect_timeout_s,
            )
        except (paramiko.SSHException, OSError) as e:
            raise HostUnreachable(
                f"{self.host}: jump host {via.label} could not reach {nxt.hostname}:{nxt.port}: {e}"
            ) from e

    def _login(
        self, hop: Endpoint, sock: paramiko.Channel | None, via: Endpoint | None
    ) -> paramiko.SSHClient:
        opts = self.options
        client = paramiko.SSHClient()
        known = self.route.known_hosts
        if Path(known).is_file():
            client.load_host_keys(known)
        client.set_missing_host_key_policy(missing_host_key_policy(opts.host_key_policy, known))
        keys = [k for k in hop.key_files if Path(k).is_file()]
        where = f"{self.host} ({hop.label}{' via ' + via.label if via else ''})"
        try:
            client.connect(
                hop.hostname,
                port=hop.port,
                username=hop.user,
                key_filename=keys or None,
                # keys named in the config are the only ones tried; else ~/.ssh/id_* as ssh does
                look_for_keys=not keys,
                allow_agent=not hop.identities_only,
                sock=sock,
                timeout=opts.connect_timeout_s,
                banner_timeout=opts.connect_timeout_s,
                auth_timeout=opts.connect_timeout_s,
                channel_timeout=opts.connect_timeout_s,
            )
        except SSHError:
            client.close()
            raise
        except paramiko.BadHostKeyException as e:
            client.close()
            raise host_key_changed(where, known, e) from e
        except paramiko.PasswordRequiredException as e:
            client.close()
            raise SSHConfigError(f"{where}: key file is passphrase-protected: load it into ssh-agent") from e
        except paramiko.AuthenticationException as e:
            client.close()
            offered = ", ".join(keys) if keys else "ssh-agent and ~/.ssh/id_*"
            raise AuthenticationFailed(
                f"{where}: authentication failed for user {hop.user!r} with {offered}: {e}"
            ) from e
        except TimeoutError as e:
            client.close()
            raise HostUnreachable(
                f"{where}: no answer within ssh.connect_timeout_s={opts.connect_timeout_s}s"
            ) from e
        except OSError as e:
            client.close()
            raise HostUnreachable(f"{where}: cannot connect: {e}") from e
        except EOFError as e:  # paramiko's word for a server that hung up mid-handshake (its session killed)
            client.close()
            raise HostUnreachable(
                f"{where}: the server closed the connection during the SSH handshake"
            ) from e
        except paramiko.SSHException as e:
            client.close()
            # e.g. "Error reading SSH protocol banner": something that is not a working sshd
            raise HostUnreachable(f"{where}: SSH handshake failed: {e}") from e
        transport = client.get_transport()
        if transport is not None and opts.keepalive_s > 0:
            transport.set_keepalive(max(1, int(opts.keepalive_s)))
        return client

    def close(self) -> None:
        with self._pool_lock:
            idle, self._idle = self._idle, []
        for shell in idle:
            shell.close()
        with self._lock:
            self._conn.close()

    # --- the three primitives -------------------------------------------------------------------------

    def run_shell(self, command: str, timeout: float | None = 60.0) -> CommandResult:
        with self._sessions:
            if self.options.persistent_shell and self._no_shell is None:
                return self._run_in_shell(command, timeout)
            return self._run_in_session(command, timeout)

    # --- persistent shells (see the module docstring) -----------------------------------------------------

    #: what the login shell runs to become the persistent shell
    shell_program = "exec sh"

    def _run_in_shell(self, command: str, timeout: float | None) -> CommandResult:
        for attempt in (1, 2):
            try:
                shell = self._take_shell()
            except NoShell as e:
                self._no_shell = str(e)
                log.warning(
                    "%s: no persistent shell (%s); one SSH session per command from now on", self.host, e
                )
                return self._run_in_session(command, timeout)
            try:
                out, err, code = run_framed(shell.chan, command, timeout)
            except ShellGone as e:
                shell.close()
                if attempt == 1 and not e.may_have_run:
                    log.info(
                        "%s: the shell had exited before it read the command; a fresh one runs it", self.host
                    )
                    continue
                raise TransportError(
                    f"on {self.host}: the shell running `{brief(command)}` ended before the command did ({e})"
                ) from e
            except TimeoutError as e:
                self._kill(shell)
                raise TransportError(
                    f"on {self.host}: `{brief(command)}` did not finish within {timeout}s"
                ) from e
            except (paramiko.SSHException, EOFError, OSError) as e:
                shell.close()
                raise TransportError(
                    f"on {self.host}: connection lost while running `{brief(command)}`: {e}"
                ) from e
            except BaseException:
                shell.close()  # interrupted mid-command: its output is still coming, never reuse it
                raise
            with self._pool_lock:
                self._idle.append(shell)
            return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"))
        raise AssertionError("unreachable")

    def _take_shell(self) -> PersistentShell:
        """An idle shell of the live connection, else a new one."""
        transport = self.connect()
        stale: list[PersistentShell] = []
        found = None
        with self._pool_lock:
            while self._idle and found is None:
                shell = self._idle.pop()
                if shell.usable(transport):
                    found = shell
                else:
                    stale.append(shell)
        for shell in stale:
            shell.close()
        return found or self._open_shell()

    def _open_shell(self) -> PersistentShell:
        chan = self._open_session()
        try:
            # its wake-up pipe, made now: made at a later first select it would show as two new fds
            chan.fileno()
            chan.exec_command(self.shell_program)
            token = uuid.uuid4().hex
            chan.sendall(shell_init(token).encode())
            pid, tmp = await_ready(chan, token, self.shell_program, self.options.connect_timeout_s)
        except (paramiko.SSHException, EOFError, OSError) as e:
            chan.close()
            raise TransportError(f"{self.host}: cannot start a shell: {e}") from e
        except BaseException:
            chan.close()
            raise
        with self._pool_lock:
            self.shells += 1
        return PersistentShell(chan, pid, tmp)

    def _kill(self, shell: PersistentShell) -> None:
        """End the shell of a timed-out command and what it started (`kill_command`); the next command
        opens a new shell. Killed before its session is closed: a closed session ends the shell at once,
        and the command, orphaned, would be out of reach."""
        try:
            self._run_in_session(
                kill_command(shell.pid, shell.tmp), timeout=min(10.0, self.options.connect_timeout_s)
            )
        except TransportError as e:
            log.warning("%s: could not kill the shell of a timed-out command: %s", self.host, e)
        finally:
            shell.chan.close()

    # --- a session per command (ssh.persistent_shell: false, and the fallback) ---------------------------

    def _run_in_session(self, command: str, timeout: float | None) -> CommandResult:
        line = f"sh -c {shlex.quote(command)}"
        chan = self._open_session()
        try:
            chan.exec_command(line)
            chan.shutdown_write()  # stdin is empty, as with the local transport's DEVNULL
            out, err, code = collect(chan, timeout)
        except TimeoutError as e:
            raise TransportError(
                f"on {self.host}: `{brief(command)}` did not finish within {timeout}s"
            ) from e
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise TransportError(
                f"on {self.host}: connection lost while running `{brief(command)}`: {e}"
            ) from e
        finally:
            chan.close()
        return CommandResult(code, out.decode(errors="replace"), err.decode(errors="replace"))

    def _open_session(self) -> paramiko.Channel:
        # A dropped connection is reopened before the command is sent, never after: nothing runs twice.
        for attempt in (1, 2):
            transport = self.connect()
            try:
                return transport.open_session(timeout=self.options.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError) as e:
                if attempt == 2 or transport.is_active():
                    raise TransportError(f"{self.host}: cannot open an SSH session: {e}") from e
        raise AssertionError("unreachable")

    def _sftp(self) -> paramiko.SFTPClient:
        with self._lock:
            self.connect()
            if self._conn.sftp is None:
                try:
                    self._conn.sftp = self._conn.clients[-1].open_sftp()
                except paramiko.SSHException as e:
                    raise TransportError(
                        f"{self.host}: SFTP is not available ({e}); enable the sftp subsystem in sshd_config"
                    ) from e
            return self._conn.sftp

    def read_file(self, path: str) -> bytes:
        with self._sftp_lock:
            sftp = self._sftp()
            try:
                with sftp.open(_sftp_path(path), "rb") as f:
                    f.prefetch()
                    return f.read()
            except OSError as e:
                raise _os_error(e, self.host, path) from e

    def write_file(self, path: str, data: bytes) -> None:
        # relative to the login directory, for the shell (which starts there) as for SFTP
        rel = _sftp_path(path)
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if parent:
            self.run(["mkdir", "-p", parent], timeout=30.0)
        # write beside, then rename: a reader never sees a half-written file
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with self._sftp_lock:
            sftp = self._sftp()
            try:
                sftp.putfo(io.BytesIO(data), _sftp_path(tmp), confirm=True)
                sftp.posix_rename(_sftp_path(tmp), _sftp_path(path))
            except OSError as e:
                with contextlib.suppress(OSError):
                    sftp.remove(_sftp_path(tmp))
                raise _os_error(e, self.host, path) from e

    def fetch(self, remote_path: str, local_path: str | os.PathLike[str]) -> None:
        """Copy a remote file to this machine, streamed (for logs too large to hold in memory)."""
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        with self._sftp_lock:
            try:
                self._sftp().get(_sftp_path(remote_path), os.fspath(local_path))
            except OSError as e:
                raise _os_error(e, self.host, remote_path) from e


def _sftp_path(path: str) -> str:
    # SFTP paths are relative to the login directory and know no `~`
    if path == "~":
        return "."
    return path[2:] if path.startswith("~/") else path


def _os_error(e: OSError, host: str, path: str) -> OSError:
    """The same OSError subclass (FileNotFoundError, PermissionError, ...) with the host in the message."""
    code = e.errno if e.errno is not None else errno.EIO
    return OSError(code, f"on {host}: {e.strerror or e}", path)
