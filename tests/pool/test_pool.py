"""The cluster pool without Ray: its lease state (pure), its config checks, and the host-lease pick that the
basic launcher uses, on real processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from orchestrator.config.load import ConfigError, load_job
from orchestrator.config.plan import jobs_on_pool, plan_arm
from orchestrator.config.schema import LeaseConf
from orchestrator.remote.local import LocalTransport
from orchestrator.run import pool
from orchestrator.run.lease import Holder, HostLease, hosts_held
from orchestrator.run.preflight import check_sweep_on_hosts
from tests import warm
from tests.conftest import POOL_MEMBERS as MEMBERS
from tests.conftest import pool_overrides, seed_mlflow_store
from tests.test_study import finish, no_servers_left

ROLES = ("prefill", "decode", "router")


def holder(label: str, task: str | None = None) -> pool.PoolHolder:
    return pool.PoolHolder(label=label, study="s", tracking_uri="sqlite:///x.db", task_id=task)


# --- the lease state ------------------------------------------------------------------------------------


def test_members_are_granted_one_holder_at_a_time_in_pool_order():
    state = pool.PoolState(members=MEMBERS)
    a = pool.take(state, holder("a"), now=0.0, token="ta")
    b = pool.take(state, holder("b"), now=0.0, token="tb")
    assert (a.member, b.member) == ("pd0", "pd1")
    assert pool.take(state, holder("c"), now=0.0, token="tc") is None  # all held: the taker waits
    assert not pool.give_back(state, "pd0", "tb")  # only the holder gives a member back
    assert pool.give_back(state, "pd0", "ta")
    assert pool.take(state, holder("c"), now=1.0, token="tc").member == "pd0"


def test_a_holder_that_stops_renewing_is_lost_and_the_next_taker_is_told():
    state = pool.PoolState(members=MEMBERS)
    a = pool.take(state, holder("a"), now=0.0, token="ta")
    pool.take(state, holder("b"), now=0.0, token="tb")
    assert pool.renew(state, "pd1", "tb", now=25.0, run_id="run-b")
    assert not pool.renew(state, "pd0", "wrong", now=25.0)
    lost = pool.expire(state, now=31.0, ttl_s=30.0)
    assert [x.lease.member for x in lost] == [a.member]  # b renewed at 25: still held
    assert "stopped renewing its lease on pd0" in lost[0].reason
    assert not pool.renew(state, "pd0", "ta", now=31.0)  # a late beat does not win it back
    grant = pool.take(state, holder("c"), now=31.0, token="tc")
    assert grant.member == "pd0" and grant.lost is not None and grant.lost.lease.holder.label == "a"
    assert state.lost == {}  # told once: the taker recovers it


def test_a_lost_member_is_taken_before_a_clean_one_and_the_launcher_can_lose_a_task_at_once():
    state = pool.PoolState(members=MEMBERS)
    pool.take(state, holder("a", task="t1"), now=0.0, token="ta")
    pool.take(state, holder("b", task="t2"), now=0.0, token="tb")
    lost = pool.lose_task(state, "t1", "its Ray worker was lost", now=1.0)
    assert lost is not None and lost.lease.member == "pd0" and "pd0" not in state.leases
    assert pool.lose_task(state, "t1", "again", now=2.0) is None
    pool.give_back(state, "pd1", "tb")
    # lost first: its leftovers are torn down at once, and the pool is whole again
    grant = pool.take(state, holder("c"), now=3.0, token="tc")
    assert grant.member == "pd0" and grant.lost.reason == "its Ray worker was lost"
    assert pool.take(state, holder("d"), now=3.0, token="td").member == "pd1"


def test_renewal_records_the_holders_run_for_recovery():
    state = pool.PoolState(members=MEMBERS)
    pool.take(state, holder("a", task="t1"), now=0.0, token="ta")
    pool.renew(state, "pd0", "ta", now=1.0, run_id="abc")
    assert pool.lose_task(state, "t1", "gone", now=2.0).lease.holder.run_id == "abc"


class StateLessor:
    """A lessor over the pure lease state, as the Ray actor holds it, without Ray (the Lessor interface)."""

    renew_every_s = 3600.0  # no renewal beat within a test: only what the holder says at once counts

    def __init__(self) -> None:
        self.state = pool.PoolState(members=MEMBERS)

    def acquire(self, who: pool.PoolHolder) -> pool.Grant:
        return pool.take(self.state, who, now=0.0, token="t-" + who.label)

    def renew(self, grant: pool.Grant, run_id: str | None = None) -> bool:
        return pool.renew(self.state, grant.member, grant.lease.token, now=1.0, run_id=run_id)

    def release(self, grant: pool.Grant) -> None:
        pool.give_back(self.state, grant.member, grant.lease.token)


def test_the_arms_run_is_told_to_the_lessor_at_once_so_a_worker_lost_before_its_first_renewal_is_recovered():
    """The arm's run id reached the lessor at the next renewal (a quarter of the lease's ttl): a worker
    killed sooner left a lost lease naming no run, and its MLflow run RUNNING for good (seen under load
    in the Ray killed-worker test)."""
    lessor = StateLessor()
    with pool.held(lessor, holder("a", task="t1"), lambda hold, end: None) as hold:
        hold.record_run("run-a")
        # the worker dies here, before any renewal beat: the launcher loses its task
        lost = pool.lose_task(lessor.state, "t1", "its Ray worker was lost", now=2.0)
    assert lost is not None and lost.lease.holder.run_id == "run-a"


# --- config ----------------------------------------------------------------------------------------------


def test_the_shipped_pool_plans_every_arm_on_each_member(compose_cfg, tmp_path):
    job = load_job(compose_cfg("cluster_pool=local2", isolated=False))
    on_members = jobs_on_pool(job)
    assert [j.cluster.name for j in on_members] == ["local", "local2-pd1"]
    plans = [plan_arm(j) for j in on_members]
    # one arm: one signature wherever it runs (runs on both members pool), different hosts
    assert len({p.signature for p in plans}) == 1
    assert len({p.roles["decode"].host.port for p in plans}) == 2


def test_pool_members_sharing_a_port_or_a_work_dir_are_refused_naming_both_keys(compose_cfg):
    cfg = compose_cfg(
        "cluster_pool=local2",
        "cluster_pool.clusters.pd1.hosts.decode.port=30001",
        "cluster_pool.clusters.pd1.hosts.router.work_dir=/tmp/same",
        "cluster_pool.clusters.pd0.hosts.router.work_dir=/tmp/same",
        isolated=False,
    )
    with pytest.raises(ConfigError) as e:
        load_job(cfg)
    text = str(e.value)
    assert (
        "cluster_pool.clusters.pd1.hosts.decode.port: port 30001 on 127.0.0.1 is also "
        "cluster_pool.clusters.pd0.hosts.decode.port" in text
    )
    assert "cluster_pool.clusters.pd1.hosts.router.work_dir: /tmp/same on 127.0.0.1 is also" in text
    assert "accepted:" in text


def test_a_member_with_a_bad_transport_is_refused_under_its_own_key(compose_cfg):
    cfg = compose_cfg("cluster_pool=local2", "cluster_pool.clusters.pd1.hosts.decode.transport=telnet")
    with pytest.raises(ConfigError, match=r"cluster_pool\.clusters\.pd1\.hosts\.decode\.transport: 'telnet'"):
        load_job(cfg)


# --- the sweep's host checks --------------------------------------------------------------------------


class AskedTransport(LocalTransport):
    """The local host, each command it is asked recorded under its member; a member's first command waits
    for the other member's first (so checks run one member after the other never get past it)."""

    def __init__(self, member: str, asked: dict[str, list[str]], both_asking: threading.Barrier):
        super().__init__()
        self.member, self.asked, self.both_asking = member, asked, both_asking

    def run_shell(self, command: str, timeout: float | None = 60.0):
        first = not self.asked.setdefault(self.member, [])
        self.asked[self.member].append(command)
        if first:
            self.both_asking.wait()
        return super().run_shell(command, timeout)


