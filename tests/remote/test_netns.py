"""Cross-host process control for real: two network namespaces ("prefill", "decode"), each its own
host with its own address and its own sshd, joined by a bridge (conftest.netns_hosts). Skipped, with
the reason, where network namespaces cannot be created."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Netns, SshServer
from transport_contract import _pgid_members

from orchestrator.remote import SSHTransport, close_all, make_transport, make_transports
from orchestrator.remote.ssh_errors import HostUnreachable

pytestmark = [pytest.mark.ssh, pytest.mark.netns]

FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def _netns_inode(t: SSHTransport) -> str:
    return t.run_shell("readlink /proc/self/ns/net").stdout.strip()


def test_each_namespace_is_a_separate_host(netns_hosts: Netns) -> None:
    ts = make_transports({role: s.host_cfg() for role, s in netns_hosts.hosts.items()})
    try:
        assert ts["prefill"] is not ts["decode"]
        inodes = {role: _netns_inode(t) for role, t in ts.items()}
        assert inodes["prefill"] != inodes["decode"] != os.readlink("/proc/self/ns/net")
        for role, t in ts.items():
            addrs = t.run_shell("ip -4 -o addr show").stdout
            assert netns_hosts.hosts[role].address in addrs
            other = netns_hosts.hosts["decode" if role == "prefill" else "prefill"].address
            assert other not in addrs
    finally:
        close_all(ts)


def test_cross_host_server_started_on_one_host_is_reached_from_the_other_and_stopped_later(
    netns_hosts: Netns, tmp_path: Path
) -> None:
    prefill, decode = netns_hosts.hosts["prefill"], netns_hosts.hosts["decode"]
    served = tmp_path / "www"
    served.mkdir()
    (served / "kv.txt").write_text("bootstrap ok")
    port = 18080
    p = make_transport(prefill.host_cfg())
    try:
        pid = p.start_detached(
            [sys.executable, "-m", "http.server", str(port), "--bind", prefill.address],
            {"ROLE": "prefill"},
            str(tmp_path / "prefill.log"),
            str(tmp_path / "prefill.pid"),
            cwd=str(served),
        )
    finally:
        p.close()  # the server must outlive the session that started it
    try:
        ns = subprocess.run(
            ["ip", "netns", "identify", str(pid)], capture_output=True, text=True
        ).stdout.strip()
        assert ns == netns_hosts.names["prefill"]
        url = f"http://{prefill.address}:{port}/kv.txt"
        with make_transport(decode.host_cfg()) as d:
            deadline = time.monotonic() + 10
            while True:
                got = d.run([sys.executable, "-c", FETCH, url], check=False)
                if got.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert got.stdout.strip() == "bootstrap ok", got.stderr
            # stopped from a second connection to the prefill host
            with make_transport(prefill.host_cfg()) as p2:
                assert p2.is_alive(pid)
                assert p2.stop_group(pid, grace_s=5) is False
                assert not p2.group_alive(pid)
            assert d.run([sys.executable, "-c", FETCH, url], check=False).returncode != 0
    finally:
        for q in _pgid_members(pid):
            os.kill(q, 9)


def test_unroutable_host_fails_clearly_within_the_timeout(netns_hosts: Netns, sshd: SshServer) -> None:
    # an address on the bridge that no host answers for: the SYN goes nowhere
    cfg = sshd.host_cfg(port=22, connect_timeout_s=1.5)
    cfg["address"] = netns_hosts.unused
    t0 = time.monotonic()
    with pytest.raises(
        HostUnreachable, match=rf"{netns_hosts.unused}.*(within ssh.connect_timeout_s=1.5s|cannot)"
    ):
        make_transport(cfg).run_shell("true")
    assert time.monotonic() - t0 < 4.0


def test_proxy_jump_from_loopback_bastion_into_a_namespace_host(
    netns_hosts: Netns, sshd: SshServer, tmp_path: Path
) -> None:
    decode = netns_hosts.hosts["decode"]
    known = tmp_path / "known_hosts"
    known.write_text(sshd.known_hosts_line() + decode.known_hosts_line())
    config = tmp_path / "ssh_config"
    config.write_text(f"""
Host bastion
    HostName {sshd.address}
    Port {sshd.port}
    User {sshd.user}
    IdentityFile {sshd.key_file}
Host decode-node
    HostName {decode.address}
    User {decode.user}
    IdentityFile {decode.key_file}
    ProxyJump bastion
""")
    mark = len(sshd.log_text())
    host = {
        "transport": "ssh",
        "address": "decode-node",
        "ssh": {"config_file": str(config), "known_hosts": str(known)},
    }
    with make_transport(host) as t, make_transport(decode.host_cfg()) as direct:
        assert _netns_inode(t) == _netns_inode(direct)
    time.sleep(0.2)
    assert f"target {decode.address} port 22" in sshd.log_text()[mark:]
