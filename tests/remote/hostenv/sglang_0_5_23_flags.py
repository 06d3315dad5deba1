"""A few `sglang.launch_server` flags exactly as sglang 0.5.23 spells them, for flag-validation tests.

The real parser (`sglang.srt.server_args:ServerArgs.add_cli_args`) imports CUDA torch, which cannot be
installed here; this subset reproduces what matters: argparse with abbreviations allowed (sglang's
default), and `--cuda-graph-max-bs-decode` / `--cuda-graph-max-bs-prefill`, which make the 0.5.9 flag
`--cuda-graph-max-bs` ambiguous. Names read from the 0.5.23 wheel (arg_groups/fields/exec_.py).
"""

import argparse


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    parser.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    parser.add_argument("--disaggregation-enable-kv-checksum", action="store_true")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--disable-decode-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-max-bs-decode", type=int)
    parser.add_argument("--cuda-graph-max-bs-prefill", type=int)
    parser.add_argument("--enable-hierarchical-cache", "--enable-hicache", action="store_true")
    parser.add_argument("--disable-overlap-schedule", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e5m2", "fp8_e4m3", "bf16"], default="auto")
    parser.add_argument("--tool-call-parser", default=None)
