"""The local transport against the shared transport contract (the same shell lines SSH hosts run)."""

from __future__ import annotations

import pytest
from transport_contract import TransportContract

from orchestrator.remote import LocalTransport, make_transport, make_transports


class TestLocalTransport(TransportContract):
    @pytest.fixture
    def transport(self) -> LocalTransport:
        with LocalTransport() as t:
            yield t


def test_make_transport_local_from_config() -> None:
    t = make_transport({"transport": "local", "address": "127.0.0.1"})
    assert isinstance(t, LocalTransport) and t.host == "127.0.0.1"
    assert t.run_shell("echo $((6 * 7))").stdout == "42\n"


def test_make_transport_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown transport 'telnet'"):
        make_transport({"transport": "telnet", "address": "x"})


def test_roles_on_one_local_host_share_a_transport() -> None:
    ts = make_transports(
        {
            "prefill": {"transport": "local", "address": "127.0.0.1"},
            "decode": {"transport": "local", "address": "127.0.0.1"},
            "router": {"transport": "local", "address": "localhost"},
        }
    )
    assert ts["prefill"] is ts["decode"] and ts["router"] is not ts["prefill"]
