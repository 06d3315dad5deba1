"""Hosts, local or over SSH, behind one `Transport` interface (see base.py).

`make_transport(host_cfg)` builds the transport for one host config; `make_transports(hosts)` builds
them for every role, sharing one transport (one SSH connection) between roles that live on the same
host with the same login, so an arm opens one connection per host. Close them with `close_all`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from orchestrator.remote.base import CommandFailed, CommandResult, Transport, TransportError
from orchestrator.remote.local import LocalTransport

log = logging.getLogger(__name__)

__all__ = [
    "CommandFailed",
    "CommandResult",
    "LocalTransport",
    "SSHTransport",
    "Transport",
    "TransportError",
    "close_all",
    "make_transport",
    "make_transports",
]


def __getattr__(name: str) -> Any:
    # paramiko is imported only when SSH is used: base.py and local.py stay light
    if name == "SSHTransport":
        from orchestrator.remote.ssh import SSHTransport

        return SSHTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kind(host_cfg: Any) -> str:
    kind = (
        host_cfg.get("transport") if isinstance(host_cfg, Mapping) else getattr(host_cfg, "transport", None)
    )
    return str(kind or "local")


def _address(host_cfg: Any) -> str:
    addr = host_cfg.get("address") if isinstance(host_cfg, Mapping) else getattr(host_cfg, "address", None)
    return str(addr or "localhost")


def make_transport(host_cfg: Any, name: str | None = None) -> Transport:
    """The transport for one host config (`transport: local|ssh`, `address`, optional `ssh:` block).
    `name` labels the host in messages (default: its address)."""
    kind = _kind(host_cfg)
    if kind == "local":
        return LocalTransport(host=name or _address(host_cfg))
    if kind == "ssh":
        from orchestrator.remote.ssh import SSHTransport
        from orchestrator.remote.ssh_route import ssh_options_from_host

        return SSHTransport(ssh_options_from_host(host_cfg), host=name)
    raise ValueError(f"unknown transport {kind!r} for host {_address(host_cfg)}: use 'local' or 'ssh'")


def _connection_key(host_cfg: Any) -> tuple:
    if _kind(host_cfg) == "local":
        return ("local", _address(host_cfg))
    from orchestrator.remote.ssh_route import ssh_options_from_host

    return ("ssh", ssh_options_from_host(host_cfg))


def make_transports(hosts: Mapping[str, Any]) -> dict[str, Transport]:
    """role -> transport; roles whose host config names the same connection share one transport."""
    shared: dict[tuple, Transport] = {}
    out: dict[str, Transport] = {}
    for role, host_cfg in hosts.items():
        key = _connection_key(host_cfg)
        if key not in shared:
            shared[key] = make_transport(host_cfg)
        out[role] = shared[key]
    return out


def close_all(transports: Iterable[Transport] | Mapping[str, Transport]) -> None:
    """Close each distinct transport once; one failing to close does not keep the others open."""
    items = transports.values() if isinstance(transports, Mapping) else transports
    seen: set[int] = set()
    for t in items:
        if id(t) in seen:
            continue
        seen.add(id(t))
        try:
            t.close()
        except Exception:  # closing is best effort, but say so
            log.warning("closing the transport to %s failed", t.host, exc_info=True)
