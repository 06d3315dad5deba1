"""A pool of two sim PD clusters under a real Ray cluster on loopback (`ray start --head`, started here).

Each test runs `python -m orchestrator` with `hydra/launcher=heisenhunt_ray` joined to that Ray cluster,
and checks what the pool promises from the MLflow store and the hosts' work dirs: one arm per cluster at
a time (lease tags), a killed Ray worker is one FAILED arm whose cluster is torn down and reused, and
Ctrl-C leaves nothing running.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import mlflow
import pytest

from orchestrator.config.schema import LeaseConf
from orchestrator.remote.local import LocalTransport
from orchestrator.run.lease import Holder, HostLease, hosts_held
from tests.conftest import POOL_MEMBERS as MEMBERS
from tests.conftest import free_port, pool_overrides, seed_mlflow_store, sweep_logs
from tests.pool.ray_head import RAY_ENV, local_ray_head
from tests.test_study import finish, kill_if_running, no_servers_left

pytest.importorskip("ray")
pytest.importorskip("hydra_plugins.hydra_ray_launcher")

# one worker runs them all (--dist loadgroup): one Ray head for the module, not one per worker
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]

ROLES = ("prefill", "decode", "router")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """One Ray cluster for the module's tests (per pytest worker), as several studies share one: each
    sweep is its own Ray job, and each pool's lessor actor is named after its members' ports."""
    with local_ray_head(free_port) as address:
        yield address


def pooled_sweep(tmp_path: Path, address: str, *extra: str, repetitions: str = "0,1") -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "orchestrator", "hydra/launcher=heisenhunt_ray",
        f"hydra.launcher.ray.init.address={address}", *pool_overrides(tmp_path),
        # a lost holder is found by the launcher at once; expiry is the fallback, kept well above the
        # renewal period even on a loaded 2-core CI machine
        "cluster_pool.lease_ttl_s=20",
        f"tracking.uri={seed_mlflow_store(tmp_path / 'mlflow.db')}", f"report.dir={tmp_path}/reports",
        f"hydra.sweep.dir={tmp_path}/multirun", "factor/multi_stream=on,off", f"repetition={repetitions}",
        "workload.rounds=2", "bench.enabled=false", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **RAY_ENV}
    # SIGINT as a terminal leaves it: a suite started in the background (`pytest &`) hands its children
    # SIGINT ignored, and the driver then never sees the test's Ctrl-C (the stress CLI test does the same)
    return subprocess.Popen(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def arm_runs(tmp_path: Path) -> list:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name("quick")
    if experiment is None:
        return []
    return [
        r
        for r in client.search_runs([experiment.experiment_id])
        if r.data.tags.get("heisenhunt.kind") == "arm"
    ]


def lease_interval(run) -> tuple[float, float]:
    tags = run.data.tags
    return datetime.fromisoformat(tags["lease.start"]).timestamp(), datetime.fromisoformat(
        tags["lease.end"]
    ).timestamp()


def assert_no_overlap(runs) -> None:
    """No two arms held one member at once: their lease intervals on each member are disjoint."""
    by_member: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        by_member.setdefault(run.data.tags["cluster_pool.member"], []).append(lease_interval(run))
    for member, spans in by_member.items():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, f"two arms overlapped on {member}: {spans}"


def holder_pid(run) -> int:
    found = re.search(r"\(pid (\d+) on ", run.data.tags.get("lease.holder", ""))
    assert found, run.data.tags
    return int(found.group(1))


def test_a_killed_ray_worker_is_one_failed_arm_and_its_cluster_is_torn_down_and_reused(tmp_path, ray_head):
    # 4 sessions at a time: an arm's stress outlasts the wait for the kill by seconds
    proc = pooled_sweep(tmp_path, ray_head, "workload.sessions=24", "workload.concurrency=4")
    try:
        deadline, victim = time.monotonic() + 180, None
        while victim is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no arm got its servers up"
            time.sleep(0.2)
            # the store is read once a member has its servers up (a read is ~0.05 s of CPU, and the
            # sweep's start takes seconds)
            if not list(tmp_path.glob("*-decode/decode.pid")):
                continue
            for run in arm_runs(tmp_path):
                member = run.data.tags.get("cluster_pool.member")
                if (
                    run.info.status == "RUNNING"
                    and member
                    and (tmp_path / f"{member}-decode" / "decode.pid").is_file()
                ):
                    victim = run
                    break
        member = victim.data.tags["cluster_pool.member"]
        killed_at = time.time()
        os.kill(holder_pid(victim), signal.SIGKILL)
        out = finish(proc, 400)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-5000:]  # the sweep finished
    runs = {r.info.run_id: r for r in arm_runs(tmp_path)}
    lost = runs[victim.info.run_id]
    assert lost.info.status == "FAILED", out[-3000:]
    reason = lost.data.tags["failure_reason"]
    assert "lost" in reason and "Ray worker" in reason and member in reason, reason
    others = [r for r in runs.values() if r.info.run_id != victim.info.run_id]
    reasons = [r.data.tags.get("failure_reason") for r in others]
    assert len(others) == 3 and {r.info.status for r in others} == {"FINISHED"}, (reasons, out[-3000:])
    # a later arm took the lost member, tore it down first (its co-restart), and ran there
    later = [
        r for r in others
        if r.data.tags["cluster_pool.member"] == member and lease_interval(r)[0] >= killed_at
    ]  # fmt: skip
    assert later and any("lease.recovered_from" in r.data.tags for r in later), out[-3000:]
    assert_no_overlap(others)
    assert not no_servers_left(tmp_path)
    assert not list(tmp_path.glob("*/*.pid"))


def test_ctrl_c_under_ray_stops_every_running_arm_and_leaves_nothing_running(tmp_path, ray_head):
    proc = pooled_sweep(tmp_path, ray_head, "workload.sessions=200", "workload.concurrency=2")
    try:
        deadline = time.monotonic() + 180
        while (
            len(
                [
                    p
                    for p in (tmp_path / "multirun").glob("*/stress/sessions.jsonl")
                    if p.read_text().count("\n") >= 2
                ]
            )
            < 2
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "two arms never ran at once"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out = finish(proc, 200)
    finally:
        kill_if_running(proc)
    assert proc.returncode != 0, out[-3000:]
    runs = arm_runs(tmp_path)
    # the two running arms were stopped and recorded KILLED; the two queued never started
    assert sorted(r.info.status for r in runs) == ["KILLED", "KILLED"], out[-3000:]
    # and of those two, one was sent to Ray (the spare slot, waiting on the pool) and one never composed:
    # a job is sent when a slot is free for it, and none had ended
    sent = re.findall(r"\t#(\d+) : ", (tmp_path / "multirun" / "multirun.log").read_text())
    assert sorted(sent) == ["0", "1", "2"], sent
    assert not no_servers_left(tmp_path), out[-3000:]
    assert not list(tmp_path.glob("*/*.pid")) and not list(tmp_path.glob("*/lease"))


def test_each_round_of_a_sequential_study_is_one_ray_batch_spread_over_the_pool(tmp_path, ray_head):
    """Two rounds of two arms (min and max runs per arm 2: enough to show one batch per round): four arms
    on two clusters, which never share one and leave nothing running. (The pool's basic promise, checked
    on this sweep rather than on a fixed sweep of its own: one Ray study less in the suite.)"""
    proc = pooled_sweep(
        tmp_path, ray_head, "hydra.sweeper.design=sequential", "workload.sessions=12",
        "study.stopping.max_runs_per_arm=2",
    )  # fmt: skip
    out = finish(proc, 500)
    assert proc.returncode == 0, out[-5000:]
    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    rounds = report["stopping"]["rounds"]
    # one launcher batch per round, as the sweeper asked for it
    assert sweep_logs(tmp_path / "multirun").count("Ray launcher: ") == rounds >= 1, out[-3000:]
    runs = arm_runs(tmp_path)
    reasons = [r.data.tags.get("failure_reason") for r in runs]
    assert len(runs) == 4 and {r.info.status for r in runs} == {"FINISHED"}, (reasons, out[-3000:])
    assert {r.data.tags["lease.by"] for r in runs} == {"ray"}
    # the terminal followed the arms run in Ray's workers (their progress files): a line per arm ended
    finished = [line for line in out.splitlines() if line.startswith("arm ") and ": FINISHED, 12/12" in line]
    assert len(finished) == 4, out[-3000:]
    # Ray spread them: both members ran arms, as the clusters they are
    assert {r.data.tags["cluster_pool.member"] for r in runs} == set(MEMBERS)
    assert {r.data.tags["cluster"] for r in runs} == {"local", "local2-pd1"}
    by_round: dict[str, list] = {}
    for run in runs:
        by_round.setdefault(run.data.tags["repetition"], []).append(run)
    assert len(by_round) == rounds
    # a round's arms ran side by side, one per member
    both = [rs for rs in by_round.values() if len(rs) == 2]
    assert both, {k: len(v) for k, v in by_round.items()}
    for pair in both:
        assert {r.data.tags["cluster_pool.member"] for r in pair} == set(MEMBERS)
        (s1, e1), (s2, e2) = (lease_interval(r) for r in pair)
        assert s1 < e2 and s2 < e1, (s1, e1, s2, e2)
    assert_no_overlap(runs)
    assert not no_servers_left(tmp_path)
    assert not list(tmp_path.glob("*/*.pid")) and not list(tmp_path.glob("*/lease"))


def test_under_ray_a_member_held_by_a_study_started_by_hand_is_passed_over(tmp_path, ray_head):
    """pd0's hosts are held (as by a study started by hand there): the lessor's grant of pd0 is set aside
    and every arm runs on pd1; pd0's lease is left as it was."""
    by_hand = Holder.this_process("a study started by hand")
    leases = [HostLease(LocalTransport(), str(tmp_path / f"pd0-{role}")) for role in ROLES]
    with hosts_held(leases, by_hand, LeaseConf(wait_s=5, poll_s=0.2, heartbeat_s=1)):
        proc = pooled_sweep(tmp_path, ray_head, "workload.sessions=12", repetitions="0")
        out = finish(proc, 400)
        assert all((tmp_path / f"pd0-{role}" / "lease").is_dir() for role in ROLES)
    assert proc.returncode == 0, out[-5000:]
    runs = arm_runs(tmp_path)
    reasons = [r.data.tags.get("failure_reason") for r in runs]
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}, (reasons, out[-3000:])
    assert {r.data.tags["cluster_pool.member"] for r in runs} == {"pd1"}
    assert "held outside the pool" in out
    assert_no_overlap(runs)
    assert not no_servers_left(tmp_path)


