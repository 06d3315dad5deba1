"""The decode's load during an arm's stress run, as the server itself reports it, against the planned
concurrency.

A corruption rate that grows with the decode batch is only comparable between arms (and with the bug
report) at the load the workload meant to put on the decode. So while the stress workload runs, a thread
polls the decode server's Prometheus endpoint (`/metrics`, which SGLang serves only with
`--enable-metrics`) every `interval_s` and reads its load: the sum of SGLang's request gauges
`sglang:num_running_reqs` (the running batch) and `sglang:num_queue_reqs` (waiting), plus, where the
server has them, the PD decode queues `sglang:num_decode_prealloc_queue_reqs` and
`sglang:num_decode_transfer_queue_reqs` (requests whose KV is being allocated or received).

Which series of a gauge count (read from sglang 0.5.23's `SchedulerMetricsCollector.init_new`): each
scheduler that reports labels its series `tp_rank` (the *global* TP rank), `pp_rank`, `moe_ep_rank`, and
under DP attention `dp_rank`; by default only attention-TP rank 0 of each DP group reports (every rank with
`enable_metrics_for_all_schedulers`, repeating its group's count). With priority scheduling the total is
the series with `priority=""` and the others are a per-priority breakdown of it. So one series per DP
group counts: the lowest `tp_rank` of its `dp_rank` (pipeline stage 0, the total), and the groups are
summed. Keeping only `tp_rank="0"` would drop every DP group but the first, whose rank-0 scheduler has
global TP rank 0. The simulated server reports its modelled load in the same gauges
(orchestrator/sim/server.py), so the same code reads both.

The planned concurrency is the sessions the workload runs at once (`workload.concurrency`, else all of
them). A load whose mean is under `SHORT_FRACTION` (80%) of that fell short: the sessions spent much
of their time elsewhere (a slow client, the prefill, the network), and the rate measured is that of a
lighter load than planned.

Never fails the arm: a server without `--enable-metrics` (404), one that cannot be reached, or one whose
`/metrics` lacks the gauges makes the load *unknown*, with the reason (`DecodeLoad.unknown`).

Pure except `DecodeLoadMonitor` (a thread doing HTTP GETs): `parse_load(text)` and `DecodeLoad`.
"""

from __future__ import annotations

import logging
import re
import statistics
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

