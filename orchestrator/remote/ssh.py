"""The SSH transport: a host reached over OpenSSH-compatible SSH through paramiko.

It implements the three primitives of `Transport` (run one shell line, read a file, write a file);
process control (start detached, stop a process group, liveness) is inherited from base.py, so a
remote host runs exactly the shell lines the local transport runs. Every command runs as
`sh -c '<line>'` whatever the login shell, so the shell is the same POSIX `sh` as locally.

Connection settings come from the host config (`ssh.*`) and from the OpenSSH client config
(`ssh.config_file`, read with `paramiko.SSHConfig`), explicit host-config values winning, as on the
`ssh` command line: `HostName`, `User`, `Port`, `IdentityFile`, `IdentitiesOnly`, `ProxyJump`
(chains and jump hosts that have their own `ProxyJump` or `ProxyCommand` too), `ProxyCommand` (run
as OpenSSH runs it, `$SHELL -c 'exec <command>'`, its %h %p %r %n %u %d %l %L %% tokens expanded
with the final host, port and user of its hop) and `UserKnownHostsFile`.

Host keys are checked against `ssh.known_hosts`, through a proxy or a jump as on a direct connection.
An unknown or a changed key is refused by default; `ssh.host_key_policy: accept-new` trusts a host
seen for the first time (logged as a warning, its key appended to known_hosts), and still refuses a
changed key, like OpenSSH's StrictHostKeyChecking=accept-new.

One connection per transport, opened on first use, kept alive (`ssh.keepalive_s`), reopened when it
dropped between commands (a command is never re-run), and reused for every command and SFTP transfer
of an arm. Failures are `TransportError` subclasses whose message says what to fix.

Costs: a fresh SSH session per command makes the server start the login shell each time (bash reads
~/.bashrc under sshd: ~150 ms on a host whose .bashrc runs `pyenv init`). So commands go to a
persistent shell instead (`ssh.persistent_shell`, on by default): one long-lived `sh` per session,
started once through the login shell, reading command lines from its stdin. Each command still runs
as its own `sh -c '<line>'` child with stdin from /dev/null, so nothing (cwd, variables, `exit`)
carries over from one command to the next; its stdout and stderr go to two files in the shell's
private temp directory, sent back after it exits, each framed by markers carrying a random token
and the exit status (a command killed by signal N reads 128+N, as `$?`; a session per command gave
-1). A command costs a few ms. A thread takes an idle shell or
opens one (at most `ssh.max_sessions` commands at a time, as before); a shell found dead is
reopened, and a command the shell never started is sent once more, on a fresh shell. A command
that times out is killed with its shell and what it started (SIGKILL to the shell's process
group; servers started detached have their own), and the next command opens a new shell. A host
whose shell cannot start falls back to a session per command, with a warning. Output a command's
background child writes after the command exited is dropped (it went to the command's own file),
where a session per command would wait for it.

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
import re
import select
import shlex
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import paramiko

from orchestrator.remote.base import CommandResult, Transport, TransportError, brief

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
    proxy_command: str | None = None
    config_file: str | None = "~/.ssh/config"
    known_hosts: str | None = "~/.ssh/known_hosts"
    host_key_policy: str = "reject"
    connect_timeout_s: float = 10.0
    keepalive_s: float = 15.0
    max_sessions: int = DEFAULT_MAX_SESSIONS
    # False: a fresh SSH session per command (the login shell starts every time), kept for comparison
    persistent_shell: bool = True

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
        proxy_command=_field(ssh, "proxy_command"),
        config_file=_field(ssh, "config_file", "~/.ssh/config"),
        known_hosts=_field(ssh, "known_hosts", "~/.ssh/known_hosts"),
        host_key_policy=str(_field(ssh, "host_key_policy", "reject")),
        connect_timeout_s=float(_field(ssh, "connect_timeout_s", 10.0)),
        keepalive_s=float(_field(ssh, "keepalive_s", 15.0)),
        max_sessions=int(_field(ssh, "max_sessions", DEFAULT_MAX_SESSIONS)),
        persistent_shell=bool(_field(ssh, "persistent_shell", True)),
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
    # the local command whose stdin/stdout reach the first hop (ProxyCommand, tokens expanded); None: TCP
    proxy_command: str | None = None


class SSHClientConfig(paramiko.SSHConfig):
    """paramiko's SSHConfig, except that ProxyCommand comes back as written: its tokens are expanded
    per hop by `expand_proxy_command`, with the hop's final port and user (paramiko would use the
    config file's even where the host config overrides them, and knows no %%)."""

    TOKENS_BY_CONFIG_KEY: ClassVar[dict[str, list[str]]] = {
        **paramiko.SSHConfig.TOKENS_BY_CONFIG_KEY,
        "proxycommand": [],
    }


