"""The sweep's pure math on literal inputs, checked by hand and against numpy."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from orchestrator.workload.metrics import (
    AuditThresholds,
    RequestRecord,
    achieved_concurrency,
    audit_warnings,
    cpu_pressure_share,
    itls_s,
    percentiles,
    summarize_level,
    tpot_s,
    ttft_s,
)


def test_percentiles_by_hand():
    # linear interpolation on 1..5: p50 = 3, p90 = 4 + 0.6*1 = 4.6, p99 = 4 + 0.96*1 = 4.96
    p = percentiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert p.mean == 3.0
    assert p.p50 == 3.0
    assert p.p90 == pytest.approx(4.6)
    assert p.p99 == pytest.approx(4.96)


def test_percentiles_match_numpy_on_random_samples():
    rng = random.Random(7)
    values = [rng.expovariate(3.0) for _ in range(1001)]
    p = percentiles(values)
    assert p.mean == pytest.approx(np.mean(values))
    assert [p.p50, p.p90, p.p99] == pytest.approx(list(np.percentile(values, [50, 90, 99])))


def test_percentiles_of_nothing_are_nan_not_zero():
    p = percentiles([])
    assert all(math.isnan(v) for v in (p.mean, p.p50, p.p90, p.p99))


def test_ttft_itl_tpot_by_hand():
    # sent at 10.0, chunks at 10.5, 10.7, 11.0; stream ends at 11.1; usage says 4 tokens
    r = RequestRecord(start_s=10.0, end_s=11.1, output_chunk_times_s=(10.5, 10.7, 11.0), completion_tokens=4)
    assert ttft_s(r) == pytest.approx(0.5)
    assert itls_s(r) == pytest.approx([0.2, 0.3])
    # bench_serving: (latency - ttft) / (tokens - 1) = (1.1 - 0.5) / 3
    assert tpot_s(r) == pytest.approx(0.2)


def test_tpot_needs_usage_and_two_tokens():
    chunks = (1.5, 1.6)
    assert tpot_s(RequestRecord(1.0, 2.0, chunks, completion_tokens=None)) is None
    assert tpot_s(RequestRecord(1.0, 2.0, chunks, completion_tokens=1)) is None
    assert ttft_s(RequestRecord(1.0, 2.0, ())) is None


def test_achieved_concurrency_time_weighted():
    # window [0, 10]: one interval open all along, one open [5, 15] -> 10 + 5 covered over 10 s
    assert achieved_concurrency([(0.0, 10.0), (5.0, 15.0)], 0.0, 10.0) == pytest.approx(1.5)
    # intervals outside the window count for nothing
    assert achieved_concurrency([(20.0, 30.0)], 0.0, 10.0) == 0.0


def _closed_loop(concurrency: int, rounds: int, latency: float, gap: float) -> list[RequestRecord]:
    """Records of an ideal closed loop: each slot re-issues `gap` seconds after its request ends."""
    records = []
    for slot in range(concurrency):
        t = slot * 1e-4  # the ramp: slots start a little apart
        for _ in range(rounds):
            start, end = t, t + latency
            chunks = tuple(start + 0.1 + i * (latency - 0.1) / 9 for i in range(10))
            records.append(RequestRecord(start, end, chunks, completion_tokens=10, prompt_tokens=50))
            t = end + gap
    return records


def test_summarize_level_throughput_and_counts():
    records = _closed_loop(concurrency=4, rounds=5, latency=1.0, gap=0.0)
    records.append(RequestRecord(0.0, 0.2, (), error="HTTP 500"))
    records.append(RequestRecord(0.0, 1.0, (0.1, 1.0), completion_tokens=None))  # no usage block
    level = summarize_level(records, concurrency=4, client_cpu_s=0.5, loop_lags_s=[0.001] * 100)
    # the last slot starts at 3e-4 and runs five 1 s requests back to back
    assert level.duration_s == pytest.approx(3e-4 + 5.0)
    assert level.requests == 21  # 20 + the one without usage; the failed one is not a request done
    assert level.errors == 1
    assert level.missing_usage == 1
    assert level.output_tokens == 200  # the usage-less response adds nothing
    assert level.output_tok_s == pytest.approx(200 / level.duration_s)
    assert level.request_s == pytest.approx(21 / level.duration_s)
    assert level.request_tokens == [10] * 20
    assert level.request_latency_s == pytest.approx([1.0] * 20)
    assert level.ttft_s.p50 == pytest.approx(0.1)
    assert level.itl_s.mean == pytest.approx(np.mean([0.1] * 20 * 9 + [0.9]))
    assert level.tpot_s.p99 == pytest.approx((1.0 - 0.1) / 9)
    assert any(w.startswith("usage:") for w in level.warnings)


def test_healthy_closed_loop_has_no_client_warnings():
    records = _closed_loop(concurrency=8, rounds=10, latency=1.0, gap=1e-4)
    level = summarize_level(records, concurrency=8, client_cpu_s=0.5, loop_lags_s=[0.0005] * 50)
    assert level.achieved_concurrency == pytest.approx(8, rel=0.01)
    assert level.warnings == []


def test_slow_reissue_is_flagged():
    # each slot waits 0.5 s before re-issuing a 1 s request: about 2/3 of the target in flight
    records = _closed_loop(concurrency=8, rounds=10, latency=1.0, gap=0.5)
    level = summarize_level(records, concurrency=8, client_cpu_s=0.1, loop_lags_s=[0.0])
    assert level.achieved_concurrency == pytest.approx(8 * 1.0 / 1.5, rel=0.05)
    assert any("achieved concurrency" in w for w in level.warnings)


def test_one_round_level_counts_what_was_open():
    records = _closed_loop(concurrency=8, rounds=1, latency=1.0, gap=0.0)
    level = summarize_level(records, concurrency=8, client_cpu_s=0.0, loop_lags_s=[])
    assert level.achieved_concurrency == 8.0
    assert not any("achieved" in w for w in level.warnings)


def test_audit_thresholds():
    t = AuditThresholds()
    assert audit_warnings(8, 8.0, 0.1, 0.001, 0.05, 0, t) == []
    assert "CPU" in audit_warnings(8, 8.0, 0.9, 0.001, 0.05, 0, t)[0]
    assert "lag" in audit_warnings(8, 8.0, 0.1, 0.02, 0.05, 0, t)[0]
    # lag small in absolute terms but large next to the token gaps it distorts
    assert "ITL" in audit_warnings(8, 8.0, 0.1, 0.005, 0.008, 0, t)[0]
    assert audit_warnings(8, 8.0, 0.1, 0.003, 0.008, 0, t) == []
    assert audit_warnings(8, 7.0, 0.1, 0.0, math.nan, 0, t)[0].startswith("client: achieved")
    # the host's CPUs contended (other work, or the embedded default's servers beside the client)
    busy = audit_warnings(8, 8.0, 0.1, 0.001, 0.05, 0, t, cpu_pressure=0.6)
    assert len(busy) == 1 and busy[0].startswith("client: the host's CPUs were contended for 60%"), busy
    assert audit_warnings(8, 8.0, 0.1, 0.001, 0.05, 0, t, cpu_pressure=0.4) == []
    assert audit_warnings(8, 8.0, 0.1, 0.001, 0.05, 0, t, cpu_pressure=None) == []


def test_cpu_pressure_share_is_the_stall_over_the_wall_time():
    # PSI totals are microseconds: 1.5 s of stall over 3 s of level
    assert cpu_pressure_share(10_000_000, 11_500_000, 3.0) == pytest.approx(0.5)
    assert cpu_pressure_share(None, 11_500_000, 3.0) is None  # the host does not report it
    assert cpu_pressure_share(10_000_000, None, 3.0) is None
    assert cpu_pressure_share(10_000_000, 10_000_000, 0.0) is None


def test_empty_level_is_an_error():
    with pytest.raises(ValueError):
        summarize_level([], concurrency=1, client_cpu_s=0.0, loop_lags_s=[])
