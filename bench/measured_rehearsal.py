"""How many starts a study's verdicts needed, rehearsed from what its own runs measured.

A study run once gives one verdict; whether it was a lucky one, and whether fewer starts would have
done, is a question for the rehearsal (orchestrator/study/rehearse.py) fed with the study's own
figures instead of a fault model's: each arm's pooled rate as its true rate, the between-start ICC the
study estimated (or a given one), the study's own spec (alpha, ceiling, hypotheses) and its run size.
The same analysis that judged the real runs judges every rehearsed study.

    python bench/measured_rehearsal.py reports/real_determinism/report.json [--starts 1,2,3,4]
        [--studies 2000] [--icc RHO] [--rate ARM=RATE ...] [--json OUT]

Prints, per number of starts per arm, how often each hypothesis gets each verdict and how often any is
wrong against the measured rates (a rate measured 0/n is taken as 0: the rehearsal then asks what the
study could tell if that arm were truly clean).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from orchestrator.analysis import StudySpec, arm_label
from orchestrator.study.rehearse import ArmTruth, rehearse


def truths(
    report: dict[str, Any], icc: float | None, rates: dict[str, float] | None = None
) -> list[ArmTruth]:
    """Each arm of the report as the rehearsal's truth: its pooled rate (or the one `rates` gives it: a
    what-if) and the study's ICC (pure)."""
    rho = icc if icc is not None else float(report["between_runs"]["icc"])
    rates = rates or {}
    return [
        ArmTruth(
            a["label"],
            dict(a["factors"]),
            rates.get(a["label"], a["corrupted"] / a["n"] if a["n"] else 0.0),
            rho,
        )
        for a in report["arms"]
    ]


def measured_only(spec: StudySpec, arms: list[ArmTruth]) -> StudySpec:
    """The spec without the hypotheses whose changed arm the study never ran (nothing to rehearse them
    from) (pure)."""
    labels = {a.label for a in arms}
    kept = [
        h
        for h in spec.hypotheses
        if arm_label({**spec.baseline, h.factor: h.treatment}, spec.baseline) in labels
    ]
    return dataclasses.replace(spec, hypotheses=kept)


def run_size(report: dict[str, Any]) -> int:
    """The sessions of one start, as the study ran them (the largest run of its arms)."""
    return max(int(a["mean_run_size"]) for a in report["arms"] if a["n"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--starts", default="1,2,3,4", help="starts per arm to rehearse, comma-separated")
    parser.add_argument("--studies", type=int, default=2000)
    parser.add_argument("--icc", type=float, default=None, help="between-start ICC (default: the study's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rate", action="append", default=[], metavar="ARM=RATE", help="what if ARM's rate were RATE"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = json.loads(args.report.read_text())
    spec = StudySpec.from_dict(report["study"])
    rates = {label: float(rate) for label, _, rate in (r.rpartition("=") for r in args.rate)}
    arms, sessions = truths(report, args.icc, rates), run_size(report)
    spec = measured_only(spec, arms)
    print(f"{spec.name}: rehearsed from its own runs, {sessions} sessions a start, ICC {arms[0].icc:.3f}")
    print("  " + ", ".join(f"{a.label} {a.rate:.1%}" for a in arms))
    out = {}
    for starts in [int(s) for s in args.starts.split(",")]:
        result = rehearse(spec, arms, starts, sessions, args.studies, args.seed)
        out[starts] = result
        verdicts = "; ".join(
            f"{h['id']} " + ", ".join(f"{v} {share:.0%}" for v, share in h["verdicts"].items() if share)
            for h in result["hypotheses"]
        )
        print(f"{starts} start(s) per arm: all right {result['all_right']:.1%}, {verdicts}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
