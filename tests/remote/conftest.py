"""Real OpenSSH servers for the transport tests, never the user's own ~/.ssh.

`sshd`: one sshd on 127.0.0.1 (a free port) with a generated host key, an authorized user key and a
known_hosts file, all in a temporary directory, for the whole session. `netns_hosts`: where root may
create network namespaces, two namespaces ("prefill", "decode", names unique to this run) joined by a
bridge, each with its own address and its own sshd on port 22: two "hosts" for cross-host tests.
Everything is stopped and removed in `finally`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.services import record_service_start

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
SETUP_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ci-ssh-setup.sh"
USER = os.environ.get("USER") or __import__("getpass").getuser()


def keygen(path: Path, kind: str = "ed25519") -> Path:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", "heisenhunt-test", "-f", str(path)], check=True
    )
    return path


def public_key(path: Path) -> str:
    """`type base64` of a key's .pub file."""
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


@dataclass
class SshServer:
    address: str
    port: int
    user: str
    host_key: Path
    key_file: Path
    known_hosts: Path
    log: Path
    proc: subprocess.Popen

    def host_cfg(self, **ssh: Any) -> dict[str, Any]:
        """A host config dict for this server; `ssh` entries override the defaults."""
        block = {
            "user": self.user,
            "port": self.port,
            "key_file": str(self.key_file),
            "known_hosts": str(self.known_hosts),
            # an empty config path: never read the user's ~/.ssh/config
            "config_file": str(self.known_hosts.parent / "no-ssh-config"),
            "connect_timeout_s": 5.0,
        }
        block.update(ssh)
        return {"transport": "ssh", "address": self.address, "ssh": block}

    def known_hosts_line(self, host_key: Path | None = None) -> str:
        return f"{known_hosts_name(self.address, self.port)} {public_key(host_key or self.host_key)}\n"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Keys:
    dir: Path
    user: Path
    other_user: Path
    host: Path
    other_host: Path


INSTALL_SSHD = "apt-get install -y openssh-server"
INSTALL_KEYGEN = "apt-get install -y openssh-client"


def sshd_missing() -> str | None:
    """Why the tests that start a real sshd cannot run here (None: they can). A path that is there but
    no program to run (a machine that hides it) counts as missing, as it would fail only at the start."""
    if not (Path(SSHD).is_file() and os.access(SSHD, os.X_OK)):
        return f"no OpenSSH server to run at {SSHD} ({INSTALL_SSHD})"
    if not shutil.which("ssh-keygen"):
        return f"no ssh-keygen ({INSTALL_KEYGEN})"
    return None


@pytest.fixture(scope="session")
def ssh_keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    missing = sshd_missing()
    if missing:
        pytest.skip(missing)
    d = tmp_path_factory.mktemp("sshkeys")
    return Keys(d, keygen(d / "user"), keygen(d / "other_user"), keygen(d / "host"), keygen(d / "other_host"))