def load_ssh_config(path: str | None) -> paramiko.SSHConfig:
    """The OpenSSH client config at `path`; an empty one when the file does not exist."""
    if path:
        expanded = Path(path).expanduser()
        if expanded.is_file():
            return SSHClientConfig.from_path(str(expanded))
    return SSHClientConfig.from_text("")


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


def _given(value: str | None) -> str | None:
    """A ProxyJump/ProxyCommand value, None when absent or `none`."""
    return value if value and value.strip().lower() != "none" else None


def _proxy_settings(
    alias: str, entry: Mapping[str, Any], jump: str | None = None, command: str | None = None
) -> tuple[str | None, str | None]:
    """(ProxyJump, ProxyCommand) for one host, at most one of them set.

    `jump`/`command` are the host config's: one given wins over both of the SSH config's (as `ssh -J`
    or `-o ProxyCommand=` do), `none` switches off that one of the SSH config. OpenSSH takes whichever
    of the two comes first in the file; paramiko's lookup keeps no order, so both is refused."""
    if _given(jump) and _given(command):
        raise SSHConfigError(f"{alias}: set ssh.proxy_jump or ssh.proxy_command, not both")
    if _given(jump) or _given(command):
        return _given(jump), _given(command)
    from_config = (
        None if jump else _given(entry.get("proxyjump")),
        None if command else _given(entry.get("proxycommand")),
    )
    if all(from_config):
        raise SSHConfigError(
            f"{alias}: the SSH config gives both ProxyJump {from_config[0]!r} and ProxyCommand "
            f"{from_config[1]!r}; choose one with ssh.proxy_jump or ssh.proxy_command (or `none`)"
        )
    return from_config


# a substituted value must not change the shell syntax of the command around it (as OpenSSH 9.6)
_SAFE_TOKEN_VALUE = re.compile(r"[A-Za-z0-9._@:%+\[\]-]+")


def expand_proxy_command(command: str, hop: Endpoint) -> str:
    """OpenSSH's ProxyCommand tokens: %h host, %p port, %r remote user, %n the alias as written,
    %u local user, %d local home, %L local hostname, %l local hostname with domain, %% a `%`."""
    local = socket.gethostname()
    values = {
        "%": "%",
        "h": hop.hostname,
        "p": str(hop.port),
        "r": hop.user,
        "n": hop.alias,
        "u": getpass.getuser(),
        "d": os.path.expanduser("~"),
        "L": local.split(".")[0],
        "l": local,
    }

    def substitute(match: re.Match[str]) -> str:
        token = match.group(1)
        if not token:
            raise SSHConfigError(
                f"ProxyCommand {command!r} of {hop.alias} ends in a lone %; write %% for a %"
            )
        if token not in values:
            raise SSHConfigError(
                f"ProxyCommand {command!r} of {hop.alias}: unknown token %{token}; "
                f"known: {' '.join('%' + t for t in values)}"
            )
        value = values[token]
        if token in "hrn" and not _SAFE_TOKEN_VALUE.fullmatch(value):
            raise SSHConfigError(
                f"ProxyCommand of {hop.alias}: %{token} would be {value!r}, not a plain name"
            )
        return value

    return re.sub(r"%(.?)", substitute, command, flags=re.DOTALL)


