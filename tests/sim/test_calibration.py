"""The built-in fault model and throughput model, measured end to end through the real router.

Slow: each study arm is a co-restarted deployment driven by 60 concurrent sessions x 4 rounds (time
scale 0.05), averaged over repetitions; the throughput curve runs at time scale 0.5. The same starts
check the rehearsal's model of an arm's rate (`python -m orchestrator.study.rehearse`: 1 - (1 - p)^rounds, p
the rule's per-turn probability at the workload's concurrency) against the sim.
"""

from __future__ import annotations

import asyncio
import functools
import math
from pathlib import Path

import pytest
from simkit import (
    BASELINE,
    FIXED,
    Arm,
    bench_level,
    count,
    fresh_stress_run,
    run_sessions,
    sim_counters,
)

from orchestrator.study.rehearse import from_config

SESSIONS, ROUNDS = 60, 4


def corruption_rates(c, reps: int) -> list[float]:
    """Corrupted fraction per repetition; checks every corrupted session is one the sim corrupted."""
    rates = []
    for rep in range(reps):
        before = sim_counters(c.procs["decode"].url)
        outcomes = asyncio.run(run_sessions(c.router_url, SESSIONS, ROUNDS, seed=1000 + rep))
        after = sim_counters(c.procs["decode"].url)
        assert count(outcomes, "errored") == 0, [o.reason for o in outcomes if o.status == "errored"][:3]
        # a session ends at its first bad turn, and every corrupted turn is detectable: the counts agree
        assert count(outcomes, "corrupted") == after["corrupted_turns"] - before["corrupted_turns"]
        rates.append(count(outcomes, "corrupted") / SESSIONS)
    return rates


@functools.cache
def rehearsed_arms() -> dict[str, dict]:
    """The rehearsal's model of the dsv4 study's arms (rate per session, restart ICC), by label."""
    result = from_config(["+experiment=dsv4_corruption", "rehearse.studies=1"])
    assert result["workload"] == {"sessions": SESSIONS, "rounds": ROUNDS, "load": SESSIONS}
    return {a["label"]: a for a in result["design"]["arms"]}


# Starts per band, sized to what the check must catch: the sim's mean off the model's by 5 points (the
# original band's width), at 3.5 SE. The baseline's 24 starts catch that 84% of the time (30 did 93%; a
# 35% relative shift 96%); at HiCache off's ~5.4%, 14 starts catch it 98% of the time (20 did 100%), and
# no number of starts this side of hundreds catches a relative shift there (a 35% one: 8% at 14 starts,
# 17% at 20). A shift that a change brings stays in every run after it: missed 16% of the time in one run,
# it is missed in two running 3% of the time
@pytest.mark.slow
@pytest.mark.parametrize(
    ("arm", "label", "low", "high", "reps"),
    [(BASELINE, "baseline", 0.13, 0.18, 24), (Arm(hicache=False), "hicache=off", 0.03, 0.07, 14)],
    ids=["baseline", "no-hicache"],
)
def test_corrupting_arms_land_in_the_original_bands(cluster, tmp_path: Path, arm, label, low, high, reps):
    """Measured with the orchestrator's own stress runner and oracle (orchestrator/workload/stress.py).
    Each start draws its own rate (restart_icc), so every repetition is a fresh co-restarted
    deployment. The modelled load follows the workload, not the host's speed (engine.py), so this runs
    beside other tests (test_host_load.py: beside CPU hogs). The rehearsal's modelled rate must lie in
    the original hunt's band, and the starts' mean must match it within sampling error."""
    c = cluster(time_scale=0.05)
    rates, loads = [], []
    for rep in range(reps):
        # the oracle finds every turn the sim corrupted, no more (checked by fresh_stress_run)
        summary, counters = fresh_stress_run(c, arm, tmp_path / f"r{rep}", SESSIONS, ROUNDS, 2000 + rep)
        rates.append(summary.corrupted / SESSIONS)
        loads.append(counters["planned_load_sum"] / counters["planned_turns"])
    mean = sum(rates) / len(rates)
    assert sim_counters(c.procs["decode"].url)["max_batch"] >= 40  # the sessions really ran concurrently
    # the sim is held to the rehearsal's model (beta-binomial sampling error of the sessions in runs of
    # SESSIONS, 3.5 SE), and the model to the original band. Not the measured mean to the band: the
    # baseline's model sits at 16.6%, 1.4 SE under the band's top for 30 starts, so a sim exactly as
    # modelled left it in 8% of runs (a clean-clone CI run did, at 18.3%)
    modelled = rehearsed_arms()[label]
    q, icc, n = modelled["rate"], modelled["restart_icc"], SESSIONS * reps
    assert low <= q <= high, (q, low, high)
    se = math.sqrt(q * (1 - q) / n * (1 + (SESSIONS - 1) * icc))
    assert abs(mean - q) <= 3.5 * se, (mean, q, se, rates)
    # the load a turn joins is about the concurrency the model assumes
    assert 0.7 * SESSIONS <= sum(loads) / len(loads) <= SESSIONS, loads


