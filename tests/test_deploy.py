"""The co-restart lifecycle with real processes on loopback (a plain HTTP server stands in for each role)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from orchestrator.config.plan import ArmPlan, server_url
from orchestrator.remote.base import TransportError
from orchestrator.remote.local import LocalTransport
from orchestrator.run.deploy import DeployError, Deployment, http_get, router_waiting_for, server_start_groups
from tests.conftest import listening, plan_of

ROLES = ("prefill", "decode", "router")


def _cfg(compose_cfg, **extra):
    overrides = [f"deployment.roles.{r}.module=http.server" for r in ROLES]
    overrides += [f"deployment.roles.{r}.health_path=/" for r in ROLES]
    overrides += [f"deployment.roles.{r}.startup_timeout_s=15" for r in ROLES]
    overrides += ["deployment.warmup=false", "deployment.stop_grace_s=5"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    return compose_cfg(*overrides)


def _plan(cfg, bad_role: str | None = None) -> ArmPlan:
    """The composed arm, each role's server replaced by a plain HTTP server on its port."""
    plan = plan_of(cfg)
    roles = {}
    for role in ROLES:
        host = cfg.cluster.hosts[role]
        argv = [sys.executable, "-m", "http.server", str(host.port), "--bind", "127.0.0.1"]
        if role == bad_role:
            argv.append("--no-such-flag")
        url = f"http://127.0.0.1:{host.port}/"
        roles[role] = replace(plan.roles[role], env={"HH_TEST": "1"}, flags={}, argv=argv, health_url=url)
    return replace(plan, factors={}, roles=roles, signature="test", router_url="")


def _deployment(cfg, plan, label="run1"):
    transports = {r: LocalTransport() for r in ROLES}
    return Deployment(plan, transports, run_label=label)


@pytest.fixture
def deployments():
    made: list[Deployment] = []
    yield made
    for d in made:
        d.stop_all()


def test_co_restart_replaces_every_server_of_an_earlier_run_and_teardown_leaves_nothing(
    compose_cfg, deployments
):
    cfg = _cfg(compose_cfg)
    plan = _plan(cfg)
    first = _deployment(cfg, plan, "run1")
    deployments.append(first)
    first.co_restart()
    old = dict(first.started)
    assert set(old) == set(ROLES)
    assert all(listening(int(cfg.cluster.hosts[r].port)) for r in ROLES)
    assert list(first.startup_s) == ["prefill", "decode", "router"]

    # a new run (as after a crash: it knows nothing but the pid files) stops the old servers first
    second = _deployment(cfg, plan, "run2")
    deployments.append(second)
    second.co_restart()
    t = LocalTransport()
    assert not any(t.group_alive(pid) for pid in old.values())
    new = dict(second.started)
    assert all(t.group_alive(pid) for pid in new.values())

    second.stop_all()
    assert not any(t.group_alive(pid) for pid in [*new.values(), *old.values()])
    assert not any(listening(int(cfg.cluster.hosts[r].port)) for r in ROLES)
    assert not any(os.path.exists(f"{cfg.cluster.hosts[r].work_dir}/{r}.pid") for r in ROLES)


def test_a_server_that_dies_at_start_fails_fast_with_its_log_tail_and_later_roles_never_start(
    compose_cfg, deployments
):
    cfg = _cfg(compose_cfg)
    d = _deployment(cfg, _plan(cfg, bad_role="decode"))
    deployments.append(d)
    t0 = time.monotonic()
    with pytest.raises(DeployError) as err:
        d.co_restart()
    assert time.monotonic() - t0 < 10
    assert err.value.role == "decode"
    assert "unrecognized arguments: --no-such-flag" in str(err.value)
    assert "router" not in d.started
    assert not listening(int(cfg.cluster.hosts.router.port))


def test_health_gate_times_out_naming_the_url(compose_cfg, deployments):
    cfg = _cfg(
        compose_cfg,
        **{
            "deployment.roles.prefill.health_path": "/missing",
            "deployment.roles.prefill.startup_timeout_s": 2,
        },
    )
    plan = _plan(cfg)
    roles = dict(plan.roles)
    port = cfg.cluster.hosts.prefill.port
    roles["prefill"] = replace(roles["prefill"], env={}, health_url=f"http://127.0.0.1:{port}/missing")
    d = _deployment(cfg, replace(plan, roles=roles, signature="t"))
    deployments.append(d)
    with pytest.raises(DeployError, match=r"not healthy within 2s .*missing.*HTTP 404"):
        d.co_restart()