def _jump_chain(
    spec: str | None, config: paramiko.SSHConfig, fallback_keys: tuple[str, ...], depth: int = 0
) -> tuple[tuple[Endpoint, ...], str | None]:
    """The hops of a ProxyJump value, each jump host resolved through the SSH config and, like
    `ssh -J`, the first one reached through its own ProxyJump or ProxyCommand when it has one;
    with the ProxyCommand that reaches the first hop, if any."""
    if not _given(spec):
        return (), None
    if depth > _MAX_JUMP_DEPTH:
        raise SSHConfigError(f"ProxyJump nests deeper than {_MAX_JUMP_DEPTH} hops (a loop?): {spec!r}")
    hops: list[Endpoint] = []
    proxy_command = None
    for item in spec.split(","):  # type: ignore[union-attr]
        user, alias, port = _split_user_host_port(item.strip())
        hop = _endpoint(alias, config, user, port, None, fallback_keys)
        if not hops:
            own_jump, own_command = _proxy_settings(alias, config.lookup(alias))
            if own_jump:
                before, proxy_command = _jump_chain(own_jump, config, fallback_keys, depth + 1)
                hops.extend(before)
            elif own_command:
                proxy_command = expand_proxy_command(own_command, hop)
        hops.append(hop)
    return tuple(hops), proxy_command


def resolve_route(options: SSHOptions, config: paramiko.SSHConfig) -> Route:
    """Where and how to connect: host-config values first, then the SSH config, then defaults.

    Jump hosts use the IdentityFile of their own SSH-config entry, else the target's key file."""
    target = _endpoint(options.address, config, options.user, options.port, options.key_file)
    entry = config.lookup(options.address)
    jump_spec, command = _proxy_settings(options.address, entry, options.proxy_jump, options.proxy_command)
    jumps, proxy_command = _jump_chain(jump_spec, config, target.key_files)
    if command:
        proxy_command = expand_proxy_command(command, target)
    known = options.known_hosts
    if not known:
        files = entry.get("userknownhostsfile", "").split()
        known = files[0] if files else "~/.ssh/known_hosts"
    return Route(
        target=target, jumps=jumps, known_hosts=os.path.expanduser(known), proxy_command=proxy_command
    )


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


# --- ProxyCommand -----------------------------------------------------------------------------------------


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


# --- the persistent shell: what it is sent, how its answers are framed (pure) ---------------------------


def shell_init(token: str) -> str:
    """The first line the persistent shell reads: a private temp directory, removed when the shell
    exits however it ends (EOF on stdin, a closed session, HUP, TERM), then `<token> <pid> <dir>`."""
    return (
        "d=$(mktemp -d) || exit 1; trap 'rm -rf \"$d\"' EXIT; "
        "trap 'exit 129' HUP; trap 'exit 141' PIPE; trap 'exit 143' TERM; "
        f'printf "%s %s %s\\n" {token} "$$" "$d"\n'
    )


def shell_command(command: str, token: str) -> str:
    """One command for the persistent shell. It runs as `sh -c '<command>'`, stdin from /dev/null,
    stdout and stderr into two files of its own (a background child it leaves behind writes there,
    never into the next command's answer); then each file goes back framed on its stream as
    `<token>s\\n<bytes>\\n<token> <exit status>\\n` (see `frame`)."""
    o, e = f'"$d/{token}.o"', f'"$d/{token}.e"'
    return (
        f"printf '%s\\n' {token}s; printf '%s\\n' {token}s >&2; "
        f"sh -c {shlex.quote(command)} </dev/null >{o} 2>{e}; r=$?; "
        f"[ ! -s {o} ] || cat {o}; printf '\\n%s %s\\n' {token} \"$r\"; "
        f"[ ! -s {e} ] || cat {e} >&2; printf '\\n%s %s\\n' {token} \"$r\" >&2; "
        f"rm -f {o} {e} 2>/dev/null\n"
    )


