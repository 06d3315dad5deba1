"""`python -m orchestrator.report`: rebuild a study's report from the MLflow store alone, or check
report.json files for sections that contradict each other (`--check FILE...`, report/check.py)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from orchestrator.report.pipeline import build_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.report", description="Rebuild a study's report from MLflow alone."
    )
    parser.add_argument("--tracking-uri", default="sqlite:///mlruns.db", help="MLflow tracking URI")
    parser.add_argument("--study", help="the study name (= the MLflow experiment)")
    parser.add_argument(
        "--check",
        nargs="+",
        metavar="REPORT_JSON",
        help="check these report.json files: every section must agree on each arm's state (exit 1 if not)",
    )
    parser.add_argument("--out", default="reports", help="reports directory; the report goes to OUT/STUDY/")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--pool-sweeps",
        action="store_true",
        help="count the arm runs of every sweep of the study (default: the latest sweep, and the runs it "
        "resumed); the report says what it pooled",
    )
    parser.add_argument(
        "--from-report",
        type=Path,
        metavar="REPORT_JSON",
        help="judge this report.json's runs again with today's analysis (no MLflow store needed), into OUT",
    )
    parser.add_argument(
        "--schema",
        action="store_true",
        help="print report.json's JSON Schema, generated from its types (report/report.schema.json is this)",
    )
    args = parser.parse_args(argv)
    if args.schema:
        from orchestrator.analysis.result import report_schema

        print(json.dumps(report_schema(), indent=1))
        return 0
    if args.from_report:
        from orchestrator.report.rebuild import rebuild

        result, paths = rebuild(args.from_report, Path(args.out), plots=not args.no_plots)
        print(result.headline)
        return 0
    if args.check:
        from orchestrator.report.check import main as check

        return check(args.check)
    if not args.study:
        parser.error("--study is required (or --check FILE..., --from-report FILE, or --schema)")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result, paths = build_report(
            args.tracking_uri,
            args.study,
            Path(args.out),
            plots=not args.no_plots,
            pool_sweeps=args.pool_sweeps,
        )
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.headline)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    from orchestrator.run.fast_exit import run_then_exit_fast

    run_then_exit_fast(lambda: sys.exit(main()))
