"""The throughput sweep: a closed loop of streaming chat requests at each concurrency level.

For each level C (default 1, 8, 32, 64) the sweep keeps exactly C requests in flight (C workers,
each sends its next request as soon as its previous one ends) until N requests were sent (or a
duration passed), then waits for the last ones. Warm-up requests are sent once before the first
level and are not measured. Every request is a streaming chat completion with
`stream_options.include_usage`, `max_tokens = output_len` and `ignore_eos` (so outputs have the
asked length on SGLang), through the shared client in `client.py`. The numbers are computed by the
pure functions in `metrics.py`; this module only does the I/O and the self-audit sampling.

Metric definitions follow SGLang's bench_serving; each place where we differ is listed in
`metrics.py`'s docstring and in bench/README.md. In short: output tokens come only from the server's
`usage` block (a response without one is counted in `missing_usage` and flagged, never estimated from
chunks or `max_tokens`); achieved concurrency is measured over the issuing window; empty samples give
NaN. Also different: the prompt. bench_serving samples token ids with the model's tokenizer; no
tokenizer can be downloaded here, so a prompt is `input_len` words drawn from a list of common
English words that are one token each in the usual BPE vocabularies, behind a per-request nonce so no
two prompts share a prefix (the server's radix cache must not turn prefill into a cache hit).
`input_len` is therefore approximate; the server's own prompt count is logged per level.

Self-audit, per level (thresholds in `metrics.AuditThresholds`): achieved concurrency vs target over the
issuing window, the process CPU time over the level (`time.process_time`) and the event-loop lag (a ticker
task that sleeps `LAG_TICK_S` and records how much it overslept), and how contended the host's CPUs were
(Linux PSI, `CPU_PRESSURE`): on the embedded default the simulated servers share the client's host, and
other work there slows both, which reads as the arm's throughput. A breach adds a line to
`LevelResult.warnings`; `BenchResult.client_bound` is then true and the report gives no throughput
verdict.

Results: `out_dir/bench.json` (rewritten after each level, so an interrupted sweep keeps what it
measured), read back with `load_bench`.

Standalone:
    python -m orchestrator.workload.bench --url http://127.0.0.1:8000 --concurrency 1,8,32,64 --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.workload.client import chat_payload, open_session, stream_chat
from orchestrator.workload.fill import fill
from orchestrator.workload.metrics import AuditThresholds, RequestRecord, cpu_pressure_share, summarize_level
from orchestrator.workload.results import BenchResult, LevelResult, Percentiles
from orchestrator.workload.wire import RequestError

log = logging.getLogger(__name__)

DEFAULT_LEVELS = (1, 8, 32, 64)
#: the loop-lag ticker's period: short enough to sample lag many times per ITL, cheap (~200 wakeups/s)
LAG_TICK_S = 0.005
#: Linux pressure stall information for CPUs (kernel 4.20+): the host's contention, for the self-audit
CPU_PRESSURE = "/proc/pressure/cpu"

# Common English words, each a single token (with its leading space) in the GPT-2/Llama/Qwen/DeepSeek
# BPE vocabularies, so a prompt of n words is close to n tokens without a tokenizer.
_WORDS_TEXT = (
    "the of and to in is was for that on as with by he at from his an were are which this be or "
    "had not but one have they you all her she there been their has would when who will more no if "
    "out so said what up its about into than them can only other new some could time these two may "
    "then do first any my now such like our over man me even most made after also did many before "
    "must through back years where much your way well down should because each just those people how "
    "too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class BenchConfig:
    """What one sweep does, written into bench.json. Per level: `requests_per_level` requests, or
    `duration_s` seconds, or (neither given) `requests_per_worker` x C requests."""

    url: str  # a server or router base URL
    concurrency_levels: tuple[int, ...] = DEFAULT_LEVELS
    requests_per_level: int | None = None  # a fixed count per level; None: requests_per_worker x C
    requests_per_worker: int = 4  # rounds of the closed loop per level, when requests_per_level is None
    duration_s: float | None = None  # per level; the in-flight requests at the deadline still count
    input_len: int = 512  # prompt words (~tokens)
    output_len: int = 128  # max_tokens, with ignore_eos
    model: str = "default"
    warmup_requests: int = 2
    timeout_s: float = 120.0  # per request
    seed: int = 0
    thresholds: AuditThresholds = field(default_factory=AuditThresholds)

    def __post_init__(self) -> None:
        # a list from a config or the CLI is fine; the config stays hashable and its levels ints
        object.__setattr__(self, "concurrency_levels", tuple(int(c) for c in self.concurrency_levels))
        if not self.concurrency_levels or any(c < 1 for c in self.concurrency_levels):
            raise ValueError(f"concurrency levels must be >= 1: {self.concurrency_levels}")
        if self.requests_per_level is not None and self.duration_s is not None:
            raise ValueError("give requests_per_level or duration_s, not both")
        if self.requests_per_level is not None and self.requests_per_level < max(self.concurrency_levels):
            raise ValueError(
                f"requests_per_level={self.requests_per_level} is below concurrency "
                f"{max(self.concurrency_levels)}: that level could never hold its target in flight"
            )
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0: {self.duration_s}")
        if self.requests_per_worker < 1:
            raise ValueError(f"requests_per_worker must be >= 1: {self.requests_per_worker}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len and output_len must be >= 1: {self.input_len}, {self.output_len}")

    def requests_for(self, concurrency: int) -> int | None:
        """How many requests the level sends; None in duration mode."""
        if self.duration_s is not None:
            return None
        if self.requests_per_level is not None:
            return self.requests_per_level
        return self.requests_per_worker * concurrency


def synthetic_prompt(input_len: int, seed: int) -> str:
    """`input_len` words (~tokens): a unique nonce word first, then common words, seeded."""
    rng = random.Random(seed)
    nonce = f"{rng.getrandbits(32):08x}"
    return " ".join([nonce, *rng.choices(WORDS, k=max(0, input_len - 1))])


def request_payload(config: BenchConfig, seed: int) -> dict[str, Any]:
    """The chat body of one bench request (the prompt seeded by `seed`)."""
    messages = [{"role": "user", "content": synthetic_prompt(config.input_len, seed)}]
    # ignore_eos: SGLang's extension (as bench_serving sends it), so every output has output_len tokens
    return chat_payload(
        config.model, messages, max_tokens=config.output_len, temperature=0.0, ignore_eos=True
    )


async def _one_request(session: Any, config: BenchConfig, payload: dict[str, Any]) -> RequestRecord:
    started = time.monotonic()
    try:
        turn = await stream_chat(session, config.url, payload, timeout=config.timeout_s)
    except RequestError as e:
        return RequestRecord(started, time.monotonic(), error=f"{e.kind}: {e.message}"[:300])
    usage = turn.usage or {}
    completion = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    return RequestRecord(
        start_s=turn.started,
        end_s=turn.ended,
        output_chunk_times_s=tuple(turn.chunk_times),
        completion_tokens=int(completion) if isinstance(completion, int) else None,
        prompt_tokens=int(prompt) if isinstance(prompt, int) else None,
    )


async def _lag_ticker(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep LAG_TICK_S over and over; how late each wake-up is, is the loop's lag."""
    while not stop.is_set():
        before = time.monotonic()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, time.monotonic() - before - LAG_TICK_S))


