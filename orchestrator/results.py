"""What one arm produces: plain dataclasses shared by the workload, the tracker and the analysis.

These are the hand-off format between the stages of an arm (stress -> bench -> track) and between
MLflow and the report. They hold data only; every module that fills or reads them stays pure where it
can. `to_dict`/`from_dict` give the JSON form written to artifacts and read back by the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SessionStatus = Literal["clean", "corrupted", "errored"]
RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


@dataclass
class BadTurn:
    """The first turn of a session that the oracle rejected, with the evidence."""

    round_index: int
    detector: str  # the oracle's detector name, e.g. "malformed_json", "wrong_call"
    reason: str  # one line a person can read
    raw: str  # the raw assistant output of that turn (content + tool-call arguments as streamed)


@dataclass
class SessionOutcome:
    """One line of the per-session JSONL, written as each session completes."""

    session_id: str
    status: SessionStatus
    rounds: int  # rounds planned
    rounds_done: int  # rounds that completed (validated) before the session ended
    bad_turn: BadTurn | None = None  # set when status == "corrupted"
    error: str | None = None  # set when status == "errored" (HTTP status, timeout, reset, ...)
    turn_latency_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionOutcome:
        data = dict(data)
        bad = data.get("bad_turn")
        data["bad_turn"] = BadTurn(**bad) if bad else None
        return cls(**data)


@dataclass
class StressSummary:
    sessions: int  # sessions with an outcome (clean + corrupted + errored)
    clean: int
    corrupted: int
    errored: int
    planned: int  # sessions the run meant to do; > sessions when interrupted (partial)
    by_detector: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def partial(self) -> bool:
        return self.sessions < self.planned


@dataclass
class Percentiles:
    mean: float
    p50: float
    p90: float
    p99: float


@dataclass
class LevelResult:
    """One concurrency level of the throughput sweep."""

    concurrency: int
    requests: int  # completed without error
    errors: int
    missing_usage: int  # responses without a usage block (their tokens are not counted)
    duration_s: float
    output_tokens: int  # from the server's usage
    output_tok_s: float
    request_s: float
    ttft_s: Percentiles
    itl_s: Percentiles
    tpot_s: Percentiles
    achieved_concurrency: float
    client_cpu_s: float
    loop_lag_p99_s: float
    warnings: list[str] = field(default_factory=list)
    # per-request output tok/s samples are not kept here; the bootstrap uses per-request (tokens, latency)
    request_tokens: list[int] = field(default_factory=list)
    request_latency_s: list[float] = field(default_factory=list)


@dataclass
class BenchResult:
    levels: list[LevelResult]

    @property
    def client_bound(self) -> bool:
        """True when the self-audit found the client may have been the bottleneck (or tokens went
        uncounted) at any level: no throughput verdict then. `timing:` notes do not count."""
        return any(w.startswith(("client:", "usage:")) for level in self.levels for w in level.warnings)


@dataclass
class LogFacts:
    """Facts parsed from the decode server's log."""

    ready: bool = False
    capture_batches: int = 0  # decode batches run in a captured graph
    eager_batches: int = 0  # decode batches run eager (e.g. above the capture batch limit)
    bootstrap_failures: int = 0
    graph_capture_seen: bool = False