def test_a_foreign_listener_on_a_role_port_is_reported_not_killed(compose_cfg, deployments):
    cfg = _cfg(compose_cfg)
    port = int(cfg.cluster.hosts.decode.port)
    foreign = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not listening(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        d = _deployment(cfg, _plan(cfg))
        deployments.append(d)
        with pytest.raises(DeployError, match=f"port {port} .* did not start"):
            d.co_restart()
        assert foreign.poll() is None  # still running: not ours to stop
    finally:
        foreign.kill()
        foreign.wait()


def test_a_recycled_pid_in_a_stale_pid_file_is_left_alone(compose_cfg, deployments, tmp_path):
    cfg = _cfg(compose_cfg)
    bystander = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        pid_file = f"{cfg.cluster.hosts.prefill.work_dir}/prefill.pid"
        LocalTransport().write_file(pid_file, f"{bystander.pid}\n".encode())
        d = _deployment(cfg, _plan(cfg))
        deployments.append(d)
        d.stop_role("prefill")
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


# --- servers that share a GPU, and the router's registration -------------------------------------------

# a stand-in server that takes a while to listen, as a real one loads and captures first
SLOW_SERVER = (
    "import runpy, sys, time; time.sleep({delay}); "
    "sys.argv = ['http.server', '{port}', '--bind', '127.0.0.1']; "
    "runpy.run_module('http.server', run_name='__main__')"
)


@pytest.mark.parametrize("sequential", [True, False])
def test_servers_that_share_a_gpu_start_one_after_the_other(compose_cfg, deployments, sequential):
    cfg = _cfg(compose_cfg)
    plan = _plan(cfg)
    port = cfg.cluster.hosts.prefill.port
    slow = replace(
        plan.roles["prefill"], argv=[sys.executable, "-c", SLOW_SERVER.format(delay=1.5, port=port)]
    )
    plan = replace(plan, roles={**plan.roles, "prefill": slow}, sequential_start=sequential)
    events: list[str] = []
    d = Deployment(plan, {r: LocalTransport() for r in ROLES}, run_label="share", on_event=events.append)
    deployments.append(d)
    d.start_servers()
    names = [e.split(" after")[0] for e in events]
    assert set(d.startup_s) == {"prefill", "decode"}
    if sequential:  # decode launched only once prefill answered
        assert names.index("prefill healthy") < names.index("starting decode")
        assert d.startup_s["decode"] < d.startup_s["prefill"]
    else:  # both launched at once, the gate the slowest one's
        assert names.index("starting decode") < names.index("prefill healthy")


def test_the_router_gate_waits_until_the_real_router_has_registered_both_servers(compose_cfg, deployments):
    """The real sglang-router answers /health at once but 503s requests until it has registered its
    workers; the gate holds the router until its /workers lists this arm's prefill and decode."""
    plan = plan_of(compose_cfg("deployment.warmup=false"))
    d = Deployment(plan, {r: LocalTransport() for r in ROLES}, run_label="gate")
    deployments.append(d)
    gate = threading.Thread(target=d.start_role, args=("router",), daemon=True)
    gate.start()
    deadline = time.monotonic() + 30
    while http_get(plan.roles["router"].health_url, timeout=2.0)[0] != 200:
        assert time.monotonic() < deadline, "the router never answered /health"
        time.sleep(0.2)
    time.sleep(1.0)
    ready, seen = d.ready("router")
    assert not ready and "has not registered prefill" in seen and "decode" in seen
    assert gate.is_alive() and "router" not in d.startup_s
    d.start_servers()
    gate.join(60)
    assert "router" in d.startup_s
    servers = {r: server_url(plan.roles[r].host) for r in ("prefill", "decode")}
    assert (
        router_waiting_for(http_get(plan.router_url + "/workers", timeout=5.0, limit=1 << 20)[1], servers)
        == []
    )


# /workers as the real sglang-router 0.3.2 answered it (bodies trimmed to the keys the gate reads, plus one)
WORKERS = {
    "workers": [
        {"url": "http://127.0.0.1:30001", "worker_type": "decode", "is_healthy": True, "load": 0},
        {
            "url": "http://127.0.0.1:30000",
            "worker_type": "prefill",
            "is_healthy": True,
            "bootstrap_port": 8998,
        },
    ],
    "total": 2,
    "stats": {"prefill_count": 1, "decode_count": 1, "regular_count": 0},
}
SERVERS = {"prefill": "http://127.0.0.1:30000", "decode": "http://127.0.0.1:30001"}


def test_router_waiting_for_reads_the_routers_worker_list():
    assert router_waiting_for(json.dumps(WORKERS), SERVERS) == []
    empty = '{"workers":[],"total":0,"stats":{"prefill_count":0,"decode_count":0,"regular_count":0}}'
    assert router_waiting_for(empty, SERVERS) == [
        "prefill http://127.0.0.1:30000",
        "decode http://127.0.0.1:30001",
    ]
    sick = json.loads(json.dumps(WORKERS))
    sick["workers"][0]["is_healthy"] = False
    assert router_waiting_for(json.dumps(sick), SERVERS) == ["decode http://127.0.0.1:30001"]
    swapped = json.loads(json.dumps(WORKERS))
    swapped["workers"][1]["worker_type"] = "decode"  # the prefill URL registered as a decode
    assert router_waiting_for(json.dumps(swapped), SERVERS) == ["prefill http://127.0.0.1:30000"]
    other = {"prefill": "http://127.0.0.1:31000", "decode": "http://127.0.0.1:30001"}
    assert router_waiting_for(json.dumps(WORKERS), other) == ["prefill http://127.0.0.1:31000"]
    assert router_waiting_for("No available servers", SERVERS) == [f"{r} {u}" for r, u in SERVERS.items()]


def test_server_start_groups():
    assert server_start_groups(True) == (("prefill",), ("decode",))
    assert server_start_groups(False) == (("prefill", "decode"),)


class ConnectionCutOnce(LocalTransport):
    """A local host whose connection drops once, in the middle of the first stop command: a fake, honestly
    named, of what the fault campaign's `ssh_cut` does to a real sshd (bench/fault_campaign.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut = False

    def run_shell(self, command: str, timeout: float | None = 60.0):
        if "kill -TERM" in command and not self.cut:
            self.cut = True
            raise TransportError(f"on {self.host}: connection lost while running `{command}`")
        return super().run_shell(command, timeout)


def test_a_stop_cut_short_by_a_lost_connection_is_tried_again(compose_cfg, deployments):
    """A teardown whose stop command lost its connection used to log "could not stop" and leave the
    server running; a stop is idempotent, so it is tried again (the SSH transport reconnects)."""
    cfg = _cfg(compose_cfg)
    plan = _plan(cfg)
    deployment = _deployment(cfg, plan)
    deployments.append(deployment)
    deployment.co_restart()
    started = dict(deployment.started)
    flaky = ConnectionCutOnce()
    deployment.transports = {**deployment.transports, "decode": flaky}
    assert deployment.stop_all() == []
    assert flaky.cut
    t = LocalTransport()
    assert not any(t.group_alive(pid) for pid in started.values())
    assert not any(listening(int(cfg.cluster.hosts[r].port)) for r in ROLES)


# a router that is healthy but never answers a chat request (as one whose decode waits on a dead prefill)
HANGING_ROUTER = """
import http.server, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/" else 404)
        self.end_headers()
    def do_POST(self):
        time.sleep(120)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_a_server_that_dies_during_the_warm_up_fails_it_at_once_naming_the_server(compose_cfg, deployments):
    """The warm-up request waits up to 60 s; a server that dies meanwhile fails the arm within a look or
    two, naming it (fault campaign seed 34: a prefill killed as it became healthy held the warm-up for its
    whole timeout, its decode waiting on the dead bootstrap server)."""
    import signal

    cfg = _cfg(compose_cfg)
    plan = _plan(cfg)
    port = int(cfg.cluster.hosts.router.port)
    router = replace(plan.roles["router"], argv=[sys.executable, "-c", HANGING_ROUTER, str(port)])
    plan = replace(plan, roles={**plan.roles, "router": router}, router_url=f"http://127.0.0.1:{port}")
    d = _deployment(cfg, plan)
    deployments.append(d)
    d.start_servers()
    d.start_role("router")
    killer = threading.Timer(0.5, os.killpg, (d.started["prefill"], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(DeployError) as err:
        d.warm_up(look_s=0.5)
    killer.join()
    assert time.monotonic() - t0 < 5, time.monotonic() - t0
    assert err.value.role == "prefill" and "died during the warm-up request" in str(err.value)


def test_a_server_that_dies_while_the_router_is_health_gated_fails_the_gate_at_once_naming_it(
    compose_cfg, deployments
):
    """The real router waits for its prefill to register; a prefill killed before it could fails the
    gate within a look, naming the prefill, not at the router's start-up timeout naming the router (fault
    campaign seed 34: a prefill killed as the router started held its arm the router's whole 20 s)."""
    import signal

    cfg = compose_cfg("deployment.roles.router.startup_timeout_s=30")
    d = _deployment(cfg, plan_of(cfg))  # the sim's servers and the real sglang-router
    deployments.append(d)
    d.start_servers()
    os.killpg(d.started["prefill"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DeployError) as err:
        d.start_role("router")
    assert time.monotonic() - t0 < 5, time.monotonic() - t0
    assert err.value.role == "prefill" and "died while the router was health-gated" in str(err.value)
