"""Pure latency/throughput math for the throughput sweep: records in, numbers out.

`bench.py` does the I/O (a closed loop of streaming requests) and hands this module one
`RequestRecord` per request; everything here is deterministic and free of clocks and sockets, so it
is tested on literal inputs.

Definitions follow SGLang's `bench_serving` (`sglang.benchmark.serving`) where they are sound:

- **TTFT**: arrival of the first chunk that carries generated output (content, reasoning or a
  tool-call delta) minus the send time.
- **ITL**: the gaps between consecutive output-carrying chunks of one request, pooled over all
  requests (a chunk gap, not a per-token gap, exactly as bench_serving).
- **TPOT**: per request with more than one output token, `(latency - ttft) / (output_tokens - 1)`,
  where latency ends when the stream ends; then summarised over requests.
- **Percentiles**: numpy's default linear interpolation (bench_serving uses `np.percentile` too).
- **Throughput**: output tokens of the completed requests / level duration; request/s the same with
  request counts. Duration runs from the first send to the last completion of the level.
- **Achieved concurrency**: bench_serving's `sum(e2e latency) / duration` includes the ramp-down tail
  of a closed loop, so it always reads below target; ours is the time-averaged number of requests in
  flight over the *issuing window* (first send to last send), where a healthy closed loop holds
  exactly the target. Shortfall there can only come from the client (slow re-issue), not the server.

Where we differ on purpose:

- Output tokens come only from the server's `usage` block. bench_serving falls back to the requested
  `max_tokens` when a chat stream has no usage chunk; we count such responses in `missing_usage`,
  leave their tokens out (never estimated) and flag the level.
- Empty inputs give NaN percentiles (bench_serving gives 0, which reads as "instant").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from orchestrator.workload.results import LevelResult, Percentiles

NAN = float("nan")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request; times are `time.monotonic()` seconds."""

    start_s: float  # when the request was sent
    end_s: float  # when the stream ended (or the error was raised)
    output_chunk_times_s: tuple[float, ...] = ()  # arrivals of chunks that carried generated output
    completion_tokens: int | None = None  # from the server's usage; None when there was no usage block
    prompt_tokens: int | None = None
    error: str | None = None  # set when the request failed (HTTP status, timeout, reset, ...)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class AuditThresholds:
    """When the client may have been the bottleneck (each breach adds a warning to the level).

    - achieved concurrency below `min_concurrency_ratio` x target over the issuing window: the client
      did not re-issue fast enough to hold the loop closed;
    - client CPU above `max_cpu_fraction` of one core over the level: a single-threaded event loop that
      busy is queueing its own callbacks, which inflates every timestamp;
    - event-loop lag p99 above `max_loop_lag_s`: the loop was too busy to serve its streams on time;
    - lag above `max_lag_itl_fraction` x the ITL median (a `timing:` note, not a bottleneck): chunk
      timestamps are late by up to the lag, so latencies of that order cannot be trusted;
    - the host's CPUs contended for more than `max_cpu_pressure` of the level (Linux PSI, "some" tasks
      waited for a CPU): the client's timestamps, and on the embedded default the simulated servers
      beside it, ran late by the host's other work, which would read as the arm's throughput. On a
      host without /proc/pressure (not Linux, or PSI off) this check is skipped.
    """

    min_concurrency_ratio: float = 0.95
    max_cpu_fraction: float = 0.75
    max_loop_lag_s: float = 0.010
    max_lag_itl_fraction: float = 0.5
    # the embedded default on two cores contends with itself up to ~35% at C=64 on an idle host (client,
    # router and servers); a busy host took 50-73% at C=32-64 and 7-12% of the tok/s
    max_cpu_pressure: float = 0.50


def percentiles(values: Sequence[float]) -> Percentiles:
    """Mean, p50, p90, p99 with numpy's linear interpolation; NaN for an empty sample."""
    if len(values) == 0:
        return Percentiles(NAN, NAN, NAN, NAN)
    arr = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Percentiles(mean=float(arr.mean()), p50=float(p50), p90=float(p90), p99=float(p99))


def ttft_s(record: RequestRecord) -> float | None:
    """Time to first output chunk; None when no output chunk arrived."""
    if not record.output_chunk_times_s:
        return None
    return record.output_chunk_times_s[0] - record.start_s


def itls_s(record: RequestRecord) -> list[float]:
    """Gaps between consecutive output chunks of one request."""
    times = record.output_chunk_times_s
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def tpot_s(record: RequestRecord) -> float | None:
    """bench_serving's TPOT: (latency - ttft) / (tokens - 1); None without usage or with < 2 tokens."""
    first = ttft_s(record)
    tokens = record.completion_tokens
    if first is None or tokens is None or tokens < 2:
        return None
    return (record.latency_s - first) / (tokens - 1)


def achieved_concurrency(
    intervals: Sequence[tuple[float, float]], window_start: float, window_end: float
) -> float:
    """Time-averaged number of intervals open over [window_start, window_end]."""
    span = window_end - window_start
    if span <= 0:
        return NAN
    covered = sum(max(0.0, min(end, window_end) - max(start, window_start)) for start, end in intervals)
    return covered / span


def cpu_pressure_share(before_us: int | None, after_us: int | None, seconds: float) -> float | None:
    """The share of `seconds` in which some task on the host waited for a CPU, from two readings of
    /proc/pressure/cpu's `some total=` (microseconds); None when either reading is missing."""
    if before_us is None or after_us is None or seconds <= 0:
        return None
    return max(0.0, (after_us - before_us) / 1e6 / seconds)


