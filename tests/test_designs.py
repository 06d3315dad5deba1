"""The one registry of designs (orchestrator/study/designs.py): which design a sweep runs, and the rounds each
gives. The sweeper and the rehearsal drive the same objects; the last test holds the rehearsal to the jobs
the real sweeper lists for the same command."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from orchestrator.analysis import RunRecord
from orchestrator.config.schema import StoppingConf
from orchestrator.study import designs, rehearse
from orchestrator.study.designs import DesignError, choose
from tests.test_dry_run import _dry_run
from tests.test_rehearse import SEED_STORY, SPEC
from tests.test_sequential import truths

DEFAULTS = {
    "default_design": "ofat",
    "default_params": {"factor/multi_stream": "on,off", "repetition": "0,1,2"},
}


def test_a_sweep_of_nothing_runs_the_default_sweep_and_anything_swept_runs_the_studys_design():
    assert choose({"design": "factorial", **DEFAULTS}, cli_sweeps=False, adhoc=False) == (
        "ofat",
        {"factor/multi_stream": "on,off", "repetition": "0,1,2"},
    )
    assert choose({"design": "factorial", **DEFAULTS}, cli_sweeps=True, adhoc=False) == ("factorial", {})
    swept = {"design": "sequential", "params": {"factor/capture": "graph,eager"}, **DEFAULTS}
    assert choose(swept, cli_sweeps=False, adhoc=False) == ("sequential", {"factor/capture": "graph,eager"})
    # a ddmin study sweeps its differences, not params: never the default sweep
    assert choose({"design": "ddmin", **DEFAULTS}, cli_sweeps=False, adhoc=False)[0] == "ddmin"


@pytest.mark.parametrize("key", ["design", "default_design"])
def test_an_unknown_design_is_refused_naming_the_key_and_the_designs(key):
    with pytest.raises(
        DesignError, match=rf"hydra\.sweeper\.{key}='bisect' is not one of \['factorial', 'ofat'"
    ):
        choose({"design": "factorial", **DEFAULTS, key: "bisect"}, cli_sweeps=False, adhoc=False)


def test_a_fixed_design_launches_its_jobs_batch_by_batch_then_stops():
    choices = {"factor/multi_stream": ["factor/multi_stream=on", "factor/multi_stream=off"]}
    choices["repetition"] = [f"repetition={r}" for r in range(3)]
    fixed = designs.build("factorial", SPEC, choices, extra=["+x=1"], batch_size=4)
    rounds, launched = [], -1
    while (nxt := fixed.next_round([], launched)).jobs:
        rounds.append(nxt.jobs)
        launched = nxt.index
    assert [len(r) for r in rounds] == [4, 2]
    jobs = [j for r in rounds for j in r]
    assert jobs == fixed.jobs()
    assert {(j.label, j.repetition) for j in jobs} == {
        (a, r) for a in ("baseline", "multi_stream=off") for r in range(3)
    }
    assert all(j.overrides[-1] == "+x=1" for j in jobs)


def _draw(job: designs.Job, corrupted: int) -> RunRecord:
    return RunRecord(
        run_id=f"{job.label}-{job.repetition}",
        status="FINISHED",
        signature=job.label,
        repetition=job.repetition,
        factors=dict(job.levels),
        outcomes="complete",
        clean=60 - corrupted,
        corrupted=corrupted,
        planned=60,
    )


def test_a_sequential_round_carries_its_repetition_and_the_throughput_sweep_only_where_chosen():
    spec = replace(SPEC, stopping=StoppingConf(max_runs_per_arm=4))
    design = rehearse.sequential_design(spec, truths(spec, SEED_STORY, 0.0), sessions=60)
    first = design.next_round([], -1)
    assert first.index == 0 and len(first.jobs) == 5
    assert all("repetition=0" in j.overrides and "bench.repetitions=null" in j.overrides for j in first.jobs)
    assert all("bench.enabled=false" in j.overrides for j in first.jobs)  # the design was built without it
    # the baseline corrupts and the fixes do not: the next round starts only what is still open
    runs = [_draw(j, 10 if j.label in ("baseline", "index_k=fp8", "hicache=off") else 0) for j in first.jobs]
    second = design.next_round(runs, first.index)
    assert second.index == 1 and all(j.repetition == 1 for j in second.jobs)
    assert second.notes and "round 0 evidence" in second.notes[0]


def test_a_sequential_design_over_a_sweep_missing_an_arm_is_refused_naming_it():
    spec = replace(SPEC, stopping=StoppingConf(max_runs_per_arm=4))
    arms = [a for a in truths(spec, SEED_STORY, 0.0) if a.label != "capture=eager"]
    design = rehearse.sequential_design(spec, arms, sessions=60)
    with pytest.raises(
        DesignError, match=r"needs the arms \['capture=eager'\], which the sweep does not cover"
    ):
        design.next_round([], -1)


def test_one_loop_runs_every_design_in_the_rehearsal():
    """`rehearsed_study` knows no design: the fixed design gives every arm its runs, the sequential one
    stops early where the evidence is plain."""
    spec = replace(SPEC, stopping=StoppingConf(max_runs_per_arm=4))
    arms = truths(spec, {**SEED_STORY, "baseline": 0.5}, 0.0)
    fixed = rehearse.rehearsed_study(
        rehearse.fixed_design(arms, 4), rehearse.by_label(arms), 60, np.random.default_rng(1)
    )
    seq = rehearse.sequential_study(spec, arms, 60, np.random.default_rng(1))
    assert len(fixed) == 5 * 4
    assert len(seq) < len(fixed)


def test_the_rehearsal_rehearses_the_arms_and_starts_the_sweeper_lists_for_the_same_command(tmp_path):
    out = _dry_run(tmp_path, "+experiment=dsv4_corruption")
    listed = {line.split()[1]: line for line in out.splitlines() if line.startswith("arm ")}
    result = rehearse.from_config(["+experiment=dsv4_corruption", "rehearse.studies=2"])
    assert {a["label"] for a in result["design"]["arms"]} == set(listed)
    runs = result["design"]["runs_per_arm"]
    assert all(f"{runs} job(s)" in line for line in listed.values()), (runs, listed)
