"""Command-line flags of the simulated server: the subset of `sglang.launch_server` the sim models, in
the 0.5.23 spelling (the release the sim follows: flags, resolution, `/server_info`), same names, same
meaning. An unknown flag is an argparse error (exit status 2), as it is for SGLang, so a planner that
emits a wrong flag fails here as it would on a GPU host. So is a flag 0.5.23 no longer accepts:
`--cuda-graph-max-bs` (0.5.9's spelling) is refused by 0.5.23 as an ambiguous prefix of
`--cuda-graph-max-bs-decode` and `--cuda-graph-max-bs-prefill`; the sim does not know it at all
(`allow_abbrev=False`), so it is refused here too.

CUDA graphs, as 0.5.23 has them:
- `--disable-decode-cuda-graph` turns decode graphs off, `--disable-prefill-cuda-graph` prefill graphs;
- `--disable-cuda-graph` still parses but is deprecated and turns graphs off in *both* phases (the
  server logs a deprecation warning, `deprecation_warnings`);
- `--cuda-graph-max-bs-decode N`: the largest decode batch captured. Real sglang's default is None (the
  build's own default); the sim's is 32.
SGLang's resolution (arg_groups/cuda_graph_hook.py) turns decode graphs off when `disable_cuda_graph` or
`disable_decode_cuda_graph` is set. `parse_args` mirrors it on the parsed flags (`normalise`):
`disable_decode_cuda_graph` (and `disable_prefill_cuda_graph`) are True whenever `disable_cuda_graph` is,
so one key says whether the decode captures (`decode_graphs_enabled` is the one decision every engine
uses).

Every flag's `dest` (e.g. `disable_decode_cuda_graph`) is also a key a fault model may test, as
`<role>.args.<dest>`; `arg_types()` gives their types for the fault-model validator. `apply_overrides`
is the sim server's test-only `HEISENHUNT_SIM_OVERRIDE_ARGS` knob (server.py module doc).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

DISAGGREGATION_MODES = ("prefill", "decode", "null")
# real sglang's default for --cuda-graph-max-bs-decode is None (its own default); the sim's is this
DEFAULT_CUDA_GRAPH_MAX_BS_DECODE = 32
DEPRECATED_DISABLE_CUDA_GRAPH = (
    "'--disable-cuda-graph' is deprecated and will be removed in a future release. "
    "Use '--disable-decode-cuda-graph' and '--disable-prefill-cuda-graph' instead "
    "(it turns CUDA graphs off in both phases)."
)


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
    # deprecated in 0.5.23: both phases (normalise sets the per-phase switches)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--disable-decode-cuda-graph", action="store_true")
    p.add_argument("--disable-prefill-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs-decode", type=int, default=DEFAULT_CUDA_GRAPH_MAX_BS_DECODE)
    p.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--disable-overlap-schedule", action="store_true")
    # batch-invariant kernels: the embedded default's benign batch variance is off on a decode with it
    p.add_argument("--enable-deterministic-inference", action="store_true")
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


def _problems(args: argparse.Namespace) -> list[str]:
    """The value checks argparse's types do not make."""
    problems = []
    if args.stream_interval < 1:
        problems.append("--stream-interval must be >= 1")
    if args.cuda_graph_max_bs_decode < 1:
        problems.append("--cuda-graph-max-bs-decode must be >= 1")
    return problems


def normalise(args: argparse.Namespace, keep: frozenset[str] = frozenset()) -> argparse.Namespace:
    """SGLang's resolution of the legacy switch: `--disable-cuda-graph` turns graphs off in both phases,
    so the per-phase switches are True whenever it is (dests in `keep` are left as they are)."""
    if args.disable_cuda_graph:
        for dest in ("disable_decode_cuda_graph", "disable_prefill_cuda_graph"):
            if dest not in keep:
                setattr(args, dest, True)
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags parsed, checked and resolved (`normalise`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in _problems(args):
        parser.error(problem)
    return normalise(args)


def _get(args: argparse.Namespace | Mapping[str, Any], dest: str) -> Any:
    return args.get(dest) if isinstance(args, Mapping) else getattr(args, dest, None)


def decode_graphs_enabled(args: argparse.Namespace | Mapping[str, Any]) -> bool:
    """Whether the decode captures CUDA graphs: the one decision the sim server and every decode engine
    use. As SGLang resolves it: off if `disable_cuda_graph` or `disable_decode_cuda_graph`."""
    return not (_get(args, "disable_cuda_graph") or _get(args, "disable_decode_cuda_graph"))


def prefill_graphs_enabled(args: argparse.Namespace | Mapping[str, Any]) -> bool:
    """Whether prefill graphs are on (the sim models no prefill graphs; for the record and tests)."""
    return not (_get(args, "disable_cuda_graph") or _get(args, "disable_prefill_cuda_graph"))


def decode_graph_max_bs(args: argparse.Namespace | Mapping[str, Any]) -> int:
    """The largest decode batch captured (`--cuda-graph-max-bs-decode`; the sim's default when unset)."""
    return int(_get(args, "cuda_graph_max_bs_decode") or DEFAULT_CUDA_GRAPH_MAX_BS_DECODE)


def deprecation_warnings(args: argparse.Namespace) -> list[str]:
    """The warnings SGLang 0.5.23 prints for deprecated flags given (the server logs them)."""
    return [DEPRECATED_DISABLE_CUDA_GRAPH] if args.disable_cuda_graph else []


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


def _override_value(dest: str, value: Any, action: argparse.Action, kind: type) -> Any:
    """`value` as the parser's type for `dest` would give it, or ValueError."""
    if value is None and action.default is None:
        return None
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind in (int, float):
        ok = isinstance(value, (int | float) if kind is float else int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(f"override of {dest}: expected {kind.__name__}, got {value!r}")
    value = float(value) if kind is float else value
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"override of {dest}: {value!r} is not one of {list(action.choices)}")
    return value


def parse_overrides(raw: str) -> dict[str, Any]:
    """`HEISENHUNT_SIM_OVERRIDE_ARGS`: a JSON object {dest: value}, checked against the parser (dest
    known, value of its type and among its choices). ValueError names the bad dest and the accepted."""
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"not JSON ({e}); expected an object {{dest: value}}") from e
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object {{dest: value}}, got {type(data).__name__}")
    actions = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    types = arg_types()
    overrides = {}
    for dest, value in data.items():
        if dest not in actions:
            raise ValueError(f"unknown dest {dest!r}; accepted: {', '.join(sorted(actions))}")
        overrides[dest] = _override_value(dest, value, actions[dest], types[dest])
    return overrides


def apply_overrides(args: argparse.Namespace, overrides: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """Set the parsed (and normalised) args to `overrides` (`parse_overrides`), as a real server's
    argument resolution may do silently; then re-normalise the dests not overridden. Returns (dest,
    old, new) per override. ValueError if the result breaks a value check or asks for something the
    resolution would undo (decode graphs on while the deprecated `disable_cuda_graph` stays set)."""
    changes = [(dest, getattr(args, dest), value) for dest, value in overrides.items()]
    for dest, value in overrides.items():
        setattr(args, dest, value)
    normalise(args, keep=frozenset(overrides))
    problems = _problems(args)
    for dest in ("disable_decode_cuda_graph", "disable_prefill_cuda_graph"):
        if dest in overrides and not overrides[dest] and args.disable_cuda_graph:
            problems.append(
                f"override {dest}=false has no effect while disable_cuda_graph is true (SGLang turns "
                "the phase's graphs off if either is set): override disable_cuda_graph to false too"
            )
    if problems:
        raise ValueError("; ".join(problems))
    return changes
