"""Host-key checking of the SSH transport: a server's key is checked against `ssh.known_hosts`, through a
proxy or a jump as on a direct connection.

An unknown or a changed key is refused by default; `ssh.host_key_policy: accept-new` trusts a host
seen for the first time (logged as a warning, its key appended to known_hosts), and still refuses a
changed key, like OpenSSH's StrictHostKeyChecking=accept-new. paramiko compares a known key itself;
this module decides what happens to an unknown one and says what to do about a changed one.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from pathlib import Path

import paramiko

from orchestrator.remote.ssh_errors import HostKeyChanged, UnknownHostKey

log = logging.getLogger(__name__)


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


# ssh.host_key_policy -> what happens to a key that known_hosts does not have
_POLICIES: dict[str, type[paramiko.MissingHostKeyPolicy]] = {
    "reject": _RejectUnknown,
    "accept-new": _AcceptNew,
}
HOST_KEY_POLICIES = tuple(_POLICIES)


def missing_host_key_policy(policy: str, known_hosts: str) -> paramiko.MissingHostKeyPolicy:
    """The paramiko policy for `ssh.host_key_policy` (one of HOST_KEY_POLICIES, checked by SSHOptions)."""
    return _POLICIES[policy](known_hosts)


def host_key_changed(where: str, known_hosts: str, e: paramiko.BadHostKeyException) -> HostKeyChanged:
    """The error for a server whose key differs from the one known_hosts has for it."""
    return HostKeyChanged(
        f"host key of {where} CHANGED: {known_hosts} has {e.expected_key.get_name()} "
        f"{fingerprint(e.expected_key)}, the server sent {e.key.get_name()} {fingerprint(e.key)}. "
        f"Someone may be intercepting the connection; if the host was reinstalled, remove the old "
        f"entry (ssh-keygen -R) and add the new one"
    )