def read_cpu_pressure_us(path: str = CPU_PRESSURE) -> int | None:
    """Linux PSI: the microseconds, since boot, in which some task on the host waited for a CPU; None
    where the host does not report it."""
    try:
        with open(path) as f:
            some = next(line for line in f if line.startswith("some "))
        return int(some.rsplit("total=", 1)[1])
    except (OSError, StopIteration, IndexError, ValueError):
        return None


async def _run_level(session: Any, config: BenchConfig, concurrency: int, level_index: int) -> LevelResult:
    total = config.requests_for(concurrency)
    seed_base = (config.seed * 1_000_003 + level_index) * 10_000_000
    # prompts are built before the clock starts where the count is known, so the loop only sends
    prepared = [request_payload(config, seed_base + i) for i in range(total)] if total is not None else None
    records: list[RequestRecord] = []
    next_index = 0
    lags: list[float] = []
    stop = asyncio.Event()
    ticker = asyncio.create_task(_lag_ticker(lags, stop))
    pressure_before, wall_before = read_cpu_pressure_us(), time.monotonic()
    cpu_before = time.process_time()
    deadline = time.monotonic() + config.duration_s if config.duration_s is not None else math.inf

    async def worker() -> None:
        nonlocal next_index
        while True:
            i = next_index
            if (total is not None and i >= total) or time.monotonic() >= deadline:
                return
            next_index += 1
            payload = prepared[i] if prepared is not None else request_payload(config, seed_base + i)
            records.append(await _one_request(session, config, payload))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        cpu = time.process_time() - cpu_before
        stop.set()
        await ticker
    pressure = cpu_pressure_share(pressure_before, read_cpu_pressure_us(), time.monotonic() - wall_before)
    level = summarize_level(records, concurrency, cpu, lags, config.thresholds, pressure)
    errors = Counter(r.error.split(":", 1)[0] for r in records if r.error)
    if errors:
        first = next(r.error for r in records if r.error)
        log.warning("level C=%d: %d errors %s; first: %s", concurrency, level.errors, dict(errors), first)
    prompts = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    log.info(
        "level C=%d: %d ok, %.1f output tok/s, %.2f req/s, TTFT p50 %.3fs, ITL p50 %.4fs, achieved %.2f, "
        "CPU %.2fs, lag p99 %.1fms, mean prompt tokens %s%s",
        concurrency,
        level.requests,
        level.output_tok_s,
        level.request_s,
        level.ttft_s.p50,
        level.itl_s.p50,
        level.achieved_concurrency,
        level.client_cpu_s,
        level.loop_lag_p99_s * 1e3,
        f"{sum(prompts) / len(prompts):.0f}" if prompts else "n/a",
        f"; WARNINGS: {level.warnings}" if level.warnings else "",
    )
    return level


