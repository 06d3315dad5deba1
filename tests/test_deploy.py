"""The co-restart lifecycle with real processes on loopback (a plain HTTP server stands in for each role)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from orchestrator.deploy import DeployError, Deployment
from orchestrator.plan import ArmPlan
from orchestrator.remote.local import LocalTransport
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
