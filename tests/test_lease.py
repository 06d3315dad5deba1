"""Cluster leases on real hosts (the local transport, real files and processes): one holder at a time,
waits that name the holder, stale leases of dead holders taken over, and two whole studies on one cluster."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from orchestrator.config.schema import LeaseConf
from orchestrator.remote.local import LocalTransport
from orchestrator.run.lease import (
    LEASE_DIR,
    Holder,
    HostLease,
    LeaseHeld,
    acquire,
    cluster_leases,
    hosts_held,
    is_stale,
    release,
)
from tests import warm
from tests.conftest import free_port, seed_mlflow_store
from tests.test_study import finish, no_servers_left

QUICK = LeaseConf(wait_s=0.5, poll_s=0.05, heartbeat_s=0.1, stale_after_s=60)


def _holder(label: str, **changes) -> Holder:
    return replace(Holder.this_process(label), **changes)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_staleness_trusts_a_local_holders_process_and_a_remote_holders_heartbeat():
    here = socket.gethostname()
    me = Holder.this_process("me")
    started = {me.pid: me.pid_started}.get
    assert not is_stale(me, 10_000, 60, here, lambda pid: started(pid, ""))  # alive here: old beat or not
    assert is_stale(replace(me, pid_started="Mon Jan  1 00:00:00 2024"), 0, 60, here, lambda pid: "now")
    assert is_stale(me, 0, 60, here, lambda pid: "")  # its process is gone
    remote = replace(me, hostname="gpu-head-7")
    assert not is_stale(remote, 30, 60, here, lambda pid: "")
    assert is_stale(remote, 61, 60, here, lambda pid: "")


def test_one_holder_at_a_time_and_only_the_holder_releases(tmp_path):
    lease = HostLease(LocalTransport(), str(tmp_path / "decode"))
    first, second = _holder("study A"), _holder("study B")
    assert lease.try_take(first)[0]
    taken, current, age = lease.try_take(second)
    assert not taken and current == first and 0 <= age < 5
    lease.release(second)  # not its lease: nothing happens
    assert lease.try_take(second)[1] == first
    lease.release(first)
    assert lease.try_take(second)[0]
    assert json.loads((tmp_path / "decode" / "lease" / "holder.json").read_text())["label"] == "study B"


def test_a_live_holder_makes_the_next_taker_wait_then_refuse_naming_it(tmp_path):
    leases = cluster_leases(
        {r: LocalTransport() for r in ("prefill", "decode")},
        {"prefill": str(tmp_path / "p"), "decode": str(tmp_path / "d")},
    )
    first = _holder("study quick, arm baseline #0 (MLflow run abc)")
    acquire(leases, first, QUICK)
    said: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"leased by study quick, arm baseline #0 \(MLflow run abc\)") as err:
        acquire(leases, _holder("study two"), QUICK, on_wait=said.append)
    assert time.monotonic() - t0 >= QUICK.wait_s
    assert err.value.holder == first and said and "is held by study quick" in said[0]
    # the refused taker left the holder's leases as they were
    assert all(lease.try_take(_holder("probe"))[1] == first for lease in leases)
    release(leases, first)
    acquire(leases, _holder("study two"), QUICK)


def test_a_dead_holders_lease_is_taken_over(tmp_path):
    lease = HostLease(LocalTransport(), str(tmp_path / "router"))
    gone = _holder("a crashed study", pid=_dead_pid())
    assert lease.try_take(gone)[0]
    nxt = _holder("the next study")
    acquire([lease], nxt, QUICK)
    assert (
        json.loads((tmp_path / "router" / "lease" / "holder.json").read_text())["label"] == "the next study"
    )
    # a remote holder is judged by its heartbeat: silent for longer than stale_after_s means dead
    lease.release(nxt)
    remote = _holder("a study on another machine", hostname="elsewhere", id="ff" * 16)
    assert lease.try_take(remote)[0]
    with pytest.raises(LeaseHeld):
        acquire([lease], _holder("too early"), QUICK)
    old = time.time() - 120
    os.utime(tmp_path / "router" / "lease" / "heartbeat", (old, old))
    acquire([lease], _holder("after the silence"), QUICK)


def test_the_holder_keeps_its_lease_alive_and_gives_it_back(tmp_path):
    lease = HostLease(LocalTransport(), str(tmp_path / "decode"))
    holder = _holder("holder")
    beat = tmp_path / "decode" / "lease" / "heartbeat"
    with hosts_held([lease], holder, QUICK):
        old = time.time() - 120
        os.utime(beat, (old, old))
        deadline = time.monotonic() + 5
        while beat.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert beat.stat().st_mtime > time.time() - 60  # renewed by the heartbeat thread
    assert not (tmp_path / "decode" / "lease").exists()


@pytest.mark.slow
def test_two_studies_started_at_once_on_one_cluster_both_finish_and_leave_nothing_running(tmp_path):
    """The same embedded default (same ports, same work dirs) for two `python -m orchestrator` at once:
    arms take turns on the cluster, neither stops the other's servers, both reports are right."""
    cluster = []
    for role in ("prefill", "decode", "router"):
        cluster += [
            f"cluster.hosts.{role}.port={free_port()}",
            f"cluster.hosts.{role}.work_dir={tmp_path}/{role}",
        ]
    cluster += [
        f"cluster.hosts.prefill.bootstrap_port={free_port()}",
        f"cluster.hosts.router.metrics_port={free_port()}",
    ]
    small = [
        "repetition=0", "workload.sessions=20", "workload.rounds=2",
        "bench.concurrency=[1,4]", "bench.requests_per_worker=2", "bench.output_len=16",
    ]  # fmt: skip
    procs = {}
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        argv = [
            sys.executable, "-m", "orchestrator", *cluster, *small,
            f"tracking.uri={seed_mlflow_store(tmp_path / name / 'mlflow.db')}",
            f"report.dir={tmp_path}/{name}/reports",
            f"hydra.sweep.dir={tmp_path}/{name}/multirun",
        ]  # fmt: skip
        procs[name] = warm.popen(
            argv, cwd=tmp_path / name, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    outs = {name: finish(proc, 600) for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, outs[name][-4000:]
        report = json.loads((tmp_path / name / "reports" / "quick" / "report.json").read_text())
        # each study's own arms, every session with an outcome, no run failed or cut short by the other
        assert {a["label"] for a in report["arms"]} == {"baseline", "multi_stream=off"}
        assert not report["problem_runs"], report["problem_runs"]
        assert all(len(a["runs"]) == 1 and a["n"] == 20 and a["errored"] == 0 for a in report["arms"])
        assert all(t["levels"] for t in report["throughput"])
    # they did meet: one waited for the other, named
    assert any("is held by study quick" in out for out in outs.values()), outs["second"][-3000:]
    assert not no_servers_left(tmp_path)
    assert not any(tmp_path.glob("*/lease"))


@pytest.fixture
def full_disk(tmp_path):
    """A work dir on a tiny tmpfs of its own, filled up (needs permission to mount)."""
    mount = tmp_path / "tight"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mount / "work").mkdir()
        with contextlib.suppress(OSError):  # full, as wanted
            (mount / "filler").write_bytes(b"\0" * (1 << 20))
        yield mount / "work"
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def test_a_lease_that_cannot_be_written_is_not_left_behind(full_disk):
    """Found by the fault campaign (`python bench/fault_campaign.py --replay 1550730039`: the hosts' disk
    full at an arm's start): the lease dir was made, its holder record could not be written, and the
    half-made lease then blocked every later taker, the campaign's resume included. Now the take fails
    (OSError, which the arm records as its failure) and leaves nothing."""
    lease = HostLease(LocalTransport(), str(full_disk))
    with pytest.raises(OSError, match="lease on"):
        lease.try_take(Holder.this_process("a study"))
    assert not (full_disk / LEASE_DIR).exists()


def test_a_lease_released_while_it_is_looked_at_is_no_error(tmp_path):
    """Found by the fault campaign (seed 153127525: a second study on the same cluster): a take that found
    the lease held, then found it gone by the time it read the heartbeat or the holder's record, raised
    OSError and failed the arm. Another holder here takes and releases its lease over and over while this
    one tries: every try answers (taken, or held), none raises."""
    lease = HostLease(LocalTransport(), str(tmp_path))
    stop = threading.Event()

    def other_holder() -> None:
        while not stop.is_set():
            try:
                (tmp_path / LEASE_DIR).mkdir()
            except FileExistsError:
                continue
            (tmp_path / LEASE_DIR / "holder.json").write_text(json.dumps({"id": "other"}))
            (tmp_path / LEASE_DIR / "heartbeat").touch()
            time.sleep(0.001)
            shutil.rmtree(tmp_path / LEASE_DIR, ignore_errors=True)

    me = Holder.this_process("this study")
    thread = threading.Thread(target=other_holder)
    thread.start()
    try:
        for _ in range(300):
            taken, _, _ = lease.try_take(me)
            if taken:
                lease.release(me)
    finally:
        stop.set()
        thread.join()
