"""Command-line flags of the simulated server: the subset of `sglang.launch_server` (0.5.9 spelling) the
sim models, same names, same meaning. An unknown flag is an argparse error (exit status 2), as it is
for SGLang, so a planner that emits a wrong flag fails here as it would on a GPU host.

Every flag's `dest` (e.g. `disable_cuda_graph`) is also a key a fault model may test, as
`<role>.args.<dest>`; `arg_types()` gives their types for the fault-model validator.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

DISAGGREGATION_MODES = ("prefill", "decode", "null")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m orchestrator.sim.server",
        description="heisenhunt's simulated SGLang server (a test target, not SGLang).",
        allow_abbrev=False,  # SGLang's parser is strict about spellings; so are we
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--disaggregation-mode", choices=DISAGGREGATION_MODES, default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", default="mooncake")
    p.add_argument("--disaggregation-ib-device", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=32)
    p.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    p.add_argument("--decode-log-interval", type=int, default=40)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--tp-size", "--tp", type=int, default=1)
    p.add_argument("--dp-size", "--dp", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.stream_interval < 1:
        build_parser().error("--stream-interval must be >= 1")
    if args.cuda_graph_max_bs < 1:
        build_parser().error("--cuda-graph-max-bs must be >= 1")
    return args


def arg_types() -> dict[str, type]:
    """`dest` -> the Python type of its value (bool for store_true flags)."""
    types: dict[str, type] = {}
    for action in build_parser()._actions:
        if action.dest == "help":
            continue
        if isinstance(action, argparse._StoreTrueAction):
            types[action.dest] = bool
        else:
            types[action.dest] = action.type or str
    return types


def defaults() -> dict[str, Any]:
    """Every flag's default (what a role that did not pass the flag runs with)."""
    parser = build_parser()
    return {a.dest: a.default for a in parser._actions if a.dest != "help"}
