"""What one arm produces: plain dataclasses shared by the workload, the tracker and the analysis.

These are the hand-off format between the stages of an arm (client -> oracle -> stress -> bench ->
track) and between MLflow and the report. They hold data only; every module that fills or reads them
stays pure where it can. `to_dict`/`from_dict` give the JSON form written to artifacts and read back
by the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import pairwise
from typing import Any, Literal

SessionStatus = Literal["clean", "corrupted", "errored"]
RunStatus = Literal["FINISHED", "FAILED", "KILLED"]


@dataclass
class StreamedToolCall:
    """One tool call assembled from its stream deltas; `arguments` is the raw JSON text as streamed."""

    index: int
    id: str | None = None
    name: str = ""
    arguments: str = ""

    def as_message(self) -> dict[str, Any]:
        """The call as it goes back into the conversation (an assistant message's tool_calls entry)."""
        return {
            "id": self.id or f"call_{self.index}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class StreamedTurn:
    """One streamed assistant turn, parsed."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[StreamedToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # saw `data: [DONE]`
    raw: bytes = b""  # the response body exactly as received
    started: float = 0.0  # time.monotonic() when the request was sent
    ended: float = 0.0  # time.monotonic() when the body ended
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-bearing event
    # the generated tokens as the server's logprobs name them (asked with `logprobs: true`); None: none sent
    tokens: list[str] | None = None

    @property
    def raw_text(self) -> str:
        return self.raw.decode("utf-8", "replace")

    @property
    def latency_s(self) -> float:
        return self.ended - self.started

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.started if self.chunk_times else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between successive token-bearing events (an event may carry several tokens)."""
        times = self.chunk_times
        return [b - a for a, b in pairwise(times)]

    @property
    def prompt_tokens(self) -> int:
        return int((self.usage or {}).get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int((self.usage or {}).get("completion_tokens") or 0)


@dataclass
class BadTurn:
    """The first turn of a session that the oracle rejected, with the evidence."""

    round_index: int
    detector: str  # the oracle's detector name, e.g. "malformed_json", "wrong_call"
    reason: str  # one line a person can read
    raw: str  # the raw assistant output of that turn (content + tool-call arguments as streamed)
    family: str = ""  # the detector's family (detect.FAMILIES): structural | plan_drift | diverged ...
    # the divergence oracle's: where the turn first parted from its reference (divergence.Difference)
    divergence: dict[str, Any] | None = None


@dataclass
class SessionOutcome:
    """One line of the per-session JSONL, written as each session completes."""

    session_id: str
    status: SessionStatus
    rounds: int  # rounds planned
    rounds_done: int  # rounds that completed (validated) before the session ended
    bad_turn: BadTurn | None = None  # set when status == "corrupted": a finding of a counted family
    error: str | None = None  # set when status == "errored" (HTTP status, timeout, reset, ...)
    turn_latency_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # findings of families the run does not count: recorded, and the session went on past them
    noted: list[BadTurn] = field(default_factory=list)
    usage_missing_turns: int = 0  # turns whose stream carried no usage block (tokens unknown)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SessionOutcome:
        data = dict(data)
        bad = data.get("bad_turn")
        data["bad_turn"] = BadTurn(**bad) if bad else None
        data["noted"] = [BadTurn(**n) for n in data.get("noted") or ()]
        return cls(**data)

    def findings(self) -> list[BadTurn]:
        """Every finding of the session: the counted one that ended it, then those noted beside."""
        return [*([self.bad_turn] if self.bad_turn is not None else []), *self.noted]


@dataclass
class StressSummary:
    sessions: int  # sessions with an outcome (clean + corrupted + errored)
    clean: int
    corrupted: int
    errored: int
    planned: int  # sessions the run meant to do; > sessions when interrupted (partial)
    by_detector: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    # sessions with at least one finding of each family, counted or only noted
    by_family: dict[str, int] = field(default_factory=dict)
    usage_missing_turns: int = 0
    oracle: str = "tool_calls"  # what judged the sessions (detect.ORACLES)
    # the divergence oracle's reference pass: seconds its batch-1 turns held the deployment (GPU time)
    reference_s: float = 0.0

    @property
    def partial(self) -> bool:
        return self.sessions < self.planned

    @property
    def measured(self) -> int:
        """Sessions that reached an outcome the oracle judged (clean or corrupted)."""
        return self.clean + self.corrupted


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
        """True when the self-audit found the client may have been the bottleneck at any level: no
        throughput verdict then. `timing:` notes do not count, nor the server's missing usage."""
        return any(w.startswith("client:") for level in self.levels for w in level.warnings)

    @property
    def missing_usage(self) -> int:
        """Responses whose stream carried no usage block: the server's doing. Their tokens are not
        counted, so a sweep with any gives no throughput verdict either."""
        return sum(level.missing_usage for level in self.levels)


@dataclass
class LogFacts:
    """Facts parsed from the decode server's log."""

    ready: bool = False
    capture_batches: int = 0  # decode batches run in a captured graph
    eager_batches: int = 0  # decode batches run eager (e.g. above the capture batch limit)
    bootstrap_failures: int = 0
    graph_capture_seen: bool = False
