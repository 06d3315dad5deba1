"""The SSH transport: a host reached over OpenSSH-compatible SSH through paramiko.

It implements the three primitives of `Transport` (run one shell line, read a file, write a file);
process control (start detached, stop a process group, liveness) is inherited from base.py, so a
remote host runs exactly the shell lines the local transport runs. Every command runs as
`sh -c '<line>'` whatever the login shell, so the shell is the same POSIX `sh` as locally.

Connection settings come from the host config (`ssh.*`) and from the OpenSSH client config
(`ssh.config_file`, read with `paramiko.SSHConfig`), explicit host-config values winning, as on the
`ssh` command line: `HostName`, `User`, `Port`, `IdentityFile`, `IdentitiesOnly`, `ProxyJump`
(chains and jump hosts that have their own `ProxyJump` too) and `UserKnownHostsFile`.

Host keys are checked against `ssh.known_hosts`. An unknown or a changed key is refused by default;
`ssh.host_key_policy: accept-new` trusts a host seen for the first time (logged as a warning, its key
appended to known_hosts), and still refuses a changed key, like OpenSSH's StrictHostKeyChecking=accept-new.

One connection per transport, opened on first use, kept alive (`ssh.keepalive_s`), reopened when it
dropped between commands (a command is never re-run), and reused for every command and SFTP transfer
of an arm. Failures are `TransportError` subclasses whose message says what to fix.

Costs: each command is one SSH session on the open connection; the server still starts the login
shell for it (bash reads ~/.bashrc under sshd), so a command costs what that shell's startup costs
(about 150 ms on a host whose .bashrc runs `pyenv init`, a few ms on a plain one). A command that
times out is abandoned (its channel closed), not killed: long-running work belongs in start_detached.

Lifecycle: built at the edge from the cluster config (`remote.make_transport`), used for one arm,
closed in a `finally`; processes started detached keep running after `close()`.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import getpass
import hashlib
import io
import logging
import os
import select
import shlex
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from orchestrator.remote.base import CommandResult, Transport, TransportError

log = logging.getLogger(__name__)

HOST_KEY_POLICIES = ("reject", "accept-new")
# OpenSSH's sshd allows 10 sessions per connection by default (MaxSessions); stay below it.
DEFAULT_MAX_SESSIONS = 8
_MAX_JUMP_DEPTH = 8


class SSHError(TransportError):
    """Base of the SSH transport's errors."""


class SSHConfigError(SSHError):
    """The SSH settings are unusable (a missing key file, a bad ProxyJump, an unknown policy)."""


class HostUnreachable(SSHError):
    """No SSH server answered at the address within the timeout."""


class AuthenticationFailed(SSHError):
    """The server refused every key offered."""


class UnknownHostKey(SSHError):
    """The server's host key is not in known_hosts and the policy is `reject`."""


class HostKeyChanged(SSHError):
    """The server's host key differs from the one in known_hosts."""


