"""Rehearsed studies of each shape, judged by `analysis.analyse` (the code that judges real runs) and
checked by `report.check.disagreements`: a report must never contradict itself, whatever the draws.

Shapes (`SHAPES`): the dsv4 study (5 arms x 4 starts x 60, the built-in model's rates, restart ICC 0.02);
the GPU race (6 arms x 2 starts x 60, the H200's rates and restart ICC 0, 4% ceiling); a 2x2 factorial
(the conjunction capture=graph AND multi_stream=on); the dsv4 study run sequentially (rounds through
`sequential.next_round`, 5% of runs killed part-way); a ddmin search over 8 differences with a 2-culprit
conjunction. Each study also tallies whether the hypotheses implicate every true fix and whether the
minimal cause is found.

Each report is also validated against report.json's JSON Schema (report/report.schema.json).

Pure but for the random draws (seeded): `check_shape(name, studies, seed)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from orchestrator.analysis import ddmin
from orchestrator.analysis.result import StudyResult, to_json
from orchestrator.config.plan import arm_label
from orchestrator.config.schema import Hypothesis, StoppingConf, StudyConf
from orchestrator.report.check import disagreements, schema_problems
from orchestrator.study import rehearse
from orchestrator.study.designs import analyse_study
from orchestrator.study.rehearse import ArmTruth

DSV4_BASELINE = {"capture": "graph", "index_k": "bf16", "multi_stream": "on", "hicache": "on"}
DSV4_FIXES = {"capture": "eager", "index_k": "fp8", "multi_stream": "off", "hicache": "off"}


def _spec(name: str, baseline: dict[str, str], fixes: dict[str, str], ceiling: float, **extra) -> StudyConf:
    hyps = [Hypothesis(f"H-{f}", f, f"needs {f}={baseline[f]}", baseline[f], t) for f, t in fixes.items()]
    return StudyConf(name=name, baseline=dict(baseline), hypotheses=hyps, ceiling=ceiling, **extra)


def _truths(spec: StudyConf, rates: dict[str, float], icc: float) -> list[ArmTruth]:
    return [
        ArmTruth(label, levels, rates[label], icc if rates[label] > 0 else 0.0)
        for label, levels in rehearse.study_arms(spec)
    ]


def _fixed(spec: StudyConf, arms: list[ArmTruth], runs: int, sessions: int) -> Callable[[Any], StudyResult]:
    def one(rng: np.random.Generator) -> StudyResult:
        counts = rehearse.draw_counts(arms, runs, sessions, 1, rng)[0]
        return analyse_study(spec, rehearse.study_runs(arms, counts, sessions), context={"design": "ofat"})

    return one


def dsv4() -> tuple[StudyConf, Callable]:
    spec = _spec("dsv4_corruption", DSV4_BASELINE, DSV4_FIXES, 0.03)
    rates = {"baseline": 0.15, "hicache=off": 0.05, "capture=eager": 0.0, "index_k=fp8": 0.0}
    rates["multi_stream=off"] = 0.0
    return spec, _fixed(spec, _truths(spec, rates, 0.02), 4, 60)


def gpu_race() -> tuple[StudyConf, Callable]:
    baseline = {**DSV4_BASELINE, "indexer_fix": "none"}
    spec = _spec("gpu_race", baseline, {**DSV4_FIXES, "indexer_fix": "record_stream"}, 0.04)
    # the H200's counts (reports/gpu_race): 41/120, 40/120 with HiCache off, 3/120 with fp8 index keys
    rates = {"baseline": 0.342, "hicache=off": 0.333, "index_k=fp8": 0.025, "capture=eager": 0.0}
    rates |= {"multi_stream=off": 0.0, "indexer_fix=record_stream": 0.0}
    # the H200's runs showed no more spread between starts than chance (estimated ICC 0.000)
    return spec, _fixed(spec, _truths(spec, rates, 0.0), 2, 60)


def factorial() -> tuple[StudyConf, Callable]:
    spec = _spec(
        "sweep-capture-multi_stream",
        DSV4_BASELINE,
        {"capture": "eager", "multi_stream": "off"},
        0.03,
    )
    cells = [({}, 0.09), ({"capture": "eager"}, 0.0), ({"multi_stream": "off"}, 0.0)]
    cells += [({"capture": "eager", "multi_stream": "off"}, 0.0)]
    arms = [
        ArmTruth(
            arm_label({**DSV4_BASELINE, **c}, DSV4_BASELINE), {**DSV4_BASELINE, **c}, r, 0.02 if r else 0.0
        )
        for c, r in cells
    ]

    def one(rng: np.random.Generator) -> StudyResult:
        counts = rehearse.draw_counts(arms, 1, 200, 1, rng)[0]
        return analyse_study(spec, rehearse.study_runs(arms, counts, 200), context={"design": "factorial"})

    return spec, one


def sequential_dsv4() -> tuple[StudyConf, Callable]:
    spec, _ = dsv4()
    spec = dataclasses.replace(spec, name="dsv4_sequential", stopping=StoppingConf(max_runs_per_arm=6))
    rates = {"baseline": 0.15, "hicache=off": 0.05, "capture=eager": 0.0, "index_k=fp8": 0.0}
    arms = _truths(spec, rates | {"multi_stream=off": 0.0}, 0.02)

    def one(rng: np.random.Generator) -> StudyResult:
        runs = rehearse.sequential_study(spec, arms, 60, rng, kill_rate=0.05)
        return analyse_study(spec, runs, context={"design": "sequential"})

    return spec, one


def ddmin_search() -> tuple[StudyConf, Callable]:
    ids = [f"d{i}" for i in range(8)]
    spec = StudyConf.from_dict(
        {
            "name": "ddmin",
            "ceiling": 0.05,
            "stopping": {"min_runs_per_arm": 2, "max_runs_per_arm": 10},
            "ddmin": {"differences": [{"id": d, "roles": {"decode": {"env": {f"X_{d}": "1"}}}} for d in ids]},
        }
    )

    def truth_of(subset: frozenset[str]) -> ArmTruth:
        rate = 0.155 if {"d2", "d5"} <= subset else 0.0
        return ArmTruth(ddmin.describe_subset(subset, ids), ddmin.levels_of(subset, ids), rate, 0.005)

    def one(rng: np.random.Generator) -> StudyResult:
        runs = rehearse.ddmin_study(spec, truth_of, 60, rng)
        return analyse_study(spec, runs, context={"design": "ddmin"})

    return spec, one


# per shape, the factors whose treatment level has no corruption in its truth
ZERO_FIXES = {
    "dsv4 (4 starts)": ("capture", "index_k", "multi_stream"),
    "gpu_race (2 starts x 60)": ("capture", "multi_stream", "indexer_fix"),
    "2x2 factorial": ("capture", "multi_stream"),
    "sequential dsv4": ("capture", "index_k", "multi_stream"),
}

SHAPES: dict[str, Callable[[], tuple[StudyConf, Callable]]] = {
    "dsv4 (4 starts)": dsv4,
    "gpu_race (2 starts x 60)": gpu_race,
    "2x2 factorial": factorial,
    "sequential dsv4": sequential_dsv4,
    "ddmin (8 differences, 2 culprits)": ddmin_search,
}


def check_shape(name: str, studies: int, seed: int = 0) -> dict[str, Any]:
    """Rehearse `studies` studies of one shape; every report checked. Returns the tallies and the first
    few disagreements found (none is the contract)."""
    spec, one = SHAPES[name]()
    rng = np.random.default_rng(seed)
    found: list[str] = []
    contradicting = implicated_all = cause_found = 0
    # the true fixes: the hypotheses whose treatment arm has no corruption in the shape's truth
    fixes = {h.id for h in spec.hypotheses if h.factor in ZERO_FIXES.get(name, ())}
    for _ in range(studies):
        result = one(rng)
        report = to_json(result)  # the checker reads report.json as written
        problems = schema_problems(report) + disagreements(report)
        contradicting += bool(problems)
        found += problems[: max(0, 5 - len(found))]
        implicated = {r.id for r in result.hypotheses if r.verdict == "implicated"}
        implicated_all += bool(fixes) and fixes <= implicated
        cause_found += bool(result.minimal_cause) and result.minimal_cause.verdict == "minimal cause found"
    return {
        "shape": name,
        "studies": studies,
        "contradicting": contradicting,
        "examples": found,
        "all_fixes_implicated": implicated_all / studies if fixes else None,
        "minimal_cause_found": cause_found / studies,
    }