def test_a_pools_host_checks_ask_each_member_once_per_host_and_env_and_run_the_members_at_once(compose_cfg):
    """Three arms that differ only in flags, on a pool of two: each member's host is asked one engine probe
    for all three arms, and the deployment's preflight module once per role env (prefill's, decode's), not
    once per arm; and both members are asked at once (each member's first command waits for the other's)."""
    arms = ["factor/capture=graph", "factor/capture=eager", "factor/hicache=off"]
    planned = []
    for arm in arms:
        job = load_job(compose_cfg("cluster_pool=local2", "+experiment=dsv4_corruption", arm, isolated=False))
        planned += [(arm, plan_arm(on_member)) for on_member in jobs_on_pool(job)]
    members = {30001: "pd0", 30011: "pd1"}  # the shipped pool's decode ports
    asked: dict[str, list[str]] = {}
    both_asking = threading.Barrier(2, timeout=30)

    def connect(hosts: Mapping[str, Any]) -> dict[str, AskedTransport]:
        transport = AskedTransport(members[hosts["decode"].port], asked, both_asking)
        return {role: transport for role in hosts}  # (one host: make_transports shares its transport)

    assert check_sweep_on_hosts(planned, connect) == []
    assert sorted(asked) == ["pd0", "pd1"]
    for commands in asked.values():
        probes = [c for c in commands if "engine_probe" in c or "def build_parser" in c]
        modules = [c for c in commands if "-m orchestrator.sim.check" in c]
        assert len(probes) == 1, commands
        assert len(modules) == 2, modules  # 3 arms x 2 roles before


