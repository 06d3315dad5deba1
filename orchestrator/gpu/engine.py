"""The GPU decode engine: the simulated decode's scheduler, with real GPU work deciding corruption.

Selected on the decode role of `python -m orchestrator.sim.server` with
`HEISENHUNT_DECODE_ENGINE=orchestrator.gpu.engine:GpuDecodeEngine`. Everything the server does stays
the same (flags, `SGLANG_*` env, HTTP surface, PD hand-off, batching, modelled step times), except:

- start-up loads the step's weights on the GPU and, unless decode graphs are off
  (`--disable-decode-cuda-graph` or the deprecated `--disable-cuda-graph`: `args.decode_graphs_enabled`,
  the one decision the sim's engine uses too), captures one CUDA graph per batch bucket up to
  `--cuda-graph-max-bs-decode` (kernel.DecodeStep.capture);
- every decode step runs `kernel.DecodeStep.step` for the running batch (its bucket's graph, or eager
  above the largest bucket) and compares each row's indexer result with a serialized reference;
- a planned tool-call request whose row disagrees gets the corrupted continuation of
  corruption.corrupt_from. The fault model's rules are not consulted: no probability anywhere.

Environment (besides SGLang's, read by the server): `HEISENHUNT_GPU_INDEXER_FIX` = `none` (default) |
`record_stream` (the real fix: the side stream is recorded on the index key before it is dropped);
`HEISENHUNT_GPU_COUNTERS_DIR`: where each start writes its counters as JSON (every 200 steps and at
shutdown), for the study's per-bucket report (orchestrator.gpu.report).

The torch work runs on one dedicated worker thread (CUDA streams are per thread); the event loop
awaits it, so HTTP keeps being served while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.gpu.buckets import bucket_for
from orchestrator.gpu.corruption import corrupt_from
from orchestrator.sim.engine import DecodeEngine, DecodeRequest, SimCounters
from orchestrator.sim.faults import FaultModel, RoleConfig

log = logging.getLogger("sglang.gpu.scheduler")

FIX_ENV = "HEISENHUNT_GPU_INDEXER_FIX"
COUNTERS_DIR_ENV = "HEISENHUNT_GPU_COUNTERS_DIR"
FIXES = ("none", "record_stream")
EAGER = "eager"  # the bucket label of steps that ran without a graph
WRITE_EVERY_STEPS = 200
START_FAILED_EXIT = 3


def parse_fix(raw: str | None) -> str:
    value = (raw or "none").strip().lower()
    if value not in FIXES:
        raise ValueError(f"{FIX_ENV} must be one of {list(FIXES)}, got {raw!r}")
    return value


@dataclass
class BucketCounters:
    steps: int = 0
    rows: int = 0  # real (unpadded) rows stepped
    mismatched_steps: int = 0  # steps where at least one real row disagreed with the reference
    mismatched_rows: int = 0
    corrupted_turns: int = 0  # planned tool calls this bucket's mismatch corrupted
    masked_rows: int = 0  # mismatching rows with nothing visible left to corrupt


@dataclass
class GpuCounters:
    buckets: dict[str, BucketCounters] = field(default_factory=dict)

    def record(self, bucket: str, rows: Sequence[bool]) -> BucketCounters:
        c = self.buckets.setdefault(bucket, BucketCounters())
        c.steps += 1
        c.rows += len(rows)
        bad = sum(rows)
        c.mismatched_steps += bad > 0
        c.mismatched_rows += bad
        return c

    def to_dict(self) -> dict[str, dict[str, int]]:
        order = sorted(self.buckets, key=lambda b: (b == EAGER, int(b) if b != EAGER else 0))
        return {b: dataclasses.asdict(self.buckets[b]) for b in order}


def torch_step_factory(bf16_keys: bool, multi_stream: bool, record_stream: bool, seed: int):
    """The real step (imports torch: only ever called on the worker thread)."""
    from orchestrator.gpu.kernel import DecodeStep, StepConfig, device_facts

    return DecodeStep(StepConfig(bf16_keys, multi_stream, record_stream), seed), device_facts()


class GpuDecodeEngine(DecodeEngine):
    def __init__(
        self,
        model: FaultModel,
        config: RoleConfig,
        scale: float,
        counters: SimCounters,
        rng: random.Random,
        log_interval: int = 40,
        environ: Mapping[str, str] | None = None,
        step_factory: Callable[..., tuple[Any, dict[str, str]]] = torch_step_factory,
    ):
        # no rules: the sim's admission path never corrupts; only a mismatching GPU step does
        super().__init__(dataclasses.replace(model, rules=()), config, scale, counters, rng, log_interval)
        environ = os.environ if environ is None else environ
        self.fix = parse_fix(environ.get(FIX_ENV))
        self.bf16_keys = bool(config.env.get("SGLANG_DSV4_BF16_INDEX_K", False))
        counters_dir = environ.get(COUNTERS_DIR_ENV)
        self.counters_dir = Path(counters_dir) if counters_dir else None
        self.seed = int.from_bytes(os.urandom(4), "little")  # a fresh start: fresh weights
        self.step_factory = step_factory
        self.gpu = GpuCounters()
        self.captured_sizes: list[int] = []
        self.capture_s: float | None = None
        self.device: dict[str, str] = {}
        self.started_at = datetime.now(UTC).isoformat()
        self._step: Any = None
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-step")

    async def _on_worker(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # --- start-up ------------------------------------------------------------------------------

    async def load(self, modelled_s: float) -> None:
        try:
            self._step, self.device = await self._on_worker(
                self.step_factory, self.bf16_keys, self.multi_stream, self.fix == "record_stream", self.seed
            )
        except Exception:
            log.exception("GPU decode engine could not start")
            sys.stdout.flush()
            os._exit(START_FAILED_EXIT)  # a decode without its GPU must not pass the health gate
        log.info(
            "GPU decode engine on %s (torch %s): index keys %s, multi-stream overlap %s, "
            "indexer fix %s, seed %d",
            self.device.get("gpu", "?"),
            self.device.get("torch", "?"),
            "bf16" if self.bf16_keys else "fp8",
            "on" if self.multi_stream else "off",
            self.fix,
            self.seed,
        )

    async def capture(self, sizes: Sequence[int], modelled_s: float) -> None:
        t0 = time.monotonic()
        try:
            await self._on_worker(self._step.capture, list(sizes))
        except Exception:
            log.exception("CUDA graph capture failed")
            sys.stdout.flush()
            os._exit(START_FAILED_EXIT)
        self.capture_s = time.monotonic() - t0
        self.captured_sizes = sorted(sizes)

    # --- the step ------------------------------------------------------------------------------

    async def _device_step(self, captured: bool) -> None:
        batch = len(self.running)
        bucket = bucket_for(batch, self.captured_sizes) if captured else None
        rows = await self._on_worker(self._step.step, batch, bucket)
        self._apply(rows, EAGER if bucket is None else str(bucket))
        if self.counters.decode_steps % WRITE_EVERY_STEPS == 0:
            self.write_counters()

    def _apply(self, rows: Sequence[bool], bucket: str) -> None:
        """Book one step's per-row comparison and corrupt the requests whose rows disagreed."""
        c = self.gpu.record(bucket, rows)
        for request, bad in zip(self.running, rows, strict=True):
            if not bad or request.aborted:
                continue
            if request.shape is not None:
                continue  # already corrupted by an earlier step
            if self._corrupt(request):
                c.corrupted_turns += 1
            else:
                c.masked_rows += 1

    def _corrupt(self, request: DecodeRequest) -> bool:
        if request.reply is None or not request.reply.planned:
            return False
        result = corrupt_from(request.tokens, request.pos, request.reply, request.tools)
        if result is None:
            return False
        request.shape, tokens = result
        if request.max_new_tokens is not None and len(tokens) >= request.max_new_tokens:
            tokens, request.finish_length = tokens[: request.max_new_tokens], True
        request.tokens = tokens
        self.counters.corrupted_turns += 1
        self.counters.corrupted_by_shape[request.shape] += 1
        log.debug("request %s corrupted (%s) at token %d", request.rid, request.shape, request.pos)
        return True

    # --- reporting -----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "gpu (real torch work per decode step; corruption from a serialized-reference check)",
            "started_at": self.started_at,
            "pid": os.getpid(),
            "seed": self.seed,
            "device": dict(self.device),
            "config": {
                "capture": "graph" if self.graph_enabled else "eager",
                "cuda_graph_max_bs_decode": self.max_graph_bs,
                "multi_stream": self.multi_stream,
                "bf16_index_k": self.bf16_keys,
                "indexer_fix": self.fix,
            },
            "captured_sizes": list(self.captured_sizes),
            "capture_s": self.capture_s,
            "decode_steps": self.counters.decode_steps,
            "planned_turns": self.counters.planned_turns,
            "corrupted_turns": self.counters.corrupted_turns,
            "buckets": self.gpu.to_dict(),
        }

    def write_counters(self) -> None:
        if self.counters_dir is None:
            return
        self.counters_dir.mkdir(parents=True, exist_ok=True)
        path = self.counters_dir / f"decode-{self.started_at.replace(':', '')}-{os.getpid()}.json"
        snapshot = {**self.describe(), "written_at": datetime.now(UTC).isoformat()}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(snapshot, indent=1))
        tmp.replace(path)

    def stop(self) -> None:
        super().stop()
        self.write_counters()
        self._worker.shutdown(wait=False)
