"""`python -m orchestrator.gpu.probe`: the GPU engine's decode step alone, on a CUDA device, per bucket.

For each cell (capture graph|eager, multi-stream on|off, record_stream, key dtype, workspace size) and
each start (a fresh DecodeStep with its own seed, graphs captured anew), replay every bucket's graph
`--replays` times with full batches and count the steps whose indexer disagrees with the serialized
reference, and the rows that disagree. Prints one line per cell and start, and writes all counts as
JSON to `--out`. This is how the engine's workspace size was chosen (see kernel.WORKSPACE_BYTES) and
what the GPU tests assert on.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

from orchestrator.gpu.buckets import capture_sizes


def run_cell(config, seed: int, sizes: list[int], replays: int, graph: bool) -> dict:
    from orchestrator.gpu.kernel import DecodeStep

    step = DecodeStep(config, seed)
    t0 = time.monotonic()
    if graph:
        step.capture(sizes)
    capture_s = time.monotonic() - t0
    per_bucket = {}
    for size in sizes:
        bad_steps = bad_rows = 0
        for _ in range(replays):
            rows = step.step(size, size if graph else None)
            bad_steps += any(rows)
            bad_rows += sum(rows)
        per_bucket[size] = {"steps": replays, "bad_steps": bad_steps, "bad_rows": bad_rows}
    return {"capture_s": capture_s, "buckets": per_bucket}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replays", type=int, default=40)
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--workspace-kib", default="8,16,20,32", help="workspace sizes swept on the racy cell")
    p.add_argument("--max-bs", type=int, default=32)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from orchestrator.gpu.kernel import WORKSPACE_BYTES, StepConfig, device_facts

    sizes = capture_sizes(args.max_bs)
    cells = []
    for kib, bf16 in itertools.product([int(v) for v in args.workspace_kib.split(",")], (True, False)):
        cells.append(("graph", StepConfig(bf16, True, False, kib * 1024)))
    for bf16 in (True, False):
        cells.append(("graph", StepConfig(bf16, False, False, WORKSPACE_BYTES)))  # multi-stream off
        cells.append(("graph", StepConfig(bf16, True, True, WORKSPACE_BYTES)))  # the fix
        cells.append(("eager", StepConfig(bf16, True, False, WORKSPACE_BYTES)))
    facts = device_facts()
    print(json.dumps(facts), flush=True)
    results = []
    for (mode, config), start in itertools.product(cells, range(args.starts)):
        cell = run_cell(config, 1000 + start, sizes, args.replays, mode == "graph")
        row = {"mode": mode, "start": start, **vars(config), **cell}
        results.append(row)
        counts = " ".join(f"B{b}:{c['bad_steps']}/{c['bad_rows']}r" for b, c in cell["buckets"].items())
        print(
            f"{mode} keys={'bf16' if config.bf16_keys else 'fp8'} ms={int(config.multi_stream)} "
            f"rs={int(config.record_stream)} ws={config.workspace_bytes // 1024}K start={start}: {counts}",
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"device": facts, "replays": args.replays, "cells": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