async def _warm_up(session: Any, config: BenchConfig) -> None:
    count = config.warmup_requests
    if count <= 0:
        return
    payloads = [request_payload(config, -(i + 1)) for i in range(count)]
    records = await asyncio.gather(*(_one_request(session, config, p) for p in payloads))
    failed = [r.error for r in records if r.error]
    if failed:
        log.warning("warm-up: %d of %d requests failed; first: %s", len(failed), count, failed[0])


async def run_bench(config: BenchConfig, out_dir: str | Path | None = None) -> BenchResult:
    """Run the sweep `config` describes; write out_dir/bench.json (after each level) if given."""
    result = BenchResult(levels=[])
    async with open_session(max(config.concurrency_levels)) as session:
        await _warm_up(session, config)
        for index, concurrency in enumerate(config.concurrency_levels):
            result.levels.append(await _run_level(session, config, concurrency, index))
            if out_dir is not None:
                write_bench(Path(out_dir) / "bench.json", result, config)
    return result


def run_bench_sync(config: BenchConfig, out_dir: str | Path | None = None) -> BenchResult:
    """`run_bench` for callers without an event loop."""
    return asyncio.run(run_bench(config, out_dir))


# --- bench.json ------------------------------------------------------------------------------------


def bench_to_dict(result: BenchResult, config: BenchConfig | None = None) -> dict[str, Any]:
    """The JSON form: levels as LevelResult dicts, client_bound, and the config that produced them."""
    data: dict[str, Any] = {
        "client_bound": result.client_bound,
        "missing_usage": result.missing_usage,
        "levels": [asdict(lv) for lv in result.levels],
    }
    if config is not None:
        data["config"] = asdict(config)
    return data