def frame(buf: bytes | bytearray, token: str) -> tuple[bytes, int] | None:
    """(payload, exit status) once `buf` holds a whole frame of `shell_command`, else None. Bytes
    before the start marker (a login script's noise) are skipped; the random token is in no output."""
    start, end = f"{token}s\n".encode(), f"\n{token} ".encode()
    if not buf.endswith(b"\n"):
        return None
    first = buf.find(start)
    if first < 0:
        return None
    body = first + len(start)
    last = buf.rfind(end, body)
    status = buf[last + len(end) : -1] if last >= 0 else b""
    if not status.isdigit():
        return None
    return bytes(buf[body:last]), int(status)


class _NoShell(SSHError):
    """The host's persistent shell did not start (then each command gets its own session)."""


class _ShellGone(SSHError):
    """The persistent shell's session ended before the command's answer was complete."""

    def __init__(self, why: str, may_have_run: bool):
        super().__init__(why)
        self.may_have_run = may_have_run


@dataclass
class _Shell:
    """A persistent `sh` on the host, used by one thread at a time."""

    chan: paramiko.Channel
    pid: int
    # its private temp directory (for the commands' output files)
    tmp: str

    def usable(self, transport: paramiko.Transport) -> bool:
        chan = self.chan
        return (
            chan.get_transport() is transport
            and transport.is_active()
            and not (chan.closed or chan.eof_received or chan.exit_status_ready())
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chan.shutdown_write()  # EOF on its stdin: sh exits, its EXIT trap removes tmp
        self.chan.close()


def _time_left(deadline: float | None) -> float | None:
    """Seconds to `deadline` (None: no deadline); TimeoutError once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _drain(chan: paramiko.Channel, out: bytearray, err: bytearray) -> bool:
    """Move what arrived on stdout and stderr into `out` and `err`; True if anything did."""
    drained = False
    while chan.recv_ready():
        out += chan.recv(65536)
        drained = True
    while chan.recv_stderr_ready():
        err += chan.recv_stderr(65536)
        drained = True
    return drained


def _wait_readable(chan: paramiko.Channel, left: float | None) -> None:
    # the channel's fileno becomes readable on stdout or stderr data, or on EOF
    select.select([chan], [], [], min(left, 1.0) if left is not None else 1.0)


def _ended(chan: paramiko.Channel) -> bool:
    """The session ended and everything it sent has been read."""
    return (chan.closed or chan.eof_received) and not chan.recv_ready() and not chan.recv_stderr_ready()


def _await_ready(chan: paramiko.Channel, token: str, program: str, timeout: float) -> tuple[int, str]:
    """(pid, temp dir) from the persistent shell's first line; whatever the login shell printed
    before it is skipped."""
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    marker = f"{token} ".encode()
    while True:
        drained = _drain(chan, out, err)
        at = out.find(marker)
        if at >= 0 and out.find(b"\n", at) >= 0:
            pid, _, tmp = out[at + len(marker) : out.find(b"\n", at)].decode(errors="replace").partition(" ")
            return int(pid), tmp
        if _ended(chan):
            said = (err or out).decode(errors="replace").strip()[-500:]
            raise _NoShell(f"`{program}` exited: {said or 'no output'}")
        try:
            left = _time_left(deadline)
        except TimeoutError:
            raise _NoShell(f"`{program}` did not answer within {timeout}s") from None
        if not drained:
            _wait_readable(chan, left)


def _run_framed(chan: paramiko.Channel, command: str, timeout: float | None) -> tuple[bytes, bytes, int]:
    """Run one command on a persistent shell: (stdout, stderr, exit status)."""
    token = uuid.uuid4().hex
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        chan.sendall(shell_command(command, token).encode())
    except (OSError, EOFError, paramiko.SSHException) as e:
        # the shell runs a line only once it has all of it: a line cut short never ran
        raise _ShellGone(f"could not send the command: {e}", may_have_run=False) from e
    out, err = bytearray(), bytearray()
    out_frame = err_frame = None
    while True:
        left = _time_left(deadline)  # every round: a command that never stops talking still times out
        drained = _drain(chan, out, err)
        if out_frame is None:
            out_frame = frame(out, token)
        if err_frame is None:
            err_frame = frame(err, token)
        if out_frame is not None and err_frame is not None:
            return out_frame[0], err_frame[0], out_frame[1]
        if _ended(chan):
            transport = chan.get_transport()
            # over a live connection the session's output all arrived: no start marker, nothing ran
            started = f"{token}s\n".encode() in out or transport is None or not transport.is_active()
            raise _ShellGone("the shell's session ended", may_have_run=started)
        if not drained:
            _wait_readable(chan, left)


# --- the transport --------------------------------------------------------------------------------------


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
        self._idle: list[_Shell] = []
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
            except _NoShell as e:
                self._no_shell = str(e)
                log.warning(
                    "%s: no persistent shell (%s); one SSH session per command from now on", self.host, e
                )
                return self._run_in_session(command, timeout)
            try:
                out, err, code = _run_framed(shell.chan, command, timeout)
            except _ShellGone as e:
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

    def _take_shell(self) -> _Shell:
        """An idle shell of the live connection, else a new one."""
        transport = self.connect()
        stale: list[_Shell] = []
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

    def _open_shell(self) -> _Shell:
        chan = self._open_session()
        try:
            # its wake-up pipe, made now: made at a later first select it would show as two new fds
            chan.fileno()
            chan.exec_command(self.shell_program)
            token = uuid.uuid4().hex
            chan.sendall(shell_init(token).encode())
            pid, tmp = _await_ready(chan, token, self.shell_program, self.options.connect_timeout_s)
        except (paramiko.SSHException, EOFError, OSError) as e:
            chan.close()
            raise TransportError(f"{self.host}: cannot start a shell: {e}") from e
        except BaseException:
            chan.close()
            raise
        with self._pool_lock:
            self.shells += 1
        return _Shell(chan, pid, tmp)

    def _kill(self, shell: _Shell) -> None:
        """End the shell of a timed-out command: SIGKILL to the shell's process group (sshd made it a
        session leader), so to the command and all it started there, though not to servers started
        detached (they have their own session); its temp directory removed; the next command opens a
        new shell. Killed before its session is closed: a closed session ends the shell at once, and
        the command, orphaned, would be out of reach. A shell that leads no group: it and its children."""
        children = f"$(ps -e -o pid=,ppid= | awk -v p={shell.pid} '$2 == p {{print $1}}')"
        line = (
            f"kill -KILL -{shell.pid} 2>/dev/null || kill -KILL {shell.pid} {children} 2>/dev/null; "
            f"rm -rf {shlex.quote(shell.tmp)}; true"
        )
        try:
            self._run_in_session(line, timeout=min(10.0, self.options.connect_timeout_s))
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
            out, err, code = self._collect(chan, timeout)
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

    @staticmethod
    def _collect(chan: paramiko.Channel, timeout: float | None) -> tuple[bytes, bytes, int]:
        """Drain stdout and stderr together (so neither pipe can fill and block the command), then
        wait for the exit status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        while True:
            left = _time_left(deadline)  # every round: a command that never stops talking still times out
            drained = _drain(chan, out, err)
            # closed is not the end: what arrived before the close may still be in the buffers
            if _ended(chan):
                break
            if not drained:
                _wait_readable(chan, left)
        if not chan.status_event.wait(_time_left(deadline)):
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
