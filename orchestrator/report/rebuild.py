"""A report.json judged again by today's analysis, where its MLflow store is not at hand (a report
committed from a GPU machine, whose store stayed there): the runs it lists are turned back into the run
records the analysis reads, and `analysis.analyse` writes the report anew.

    python -m orchestrator.report --from-report OLD/report.json --out DIR

What a report.json keeps of a run is its counts, status and reason, and the machine it ran on; of an
arm, its config, facts and the throughput per level of its benched run. So the rebuild is exact for
everything the verdicts read (the counts per run, the pooling, the arm states, the hypotheses, the minimal
cause, a divergence study's positions, reference pass and example) and for the machines, and approximate
for the throughput's per-request spread (each level's medians stand for its requests). A section
appended to the old report.md by another tool (the GPU section of orchestrator/gpu/report.py:
`## GPU decode`) is kept.

Pure but for `rebuild`, which reads and writes files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from orchestrator.analysis import LevelSample, RunRecord, StudySpec
from orchestrator.analysis.machines import FIELDS
from orchestrator.analysis.result import StudyResult
from orchestrator.config.plan import arm_conditions
from orchestrator.study.designs import analyse_study

# sections other tools append to report.md, kept as they were
APPENDED = ("## GPU decode",)


def _bench(arm: Mapping[str, Any]) -> tuple[LevelSample, ...]:
    return tuple(
        LevelSample(
            concurrency=int(level["concurrency"]),
            tok_s=float(level["tok_s"]),
            ttft_p50_s=float(level.get("ttft_p50_s") or float("nan")),
            ttft_p99_s=float(level.get("ttft_p99_s") or float("nan")),
            itl_p50_s=float(level.get("itl_p50_s") or float("nan")),
            itl_p99_s=float(level.get("itl_p99_s") or float("nan")),
            errors=int(level.get("errors") or 0),
        )
        for level in arm.get("throughput") or []
    )


def _artifact(example: Mapping[str, Any]) -> dict[str, Any]:
    """A diverged session's artifact as an example keeps it: each output's excerpt at its place in a text
    of its length (blanks around it), so the example is made again as it was (analysis/divergence.py)."""

    def output(side: Mapping[str, Any]) -> dict[str, Any]:
        head = " " * example["start"] + side["excerpt"]
        return {
            "text": head + " " * max(0, side["chars"] - len(head)),
            "finish_reason": side["finish_reason"],
            "completion_tokens": side["completion_tokens"],
        }

    return {
        "session_id": example["session_id"],
        "round_index": example["turn"],
        "finding": {"detector": example["detector"]},
        "difference": {
            "position": example["position"],
            "basis": example["basis"],
            "reference": example["reference_token"],
            "under_load": example["under_load_token"],
        },
        "reference": output(example["reference"]),
        "under_load": output(example["under_load"]),
    }


def _divergence(arm: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """run id -> what its RunRecord carries of the arm's divergence block: each run's reference pass, the
    arm's positions (pooled, on the run of its example, or its first pooled run) and its example."""
    block = arm.get("divergence")
    if not block:
        return {}
    out: dict[str, dict[str, Any]] = {}
    referenced = [r for r in arm["runs"] if r.get("reference_s") is not None]
    for i, run in enumerate(referenced):
        totals = (
            {"sessions": block["reference_sessions"], "errored": block["reference_errored"]} if not i else {}
        )
        out[run["run_id"]] = {"reference": {"duration_s": run["reference_s"], **totals}}
    example = block.get("example")
    used = [r["run_id"] for r in arm["runs"] if r.get("used")]
    holder = example["run_id"] if example else (used[0] if used else None)
    if holder is not None and block["positions"]:
        out.setdefault(holder, {})["divergence"] = {
            "positions": list(block["positions"]),
            "turns": list(block["turns"]),
            "basis": dict(block["basis"]),
        }
        if example:
            out[holder]["divergence_example"] = _artifact(example)
    return out


def _machines(report: Mapping[str, Any]) -> dict[str, dict[str, dict[str, str]]]:
    """run id -> its RunRecord.machine, from the report's `machines` block (absent: {})."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for row in (report.get("machines") or {}).get("rows", []):
        found = {key: row[field] for key, field in FIELDS.items() if row[field] is not None}
        for run_id in row["runs"]:
            out.setdefault(run_id, {})[row["role"]] = found
    return out


def records_from_report(report: Mapping[str, Any]) -> list[RunRecord]:
    """The runs a report.json lists, as the analysis reads runs (module doc for what is approximate)."""
    records = []
    machines = _machines(report)
    for arm in report["arms"]:
        finished = [r for r in arm["runs"] if r["status"] == "FINISHED"]
        benched = finished[0]["run_id"] if finished and arm.get("throughput") else None
        first_used = next((r["run_id"] for r in arm["runs"] if r.get("used")), None)
        divergence = _divergence(arm)
        for run in arm["runs"]:
            records.append(
                RunRecord(
                    run_id=run["run_id"],
                    status=run["status"],
                    signature=arm.get("deployment_signature") or arm["signature"],
                    repetition=int(run["repetition"]),
                    factors=dict(arm["factors"]),
                    outcomes=run["outcomes"],
                    clean=int(run["clean"]),
                    corrupted=int(run["corrupted"]),
                    errored=int(run["errored"]),
                    planned=int(run.get("planned") or 0),
                    reason=run.get("reason") or "",
                    client_bound=bool(arm.get("client_bound")) and run["run_id"] == benched,
                    bench=_bench(arm) if run["run_id"] == benched else (),
                    config=dict(arm.get("config") or {}),
                    facts=dict(arm.get("facts") or {}) if run["run_id"] == first_used else {},
                    conditions=arm_conditions(arm.get("conditions") or {}),
                    wall_s=run.get("wall_s"),
                    stress_s=run.get("stress_s"),
                    machine=machines.get(run["run_id"], {}),
                    **divergence.get(run["run_id"], {}),
                )
            )
    return records


def rebuild(old: Path, out_dir: Path, plots: bool = True) -> tuple[StudyResult, list[Path]]:
    """Write `out_dir`/<study>/report.md and report.json from `old` judged by today's analysis; the typed
    result and the paths, report.md first."""
    from orchestrator.report.render import write_report

    report = json.loads(old.read_text())
    old_md = old.with_name("report.md")
    text = old_md.read_text() if old_md.exists() else ""  # read first: the rebuild may overwrite it
    kept = min((text.index(h) for h in APPENDED if h in text), default=None)
    spec = StudySpec.from_dict(report["study"])
    context = dict(report.get("context") or {})
    conditions = arm_conditions(context.get("conditions") or {}) or None
    fresh = analyse_study(spec, records_from_report(report), context, conditions)
    paths = write_report(fresh, out_dir, plots)
    if kept is not None:
        with paths[0].open("a") as fh:
            fh.write("\n" + text[kept:])
    return fresh, paths