def bench_from_dict(data: dict[str, Any]) -> BenchResult:
    levels = []
    for raw in data["levels"]:
        raw = dict(raw)
        for key in ("ttft_s", "itl_s", "tpot_s"):
            raw[key] = Percentiles(**raw[key])
        levels.append(LevelResult(**raw))
    return BenchResult(levels=levels)


def write_bench(path: Path, result: BenchResult, config: BenchConfig | None = None) -> None:
    """Write bench.json atomically (NaN stays NaN: Python's json reads it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(bench_to_dict(result, config), indent=1))
    tmp.replace(path)


def load_bench(path: str | Path) -> BenchResult:
    return bench_from_dict(json.loads(Path(path).read_text()))


# --- CLI -------------------------------------------------------------------------------------------


def format_table(result: BenchResult) -> str:
    """A plain-text table of the sweep, one line per level, warnings under it."""
    head = (
        f"{'C':>4} {'ok':>6} {'err':>4} {'tok/s':>9} {'req/s':>7} {'TTFT p50':>9} {'ITL p50':>8} "
        f"{'TPOT p50':>9} {'achieved':>8} {'cpu s':>6}"
    )
    lines = [head]
    for lv in result.levels:
        # tokens come only from the server's usage: none at all means the figure is unknown, not 0
        tok_s = "n/a" if lv.requests and lv.missing_usage == lv.requests else f"{lv.output_tok_s:.1f}"
        lines.append(
            f"{lv.concurrency:>4} {lv.requests:>6} {lv.errors:>4} {tok_s:>9} "
            f"{lv.request_s:>7.2f} {lv.ttft_s.p50:>9.4f} {lv.itl_s.p50:>8.4f} {lv.tpot_s.p50:>9.4f} "
            f"{lv.achieved_concurrency:>8.2f} {lv.client_cpu_s:>6.2f}"
        )
        lines.extend(f"     ! {w}" for w in lv.warnings)
    if result.missing_usage:
        lines.append(
            f"the server sent no usage block in {result.missing_usage} response(s): their output tokens "
            "are unknown (tok/s n/a where none had one); that is the server's doing, not the client's"
        )
    if result.client_bound:
        lines.append("client may have been the bottleneck: no throughput verdict from this sweep")
    return "\n".join(lines)


def bench_config(source: object, **given: Any) -> BenchConfig:
    """The one mapping to BenchConfig (fill.py): every field from `source` by name (a job's `bench`
    section, or the CLI's arguments), but those `given` (what the caller computes: url, model, ...)."""
    return fill(BenchConfig, source, **given)


def _levels(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(",") if c.strip())


def argument_parser() -> argparse.ArgumentParser:
    """The CLI; each dest but `out` is the BenchConfig field it sets (the flags stay as they were)."""
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.workload.bench", description=__doc__.split("\n")[0]
    )
    defaults = BenchConfig
    parser.add_argument("--url", required=True, help="server or router base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--concurrency",
        dest="concurrency_levels",
        type=_levels,
        default=",".join(map(str, DEFAULT_LEVELS)),
        help="comma-separated levels",
    )
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument(
        "--requests",
        dest="requests_per_level",
        type=int,
        default=None,
        help="per level (default: --rounds x C)",
    )
    amount.add_argument(
        "--duration", dest="duration_s", type=float, default=None, help="seconds per level instead of a count"
    )
    parser.add_argument(
        "--rounds",
        dest="requests_per_worker",
        type=int,
        default=defaults.requests_per_worker,
        help="requests per worker when --requests is not given",
    )
    parser.add_argument("--input-len", type=int, default=defaults.input_len)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--warmup", dest="warmup_requests", type=int, default=defaults.warmup_requests)
    parser.add_argument(
        "--timeout", dest="timeout_s", type=float, default=defaults.timeout_s, help="per request, seconds"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", required=True, help="directory for bench.json")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = bench_config(args)
    result = run_bench_sync(config, out_dir=args.out)
    print(format_table(result))
    print(f"wrote {Path(args.out) / 'bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