WAITERS = """
import asyncio, json, sys, time
import ray
from orchestrator.run.pool import awaited

ray.init(address=sys.argv[1])

@ray.remote(num_cpus=0)
class Lessor:
    async def grant(self, after_s):
        await asyncio.sleep(after_s)
        return after_s

@ray.remote(max_retries=0)
def job(lessor):
    started = time.time()
    awaited(lessor.grant.remote(3.0))
    return started, time.time()

lessor = Lessor.remote()
print(json.dumps(ray.get([job.remote(lessor) for _ in range(3)])))
"""


def test_a_job_waiting_on_the_pools_actor_keeps_its_cpu(ray_head):
    """Three jobs on the head's two CPUs, each waiting on an actor: the third starts only when one of the
    first two ends. With `ray.get`, Ray lends a waiting task's CPU to the next job queued and starts a cold
    worker for it (10-12 workers for the 20 jobs of a pool of two, each importing MLflow and the arm beside
    the arms running)."""
    env = {**os.environ, **RAY_ENV}
    done = subprocess.run(
        [sys.executable, "-c", WAITERS, ray_head], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    spans = sorted(json.loads(done.stdout.strip().splitlines()[-1]))
    third_started = spans[2][0]
    assert third_started >= min(end for _, end in spans[:2]) - 0.05, spans