RUNNING = "sglang:num_running_reqs"
LOAD_GAUGES = (
    RUNNING,
    "sglang:num_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
SHORT_FRACTION = 0.8
# a sim stress run lasts seconds (the time scale compresses GPU time): several samples a second
DEFAULT_INTERVAL_S = 0.25
_SAMPLE_RE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


class LoadUnavailable(Exception):
    """The decode's load could not be read; the message says why, for the report."""


def _rank(labels: Mapping[str, str], name: str) -> int:
    try:
        return int(labels.get(name, "0") or 0)
    except ValueError:
        return 0


def parse_load(text: str) -> float:
    """The load in one `/metrics` page: the sum of the `LOAD_GAUGES` series present, one series per DP
    group (module doc). Raises LoadUnavailable when the page has no `sglang:num_running_reqs`."""
    # (gauge, dp_rank) -> (tp_rank, value) of the group's reporting series with the lowest tp_rank
    groups: dict[tuple[str, str], tuple[int, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = _SAMPLE_RE.match(line)
        if found is None or found.group(1) not in LOAD_GAUGES:
            continue
        labels = dict(_LABEL_RE.findall(found.group(2) or ""))
        if labels.get("priority", "") or _rank(labels, "pp_rank") != 0:
            continue  # a per-priority breakdown of the total, or a later pipeline stage
        try:
            value = float(found.group(3))
        except ValueError:
            continue
        if value != value:  # NaN: no value
            continue
        key, tp_rank = (found.group(1), labels.get("dp_rank", "")), _rank(labels, "tp_rank")
        if key not in groups or tp_rank < groups[key][0]:
            groups[key] = (tp_rank, value)
    if not any(gauge == RUNNING for gauge, _ in groups):
        raise LoadUnavailable(f"the decode's /metrics has no {RUNNING} gauge")
    return sum(value for _, value in groups.values())


def planned_concurrency(sessions: int, concurrency: int | None) -> int:
    """The sessions a stress run keeps open at once (`StressSettings.workers`)."""
    return min(sessions, concurrency or sessions)


@dataclass(frozen=True)
class DecodeLoad:
    """The decode's load over one stress run: the samples, or why there are none."""

    planned: int  # the planned concurrency (sessions at once)
    samples: tuple[float, ...] = ()
    interval_s: float = DEFAULT_INTERVAL_S
    unknown: str = ""  # why the load is unknown ("" when measured)
    failed_polls: int = 0  # polls that got no value (the samples are the others)

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None

    @property
    def p50(self) -> float | None:
        return float(statistics.median(self.samples)) if self.samples else None

    @property
    def max(self) -> float | None:
        return max(self.samples) if self.samples else None

    @property
    def fraction(self) -> float | None:
        """The mean load over the planned concurrency."""
        mean = self.mean
        return mean / self.planned if mean is not None and self.planned > 0 else None

    @property
    def short(self) -> bool:
        fraction = self.fraction
        return fraction is not None and fraction < SHORT_FRACTION

    def metrics(self) -> dict[str, float]:
        """MLflow metrics (the planned concurrency always; the load when it was measured)."""
        values = {"decode_load.planned": float(self.planned)}
        if self.measured:
            values |= {
                "decode_load.mean": round(float(self.mean or 0.0), 3),
                "decode_load.p50": float(self.p50 or 0.0),
                "decode_load.max": float(self.max or 0.0),
                "decode_load.samples": float(len(self.samples)),
            }
        return values

    def to_dict(self) -> dict[str, Any]:
        return {
            "planned": self.planned,
            "measured": self.measured,
            "unknown": self.unknown,
            "mean": self.mean,
            "p50": self.p50,
            "max": self.max,
            "fraction": self.fraction,
            "short": self.short,
            "interval_s": self.interval_s,
            "failed_polls": self.failed_polls,
            "samples": list(self.samples),
        }


def fetch_metrics(url: str, timeout_s: float) -> str:
    """The text of a `/metrics` page; LoadUnavailable saying why when there is none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        hint = " (SGLang serves it only with --enable-metrics)" if e.code == 404 else ""
        raise LoadUnavailable(f"the decode's {url} answered HTTP {e.code}{hint}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise LoadUnavailable(f"the decode's {url} could not be read: {reason}") from e


@dataclass
class DecodeLoadMonitor:
    """Polls the decode's `/metrics` in a thread while a stress run goes on:

        monitor = DecodeLoadMonitor("http://decode:30001/metrics", planned=60).start()
        ... run the workload ...
        load = monitor.stop()  # a DecodeLoad, measured or unknown (never raises)

    The first poll is one interval after `start` (the sessions have reached the decode by then)."""

    url: str
    planned: int
    interval_s: float = DEFAULT_INTERVAL_S
    timeout_s: float = 2.0
    fetch: Callable[[str, float], str] = fetch_metrics
    _samples: list[float] = field(default_factory=list, init=False)
    _failures: list[str] = field(default_factory=list, init=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _result: DecodeLoad | None = field(default=None, init=False)

    def start(self) -> DecodeLoadMonitor:
        self._thread = threading.Thread(target=self._run, name="decode-load", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        """One sample (or one failure, with its reason)."""
        try:
            self._samples.append(parse_load(self.fetch(self.url, self.timeout_s)))
        except LoadUnavailable as e:
            self._failures.append(str(e))
        except Exception as e:  # whatever happens here must not touch the arm
            self._failures.append(f"reading the decode's load failed: {type(e).__name__}: {e}")

    def stop(self) -> DecodeLoad:
        """Stop polling; the load over the run. Idempotent."""
        if self._result is not None:
            return self._result
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s + self.interval_s + 1.0)
        if not self._samples and not self._failures:
            self.poll()  # a run shorter than one interval: one sample at its end
        samples, failures = tuple(self._samples), list(self._failures)
        unknown = ""
        if not samples:
            unknown = failures[-1] if failures else "no sample of the decode's load was taken"
        self._result = DecodeLoad(
            planned=int(self.planned),
            samples=samples,
            interval_s=self.interval_s,
            unknown=unknown,
            failed_polls=len(failures),
        )
        if unknown:
            log.warning("decode load unknown: %s", unknown)
        return self._result


def from_record(metrics: Mapping[str, float], tags: Mapping[str, str]) -> dict[str, Any]:
    """A run's decode load as MLflow holds it (`DecodeLoad.metrics` and the `decode_load` tags) -> the
    dict the analysis reads: {} when the run recorded none (runs logged before it existed)."""
    if "decode_load.planned" not in metrics and "decode_load" not in tags:
        return {}
    mean = metrics.get("decode_load.mean")
    planned = metrics.get("decode_load.planned")
    return {
        "planned": int(planned) if planned is not None else None,
        "measured": mean is not None,
        "unknown": "" if mean is not None else tags.get("decode_load_unknown", "not measured"),
        "mean": mean,
        "p50": metrics.get("decode_load.p50"),
        "max": metrics.get("decode_load.max"),
    }
