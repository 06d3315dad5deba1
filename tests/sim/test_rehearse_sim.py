"""The rehearsal's model of an arm's session rate, checked against the real simulated deployment.

`python -m orchestrator.rehearse` models a session's rate as 1 - (1 - p)^rounds, p the rule's per-turn
probability at the workload's concurrency. Slow: the baseline arm of the dsv4 study, co-restarted for
every run (each start draws its own rate, restart_icc), 60 concurrent sessions x 4 rounds per run.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from simkit import BASELINE, count, run_sessions, sim_counters

from orchestrator.rehearse import from_config

SESSIONS, ROUNDS, STARTS = 60, 4, 6


@pytest.mark.slow
def test_modelled_baseline_rate_matches_the_sim_within_sampling_error(cluster):
    result = from_config(["+experiment=dsv4_corruption", "rehearse.studies=1"])
    arm = next(a for a in result["design"]["arms"] if a["label"] == "baseline")
    assert result["workload"] == {"sessions": SESSIONS, "rounds": ROUNDS, "load": SESSIONS}
    c = cluster(time_scale=0.05)
    corrupted, loads = 0, []
    for start in range(STARTS):
        c.start_all(BASELINE)
        outcomes = asyncio.run(run_sessions(c.router_url, SESSIONS, ROUNDS, seed=500 + start))
        counters = sim_counters(c.procs["decode"].url)
        c.stop_all()
        assert count(outcomes, "errored") == 0
        corrupted += count(outcomes, "corrupted")
        loads.append(counters["planned_load_sum"] / counters["planned_turns"])
    n = SESSIONS * STARTS
    q, icc = arm["rate"], arm["restart_icc"]
    # beta-binomial sampling error of n sessions in runs of SESSIONS, 3.5 standard errors
    se = math.sqrt(q * (1 - q) / n * (1 + (SESSIONS - 1) * icc))
    assert abs(corrupted / n - q) <= 3.5 * se, (corrupted, n, q, loads)
    # the load a turn joins is about the concurrency the model assumes
    assert 0.7 * SESSIONS <= sum(loads) / len(loads) <= SESSIONS, loads