def _sshd_config(d: Path, address: str, port: int, host_key: Path) -> Path:
    """The project's one sshd_config (scripts/ci-ssh-setup.sh writes it for CI as well), in `d`."""
    # DEBUG1 logs keepalive requests and direct-tcpip (ProxyJump) channels, which tests check
    argv = ["bash", str(SETUP_SCRIPT), "config", address, str(port), str(host_key), str(d), "DEBUG1"]
    cfg = d / "sshd_config"
    cfg.write_text(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return cfg


def _wait_banner(address: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((address, port), timeout=1) as s:
            s.settimeout(2)
            if s.recv(64).startswith(b"SSH-2.0"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"sshd on {address}:{port} not ready within {timeout}s: {log.read_text()[-2000:]}")


@contextlib.contextmanager
def run_sshd(d: Path, keys: Keys, address: str, port: int, netns: str | None = None) -> Iterator[SshServer]:
    """An sshd in the foreground (-D), logging to a file; killed with its process group at exit."""
    d.mkdir(parents=True, exist_ok=True)
    # sshd refuses to start without its privilege separation directory
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    (d / "authorized_keys").write_text(Path(f"{keys.user}.pub").read_text())
    cfg = _sshd_config(d, address, port, keys.host)
    log = d / "sshd.log"
    # -E: log to the file; with -e the DEBUG lines would leak into the sessions' stderr
    argv = [SSHD, "-D", "-E", str(log), "-f", str(cfg)]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    began = time.monotonic()
    with log.open("ab") as logf:
        proc = subprocess.Popen(
            argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    try:
        _wait_banner(address, port, proc, log)
        record_service_start("sshd" + (" (network namespace)" if netns else ""), time.monotonic() - began)
        known = d / "known_hosts"
        known.write_text(f"{known_hosts_name(address, port)} {public_key(keys.host)}\n")
        yield SshServer(address, port, USER, keys.host, keys.user, known, log, proc)
    finally:
        # the listener and its per-connection children share the group; user sessions do not
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def sshd(ssh_keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    with run_sshd(tmp_path_factory.mktemp("sshd"), ssh_keys, "127.0.0.1", free_port()) as server:
        yield server


@pytest.fixture(autouse=True)
def _no_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    # an ssh-agent of whoever runs the tests must not log us in with a key the test did not give
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


# --- network namespaces ---------------------------------------------------------------------------------


@dataclass
class Netns:
    names: dict[str, str]  # role -> namespace name
    hosts: dict[str, SshServer]  # role -> the sshd inside it
    gateway: str  # this (root) namespace's address on the bridge
    unused: str  # an address on the bridge nobody answers for


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _netns_permitted(probe: str) -> str | None:
    """None when namespaces can be created here, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if not shutil.which("ip"):
        return "iproute2 (`ip`) is not installed"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def _free_subnet() -> str | None:
    """A 10.213.N.0/29 not already used on this machine (N from the pid: parallel runs differ)."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    for i in range(64):
        n = (os.getpid() + i) % 250 + 1
        if f"10.213.{n}." not in used:
            return f"10.213.{n}"
    return None


@pytest.fixture(scope="session")
def netns_hosts(ssh_keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Netns]:
    tag = f"hh-{os.getpid()}"
    reason = _netns_permitted(f"{tag}-probe")
    if reason:
        pytest.skip(f"network-namespace tests skipped: {reason}")
    net = _free_subnet()
    if net is None:
        pytest.skip("network-namespace tests skipped: no free 10.213.N.0/29 subnet")
    short = f"hh{os.getpid() % 100000}"  # interface names: at most 15 characters
    bridge = f"{short}br"
    roles = {"prefill": 2, "decode": 3}
    names = {role: f"{tag}-{role}" for role in roles}
    created_ns: list[str] = []
    steps: list[tuple[str, ...]] = [
        ("link", "add", bridge, "type", "bridge"),
        ("addr", "add", f"{net}.1/29", "dev", bridge),
        ("link", "set", bridge, "up"),
    ]
    try:
        with contextlib.ExitStack() as servers:
            for step in steps:
                _check(_ip(*step), step)
            for role, host in roles.items():
                ns, outer, inner = names[role], f"{short}{role[0]}", f"{short}{role[0]}n"
                _check(_ip("netns", "add", ns), ("netns", "add", ns))
                created_ns.append(ns)
                for step in [
                    ("link", "add", outer, "type", "veth", "peer", "name", inner),
                    ("link", "set", inner, "netns", ns),
                    ("link", "set", outer, "master", bridge, "up"),
                    ("-n", ns, "addr", "add", f"{net}.{host}/29", "dev", inner),
                    ("-n", ns, "link", "set", inner, "up"),
                    ("-n", ns, "link", "set", "lo", "up"),
                ]:
                    _check(_ip(*step), step)
            hosts = {
                role: servers.enter_context(
                    run_sshd(
                        tmp_path_factory.mktemp(f"sshd-{role}"), ssh_keys, f"{net}.{host}", 22, names[role]
                    )
                )
                for role, host in roles.items()
            }
            yield Netns(names, hosts, f"{net}.1", f"{net}.6")
    finally:
        for ns in created_ns:
            _ip("netns", "del", ns)  # removes the veth inside, and with it its peer
        _ip("link", "del", bridge)


def _check(result: subprocess.CompletedProcess, step: tuple[str, ...]) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(step)} failed: {result.stderr.strip()}")