# the study's three fixes (one knob off), one with HiCache off too, and every knob off: through the real
# router, 60 concurrent sessions each (every one of the 14 non-matching configurations is checked against
# the rules, without servers, in test_fault_model.py)
OTHER_ARMS = [
    Arm(capture=False),
    Arm(bf16_index_k=False),
    Arm(multi_stream=False),
    Arm(multi_stream=False, hicache=False),
    Arm(capture=False, bf16_index_k=False, multi_stream=False, hicache=False),
]


@pytest.mark.slow
@pytest.mark.parametrize("arm", OTHER_ARMS, ids=str)
def test_every_other_arm_never_corrupts(cluster, arm):
    c = cluster(time_scale=0.05)
    c.start_all(arm)
    assert corruption_rates(c, reps=1) == [0.0]
    counters = sim_counters(c.procs["decode"].url)
    assert counters["max_batch"] >= 40 and counters["corrupted_turns"] == 0


@pytest.mark.slow
def test_clean_model_gives_zero_corrupted_in_500_sessions(cluster, tmp_path: Path):
    """No false alarm through the whole PD path: prefill, hand-off, decode and the real router's framing
    of the stream. What could go wrong there goes wrong on every turn (a framing the oracle misreads), so
    500 sessions x 4 rounds are plenty; the sim's replies themselves, rare shapes included, are judged clean
    over 1,000 sessions x 4 rounds in tests/workload/test_stress.py."""
    clean = tmp_path / "clean.yaml"
    clean.write_text("version: 1\nname: clean\nrules: []\n")
    c = cluster(time_scale=0.05, fault_model=str(clean))
    c.start_all(BASELINE)  # the configuration the built-in model corrupts most
    outcomes = asyncio.run(run_sessions(c.router_url, 500, ROUNDS, seed=7, concurrency=64))
    assert (count(outcomes, "clean"), count(outcomes, "corrupted"), count(outcomes, "errored")) == (
        500,
        0,
        0,
    )
    assert sim_counters(c.procs["decode"].url)["max_batch"] >= 40


@pytest.mark.slow
@pytest.mark.alone  # tok/s within 10% of the model: other tests' load beside it stretched C=8 by 10% once
def test_fixed_arm_throughput_curve_matches_the_calibration(cluster):
    # at half the modelled step times: every modelled sleep is a half, so tok/s is twice the model's, in
    # half the time. Not a quarter: alone, that came out at 0.96-0.99 of the target on an idle machine, but
    # at 0.80 at C=64 in a clean-clone run on a machine slowed by its neighbours (e5ba797: each step's 64
    # streams then took more CPU than the step's 24 ms); at a half a step has twice the time for the same work
    scale = 0.5
    c = cluster(time_scale=scale)
    c.start_all(FIXED)
    targets = {c_: tok / scale for c_, tok in {1: 53, 8: 280, 32: 561, 64: 657}.items()}
    for concurrency, target in targets.items():
        # at C=1 the decode idles before each request (it passes router, prefill and hand-off first): a
        # longer reply there keeps that gap, which a loaded machine stretches, within the 5% below; and one
        # reply, as a second is the same gap over as many tokens (0.99 of the target either way). Above
        # C=1 two rounds of C requests: with one, the level's start weighs double (0.957 of the sim's own
        # rate at C=32 once in five, where two rounds gave 0.99 or more in five)
        output_len, requests = (256, 1) if concurrency == 1 else (64, 2 * concurrency)
        before = sim_counters(c.procs["decode"].url)
        level = asyncio.run(bench_level(c.router_url, concurrency, requests, output_len=output_len))
        after = sim_counters(c.procs["decode"].url)
        assert level.errors == 0 and level.output_tokens == requests * output_len
        assert level.tok_s == pytest.approx(target, rel=0.10), (concurrency, level)
        # the client's count agrees with the sim's own account of its work
        generated = after["tokens_generated"] - before["tokens_generated"]
        busy = after["busy_time_s"] - before["busy_time_s"]
        assert generated == level.output_tokens
        assert level.tok_s == pytest.approx(generated / busy, rel=0.05)