# --- the basic launcher: host leases pick the member --------------------------------------------------


@pytest.mark.slow
def test_outside_ray_an_arm_takes_the_member_a_study_by_hand_does_not_hold(tmp_path):
    """pd0's hosts are held (as a study started by hand on them holds them): the pooled arm runs on pd1,
    leaves pd0's lease alone, and gives pd1 back."""
    overrides = pool_overrides(tmp_path)
    work_dirs = [str(tmp_path / f"pd0-{role}") for role in ROLES]
    by_hand = Holder.this_process("a study started by hand")
    leases = [HostLease(LocalTransport(), d) for d in work_dirs]
    argv = [
        sys.executable, "-m", "orchestrator", *overrides, "factor/multi_stream=on", "repetition=0",
        "workload.sessions=12", "workload.rounds=2", "bench.enabled=false",
        f"tracking.uri={seed_mlflow_store(tmp_path / 'mlflow.db')}", f"report.dir={tmp_path}/reports",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]  # fmt: skip
    with hosts_held(leases, by_hand, LeaseConf(wait_s=5, poll_s=0.2, heartbeat_s=1)):
        proc = warm.popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = finish(proc, 300)
        assert all((tmp_path / f"pd0-{role}" / "lease").is_dir() for role in ROLES)  # untouched
    assert proc.returncode == 0, out[-4000:]
    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    assert [a["label"] for a in report["arms"]] == ["baseline"]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("quick")
    (run,) = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("heisenhunt.kind") == "arm"
    ]
    tags = run.data.tags
    assert (tags["cluster_pool.member"], tags["cluster"], tags["lease.by"]) == (
        "pd1",
        "local2-pd1",
        "host leases",
    )
    assert tags["lease.start"] < tags["lease.end"]
    assert not list(tmp_path.glob("pd1-*/lease"))  # given back
    assert not no_servers_left(tmp_path)


def test_a_member_held_outside_the_pool_is_set_aside_then_offered_again():
    state = pool.PoolState(members=MEMBERS)
    first = pool.take(state, holder("a"), now=0.0, token="ta")
    assert first.member == "pd0"
    assert pool.set_aside(state, first, until=10.0)
    assert pool.next_change(state, now=4.0, ttl_s=30.0) == pytest.approx(6.0)  # wake when it is back
    assert pool.take(state, holder("a"), now=4.0, token="tb").member == "pd1"
    assert pool.take(state, holder("c"), now=5.0, token="tc") is None  # pd0 still set aside
    assert pool.take(state, holder("c"), now=10.0, token="tc").member == "pd0"


def test_setting_aside_keeps_a_lost_lease_for_the_next_taker():
    state = pool.PoolState(members=("pd0",))
    pool.take(state, holder("a", task="t1"), now=0.0, token="ta")
    pool.lose_task(state, "t1", "worker lost", now=1.0)
    grant = pool.take(state, holder("b"), now=2.0, token="tb")
    assert grant.lost is not None and pool.set_aside(state, grant, until=3.0)
    assert pool.take(state, holder("c"), now=3.0, token="tc").lost.reason == "worker lost"