def audit_warnings(
    target: int,
    achieved: float,
    cpu_fraction: float,
    loop_lag_p99: float,
    itl_p50: float,
    missing_usage: int,
    thresholds: AuditThresholds,
    cpu_pressure: float | None = None,
) -> list[str]:
    """The self-audit: one line per reason the level's numbers may be the client's, not the server's.

    Lines start with `client:` (the client, or its host, may have been the bottleneck) or `usage:`
    (tokens are undercounted): either way the report must not give a throughput verdict on that level.
    A `timing:` line says latency figures (TTFT, ITL) may be late by up to the loop lag; the client still
    held the target concurrency, so tok/s stands.
    """
    out = []
    if not math.isnan(achieved) and achieved < thresholds.min_concurrency_ratio * target:
        out.append(
            f"client: achieved concurrency {achieved:.2f} < {thresholds.min_concurrency_ratio:.0%} "
            f"of target {target}"
        )
    if cpu_fraction > thresholds.max_cpu_fraction:
        out.append(
            f"client: used {cpu_fraction:.0%} of one CPU core (limit {thresholds.max_cpu_fraction:.0%})"
        )
    if loop_lag_p99 > thresholds.max_loop_lag_s:
        out.append(
            f"client: event-loop lag p99 {loop_lag_p99 * 1e3:.1f} ms > "
            f"{thresholds.max_loop_lag_s * 1e3:.1f} ms"
        )
    elif not math.isnan(itl_p50) and loop_lag_p99 > thresholds.max_lag_itl_fraction * itl_p50:
        out.append(
            f"timing: event-loop lag p99 {loop_lag_p99 * 1e3:.2f} ms > "
            f"{thresholds.max_lag_itl_fraction:.0%} of ITL p50 {itl_p50 * 1e3:.2f} ms"
        )
    if cpu_pressure is not None and cpu_pressure > thresholds.max_cpu_pressure:
        out.append(
            f"client: the host's CPUs were contended for {cpu_pressure:.0%} of the level "
            f"(PSI some; limit {thresholds.max_cpu_pressure:.0%}): other work held them"
        )
    if missing_usage:
        out.append(f"usage: {missing_usage} response(s) without a usage block; their tokens are not counted")
    return out


def summarize_level(
    records: Sequence[RequestRecord],
    concurrency: int,
    client_cpu_s: float,
    loop_lags_s: Sequence[float],
    thresholds: AuditThresholds | None = None,
    cpu_pressure: float | None = None,
) -> LevelResult:
    """One level's LevelResult from its measured requests (warm-up already excluded).

    `client_cpu_s` is the process CPU time spent during the level; `loop_lags_s` the ticker's oversleep
    samples; `cpu_pressure` the share of the level some task on the host waited for a CPU
    (`cpu_pressure_share`), None where the host does not report it. Failed requests count in `errors` and
    are left out of every latency and throughput figure, but they do count as in flight for achieved
    concurrency.
    """
    thresholds = thresholds or AuditThresholds()
    if not records:
        raise ValueError(f"level {concurrency}: no requests were measured")
    t0 = min(r.start_s for r in records)
    t_last_send = max(r.start_s for r in records)
    t_end = max(r.end_s for r in records)
    duration = t_end - t0
    ok = [r for r in records if r.ok]
    with_usage = [r for r in ok if r.completion_tokens is not None]
    output_tokens = sum(r.completion_tokens for r in with_usage)  # type: ignore[misc]

    ttfts = [t for r in ok if (t := ttft_s(r)) is not None]
    itls = [gap for r in ok for gap in itls_s(r)]
    tpots = [t for r in with_usage if (t := tpot_s(r)) is not None]
    itl_pct = percentiles(itls)

    # Until some request has ended and been replaced the loop never cycled (e.g. requests == target):
    # then every request was open at the last send, and that count is what was achieved.
    intervals = [(r.start_s, r.end_s) for r in records]
    refilled = t_last_send > min(r.end_s for r in records)
    achieved = achieved_concurrency(intervals, t0, t_last_send) if refilled else float(len(records))
    lag_p99 = float(np.percentile(np.asarray(loop_lags_s, dtype=float), 99)) if len(loop_lags_s) else 0.0
    cpu_fraction = client_cpu_s / duration if duration > 0 else 0.0
    missing = len(ok) - len(with_usage)

    return LevelResult(
        concurrency=concurrency,
        requests=len(ok),
        errors=len(records) - len(ok),
        missing_usage=missing,
        duration_s=duration,
        output_tokens=output_tokens,
        output_tok_s=output_tokens / duration if duration > 0 else NAN,
        request_s=len(ok) / duration if duration > 0 else NAN,
        ttft_s=percentiles(ttfts),
        itl_s=itl_pct,
        tpot_s=percentiles(tpots),
        achieved_concurrency=achieved,
        client_cpu_s=client_cpu_s,
        loop_lag_p99_s=lag_p99,
        warnings=audit_warnings(
            concurrency,
            achieved,
            cpu_fraction,
            lag_p99,
            itl_pct.p50,
            missing,
            thresholds,
            cpu_pressure,
        ),
        request_tokens=[r.completion_tokens for r in with_usage],  # type: ignore[misc]
        request_latency_s=[r.latency_s for r in with_usage],
    )
