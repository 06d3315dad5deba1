"""The real sglang-router (its Rust `Router`), started the way `python -m sglang_router.launch_router` starts
it, without importing the Python mini load balancer that the launcher imports at its top.

    python -m orchestrator.sim.router --pd-disaggregation --prefill URL BOOTSTRAP --decode URL ...

`sglang_router.launch_router` imports `sglang_router.mini_lb` (FastAPI, aiohttp) on every start, for
`--mini-lb` alone: about 0.6 s of CPU of a ~0.8 s start, paid at every co-restart of the embedded
default (hundreds in a study, its test suite and its benches). This module takes the same argv through
the router's own parser (`RouterArgs.add_cli_args`, `RouterArgs.from_cli_args`), validates it as the
launcher does and starts the same `Router`. `--mini-lb` (debugging only, pure Python) is refused here:
use the launcher for it. Real clusters keep `sglang_router.launch_router` (conf/deployment/sglang_dsv4.yaml).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import setproctitle
from sglang_router.router import Router
from sglang_router.router_args import RouterArgs


def parse_router_args(argv: Sequence[str]) -> RouterArgs:
    """The launcher's parse: the router's own CLI arguments, without the `--router-` prefix."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator.sim.router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return RouterArgs.from_cli_args(parser.parse_args(list(argv)), use_router_prefix=False)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_router_args(sys.argv[1:] if argv is None else argv)
    if args.mini_lb:
        raise SystemExit("--mini-lb is the Python debugging balancer: use sglang_router.launch_router for it")
    setproctitle.setproctitle("sglang::router")  # as the launcher names the process
    args._validate_router_args()
    Router.from_args(args).start()


if __name__ == "__main__":
    main()
