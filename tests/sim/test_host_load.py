"""The modelled load follows the workload, not the host (issue 17): the baseline arm, co-restarted for
every run, on an idle host and beside CPU hogs, reaches the same decode load and the same corruption
rate within sampling error. Real processes: the sim's prefill and decode behind the real router, the
orchestrator's own stress runner and decode-load poller, busy-loop subprocesses started and killed here.

Before issue 17 the load a turn joined was the requests the decode held at that moment; a client slowed
by the hogs spends longer between turns, so fewer sessions were held at once and the rate dropped
(`HEISENHUNT_SIM_SESSION_IDLE_S=0` restores that model: this test then fails on the load).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from simkit import BASELINE, sim_counters, stress_settings

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import server_launch, wait_healthy
from orchestrator.workload.decode_load import DecodeLoadMonitor
from orchestrator.workload.stress import run_stress_sync
from tests.conftest import cpu_hogs, free_port

SESSIONS, ROUNDS, REPS = 60, 4, 5
ICC = 0.005  # the built-in model's restart_icc
# two busy loops per CPU: the client, router and servers get about a third of the machine
HOGS_PER_CPU = 2


def one_run(c, out: Path, seed: int, hogs_per_cpu: int = 0) -> dict[str, float]:
    """A fresh co-restarted start of the baseline arm, then one stress run beside `hogs_per_cpu` busy loops
    a CPU; its counts and loads. The hogs start once the deployment is up: they are there to slow the
    client between turns, which the load must not follow (a co-restart under them only took longer)."""
    c.stop_all()
    c.start_all(BASELINE)
    decode = c.procs["decode"].url
    before = sim_counters(decode)
    with cpu_hogs(hogs_per_cpu):
        monitor = DecodeLoadMonitor(decode + "/metrics", planned=SESSIONS).start()
        summary = run_stress_sync(stress_settings(c, out, SESSIONS, ROUNDS, seed))
        reported = monitor.stop()
    after = sim_counters(decode)
    assert summary.errored == 0 and summary.sessions == SESSIONS
    assert summary.corrupted == after["corrupted_turns"] - before["corrupted_turns"]
    assert reported.measured, reported.unknown
    turns = after["planned_turns"] - before["planned_turns"]
    return {
        "corrupted": summary.corrupted,
        "joined": (after["planned_load_sum"] - before["planned_load_sum"]) / turns,  # load turns joined
        "reported": reported.mean,  # what /metrics said, as the orchestrator records it
        "duration_s": summary.duration_s,
    }


def mean_and_se(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


# `alone`: the hogs take the whole machine, which a test beside them would feel (a calibration band
# measured beside them landed outside its range); and the hogs plus the tests of two other workers
# starved the client far more than this test's own hogs do (the hogged load fell 5.5 below the idle one)
@pytest.mark.slow
@pytest.mark.alone
def test_a_busy_host_changes_neither_the_load_reached_nor_the_rate(cluster, tmp_path: Path):
    c = cluster(time_scale=0.05)
    runs: dict[str, list[dict[str, float]]] = {"idle": [], "hogged": []}
    for rep in range(REPS):  # interleaved, so whatever else the host does weighs on both alike
        runs["idle"].append(one_run(c, tmp_path / f"idle{rep}", seed=4000 + rep))
        runs["hogged"].append(one_run(c, tmp_path / f"hog{rep}", seed=5000 + rep, hogs_per_cpu=HOGS_PER_CPU))
    summary = {k: {f: [r[f] for r in v] for f in v[0]} for k, v in runs.items()}
    idle, hogged = runs["idle"], runs["hogged"]
    # (the durations are only shown, in the messages: a run of 60 sessions takes 1-1.5 s, and how much
    # the hogs add to that varies from run to run more than it differs between idle and hogged)

    # the load the planned turns joined, and the load /metrics reported: equal within sampling error (or
    # within 5%); the load model before issue 17 lost 15-20% of it to the hogs (e.g. 54 -> 46 of 60)
    for field in ("joined", "reported"):
        (mi, si), (mh, sh) = mean_and_se([r[field] for r in idle]), mean_and_se([r[field] for r in hogged])
        assert abs(mh - mi) <= max(3 * math.hypot(si, sh), 0.05 * mi), (field, summary)
        assert min(mi, mh) >= 0.8 * SESSIONS, (field, summary)  # neither fell short of the plan

    # the corruption rate: equal within sampling error (beta-binomial: sessions of one start correlate).
    # At the baseline's ~16.6%, 300 sessions a side, 3 SE is 10.4 points: a host that moved the rate by 13
    # points fails this 4 times in 5, issue 17's 20% -> 8.9% 3 times in 5; the load above is the finer check
    n = REPS * SESSIONS
    ki, kh = sum(r["corrupted"] for r in idle), sum(r["corrupted"] for r in hogged)
    p = (ki + kh) / (2 * n)
    se = math.sqrt(2 * p * (1 - p) / n * (1 + (SESSIONS - 1) * ICC))
    assert abs(kh - ki) / n <= 3 * se, (ki, kh, n, summary)


def test_a_decode_without_enable_metrics_leaves_the_load_unknown(tmp_path: Path):
    """SGLang serves /metrics only with --enable-metrics, and so does the sim: the load is unknown, and
    says why, without failing anything."""
    transport = LocalTransport()
    launch = server_launch(free_port(), mode="null", time_scale=0.05)
    pid = transport.start_detached(launch.argv, launch.env, str(tmp_path / "s.log"), str(tmp_path / "s.pid"))
    try:
        wait_healthy(launch.url, alive=lambda: transport.is_alive(pid), log_tail=lambda: "")
        load = DecodeLoadMonitor(launch.url + "/metrics", planned=4, interval_s=0.05).start()
        load = load.stop()
    finally:
        transport.stop_group(pid, grace_s=5.0)
    assert not load.measured and "HTTP 404" in load.unknown and "--enable-metrics" in load.unknown