@dataclass(frozen=True)
class SSHOptions:
    """The `ssh` part of a host's config plus its address; None means "from the SSH config"."""

    address: str
    user: str | None = None
    port: int | None = None
    key_file: str | None = None
    proxy_jump: str | None = None
    config_file: str | None = "~/.ssh/config"
    known_hosts: str | None = "~/.ssh/known_hosts"
    host_key_policy: str = "reject"
    connect_timeout_s: float = 10.0
    keepalive_s: float = 15.0
    max_sessions: int = DEFAULT_MAX_SESSIONS

    def __post_init__(self) -> None:
        if self.host_key_policy not in HOST_KEY_POLICIES:
            raise SSHConfigError(
                f"ssh.host_key_policy {self.host_key_policy!r} for {self.address}: "
                f"use one of {HOST_KEY_POLICIES}"
            )
        if self.connect_timeout_s <= 0:
            raise SSHConfigError(f"ssh.connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if self.max_sessions < 1:
            raise SSHConfigError(f"ssh.max_sessions must be >= 1, got {self.max_sessions}")


def _field(obj: Any, key: str, default: Any = None) -> Any:
    """`obj.key` for a Mapping (dict, omegaconf DictConfig) or an object with attributes."""
    if obj is None:
        return default
    value = obj.get(key, default) if isinstance(obj, Mapping) else getattr(obj, key, default)
    return default if value is None else value


def ssh_options_from_host(host_cfg: Any) -> SSHOptions:
    """SSHOptions from one host's config (`address` and its optional `ssh:` block)."""
    ssh = _field(host_cfg, "ssh")
    address = _field(host_cfg, "address")
    if not address:
        raise SSHConfigError("an ssh host needs an `address` (hostname, IP or ~/.ssh/config alias)")
    port = _field(ssh, "port")
    return SSHOptions(
        address=str(address),
        user=_field(ssh, "user"),
        port=int(port) if port is not None else None,
        key_file=_field(ssh, "key_file"),
        proxy_jump=_field(ssh, "proxy_jump"),
        config_file=_field(ssh, "config_file", "~/.ssh/config"),
        known_hosts=_field(ssh, "known_hosts", "~/.ssh/known_hosts"),
        host_key_policy=str(_field(ssh, "host_key_policy", "reject")),
        connect_timeout_s=float(_field(ssh, "connect_timeout_s", 10.0)),
        keepalive_s=float(_field(ssh, "keepalive_s", 15.0)),
        max_sessions=int(_field(ssh, "max_sessions", DEFAULT_MAX_SESSIONS)),
    )


# --- resolution (pure: options + SSH config -> the hops to connect through) ---------------------------


@dataclass(frozen=True)
class Endpoint:
    """One SSH server to log in to, fully resolved."""

    alias: str
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()
    # key_files came from the host config: a missing one is an error, not skipped
    explicit_key: bool = False
    identities_only: bool = False

    @property
    def label(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


@dataclass(frozen=True)
class Route:
    """The target and the jump hosts before it, in connection order."""

    target: Endpoint
    jumps: tuple[Endpoint, ...] = ()
    known_hosts: str = "~/.ssh/known_hosts"


def load_ssh_config(path: str | None) -> paramiko.SSHConfig:
    """The OpenSSH client config at `path`; an empty one when the file does not exist."""
    if path:
        expanded = Path(path).expanduser()
        if expanded.is_file():
            return paramiko.SSHConfig.from_path(str(expanded))
    return paramiko.SSHConfig.from_text("")


def _split_user_host_port(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (ssh -J syntax; IPv6 as [addr]:port) -> parts."""
    user, _, hostport = spec.rpartition("@")
    port: int | None = None
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
        port = int(port_text)
    else:
        host = hostport
    if not host:
        raise SSHConfigError(f"bad ProxyJump entry {spec!r}: expected [user@]host[:port]")
    return (user or None), host, port


def _endpoint(
    alias: str,
    config: paramiko.SSHConfig,
    user: str | None,
    port: int | None,
    key_file: str | None,
    fallback_keys: tuple[str, ...] = (),
) -> Endpoint:
    entry = config.lookup(alias)
    if key_file:
        keys: tuple[str, ...] = (os.path.expanduser(key_file),)
    else:
        keys = tuple(os.path.expanduser(k) for k in entry.get("identityfile", [])) or fallback_keys
    return Endpoint(
        alias=alias,
        hostname=entry.get("hostname", alias),
        port=int(port if port is not None else entry.get("port", 22)),
        user=user or entry.get("user") or getpass.getuser(),
        key_files=keys,
        explicit_key=bool(key_file),
        identities_only=str(entry.get("identitiesonly", "no")).lower() == "yes",
    )


def _jump_chain(
    spec: str | None, config: paramiko.SSHConfig, fallback_keys: tuple[str, ...], depth: int = 0
) -> tuple[Endpoint, ...]:
    """The hops of a ProxyJump value, each jump host resolved through the SSH config and, like
    `ssh -J`, reached through its own ProxyJump when it has one."""
    if not spec or spec.strip().lower() == "none":
        return ()
    if depth > _MAX_JUMP_DEPTH:
        raise SSHConfigError(f"ProxyJump nests deeper than {_MAX_JUMP_DEPTH} hops (a loop?): {spec!r}")
    hops: list[Endpoint] = []
    for item in spec.split(","):
        user, alias, port = _split_user_host_port(item.strip())
        own_jump = config.lookup(alias).get("proxyjump")
        if not hops:
            hops.extend(_jump_chain(own_jump, config, fallback_keys, depth + 1))
        hops.append(_endpoint(alias, config, user, port, None, fallback_keys))
    return tuple(hops)


def resolve_route(options: SSHOptions, config: paramiko.SSHConfig) -> Route:
    """Where and how to connect: host-config values first, then the SSH config, then defaults.

    Jump hosts use the IdentityFile of their own SSH-config entry, else the target's key file."""
    target = _endpoint(options.address, config, options.user, options.port, options.key_file)
    jump_spec = options.proxy_jump or config.lookup(options.address).get("proxyjump")
    jumps = _jump_chain(jump_spec, config, target.key_files)
    known = options.known_hosts
    if not known:
        files = config.lookup(options.address).get("userknownhostsfile", "").split()
        known = files[0] if files else "~/.ssh/known_hosts"
    return Route(target=target, jumps=jumps, known_hosts=os.path.expanduser(known))


# --- host key policies ---------------------------------------------------------------------------------


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style SHA256 fingerprint."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"SHA256:{digest}"


class _RejectUnknown(paramiko.MissingHostKeyPolicy):
    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise UnknownHostKey(
            f"host key of {hostname} is not in {self.known_hosts} ({key.get_name()} {fingerprint(key)}). "
            f"Check the fingerprint with the host's admin, then add it (ssh-keyscan), or set "
            f"ssh.host_key_policy: accept-new to trust a host seen for the first time"
        )


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust a first-seen host and remember it; a changed key is still refused by paramiko."""

    def __init__(self, known_hosts: str):
        self.known_hosts = known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        log.warning(
            "accept-new: trusting %s, first seen, %s %s; appended to %s",
            hostname,
            key.get_name(),
            fingerprint(key),
            self.known_hosts,
        )
        client.get_host_keys().add(hostname, key.get_name(), key)
        path = Path(self.known_hosts)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # append one line rather than rewrite the file: keeps the user's comments and hashed entries
        with path.open("a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


# --- the transport --------------------------------------------------------------------------------------


@dataclass
class _Connection:
    clients: list[paramiko.SSHClient] = field(default_factory=list)
    sftp: paramiko.SFTPClient | None = None

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
                sock = None
                for i, hop in enumerate(hops):
                    via = hops[i - 1] if i else None
                    client = self._login(hop, sock, via)
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
        policy = _AcceptNew(known) if opts.host_key_policy == "accept-new" else _RejectUnknown(known)
        client.set_missing_host_key_policy(policy)
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
            raise HostKeyChanged(
                f"host key of {where} CHANGED: {known} has {e.expected_key.get_name()} "
                f"{fingerprint(e.expected_key)}, the server sent {e.key.get_name()} {fingerprint(e.key)}. "
                f"Someone may be intercepting the connection; if the host was reinstalled, remove the old "
                f"entry (ssh-keygen -R) and add the new one"
            ) from e
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
        except paramiko.SSHException as e:
            client.close()
            # e.g. "Error reading SSH protocol banner": something that is not a working sshd
            raise HostUnreachable(f"{where}: SSH handshake failed: {e}") from e
        transport = client.get_transport()
        if transport is not None and opts.keepalive_s > 0:
            transport.set_keepalive(max(1, int(opts.keepalive_s)))
        return client

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- the three primitives -------------------------------------------------------------------------

    def run_shell(self, command: str, timeout: float | None = 60.0) -> CommandResult:
        line = f"sh -c {shlex.quote(command)}"
        with self._sessions:
            chan = self._open_session()
            try:
                chan.exec_command(line)
                chan.shutdown_write()  # stdin is empty, as with the local transport's DEVNULL
                out, err, code = self._collect(chan, timeout)
            except TimeoutError as e:
                raise TransportError(f"on {self.host}: `{command}` did not finish within {timeout}s") from e
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise TransportError(f"on {self.host}: connection lost while running `{command}`: {e}") from e
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

    @staticmethod
    def _collect(chan: paramiko.Channel, timeout: float | None) -> tuple[bytes, bytes, int]:
        """Drain stdout and stderr together (so neither pipe can fill and block the command), then
        wait for the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out, err = bytearray(), bytearray()

        def remaining() -> float | None:
            if deadline is None:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            return left

        while True:
            left = remaining()  # checked every round: a command that never stops talking still times out
            drained = False
            while chan.recv_ready():
                out += chan.recv(65536)
                drained = True
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                drained = True
            if chan.closed or (chan.eof_received and not chan.recv_ready() and not chan.recv_stderr_ready()):
                break
            if not drained:
                # the channel's fileno becomes readable on stdout or stderr data, or on EOF
                select.select([chan], [], [], min(left, 1.0) if left is not None else 1.0)
        left = remaining()
        if not chan.status_event.wait(left):
            raise TimeoutError
        return bytes(out), bytes(err), chan.recv_exit_status()

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
