"""Where an SSH host is and how to reach it, resolved before anything connects (pure but for reading the
SSH config file): a host's config -> `SSHOptions` -> `Route`, the hops to log in to in order.

Connection settings come from the host config (`ssh.*`) and from the OpenSSH client config
(`ssh.config_file`, read with `paramiko.SSHConfig`), explicit host-config values winning, as on the
`ssh` command line: `HostName`, `User`, `Port`, `IdentityFile`, `IdentitiesOnly`, `ProxyJump`
(chains and jump hosts that have their own `ProxyJump` or `ProxyCommand` too), `ProxyCommand` (run
as OpenSSH runs it, see ssh_proxy.py, its %h %p %r %n %u %d %l %L %% tokens expanded here with the
final host, port and user of its hop) and `UserKnownHostsFile`.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import paramiko

from orchestrator.remote.ssh_errors import SSHConfigError
from orchestrator.remote.ssh_hostkeys import HOST_KEY_POLICIES

# OpenSSH's sshd allows 10 sessions per connection by default (MaxSessions); stay below it.
DEFAULT_MAX_SESSIONS = 8
_MAX_JUMP_DEPTH = 8


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
