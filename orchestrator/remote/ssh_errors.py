"""The SSH transport's errors: each says what to fix, and each is a `TransportError`, so the callers that
handle a host's failures need not know the transport."""

from __future__ import annotations

from orchestrator.remote.base import TransportError


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
