"""A report never contradicts itself (orchestrator/report/check.py): the checker finds each kind of
contradiction in a doctored report, and finds none in rehearsed studies of five shapes judged by the code
that judges real runs (orchestrator/report/consistency.py; bench/report_check.py runs 2,000 of each)."""

from __future__ import annotations

import copy
import json
import sys

import numpy as np
import pytest

from orchestrator.analysis.result import HypothesisRow, from_json, to_json
from orchestrator.analysis.study import verdict_groups
from orchestrator.report.check import disagreements
from orchestrator.report.consistency import SHAPES, check_shape
from tests import warm


@pytest.fixture(scope="module")
def dsv4_report() -> dict:
    _, one = SHAPES["dsv4 (4 starts)"]()
    rng = np.random.default_rng(3)
    for _ in range(50):  # a study whose three fixes are implicated and whose minimal cause is found
        result = one(rng)
        implicated = [r for r in result.hypotheses if r.verdict == "implicated"]
        if len(implicated) == 3 and result.minimal_cause.verdict == "minimal cause found":
            return to_json(result)  # the checker reads report.json's content
    raise AssertionError("no rehearsed dsv4 study with every fix implicated")


def _arm(report: dict, label: str) -> dict:
    return next(s for s in report["arm_states"] if s["label"] == label)


def test_a_consistent_report_has_no_disagreement(dsv4_report):
    assert disagreements(dsv4_report) == []
    assert (
        dsv4_report["policy"]["confidence"] == 0.95 and "Every section reads" in dsv4_report["policy"]["text"]
    )


def test_each_kind_of_contradiction_is_found(dsv4_report):
    def doctored(change) -> list[str]:
        report = copy.deepcopy(dsv4_report)
        change(report)
        return disagreements(report)

    def minimal_cause_says_undetermined(r):
        r["minimal_cause"]["arms"][1]["state"] = "undetermined"

    def hypothesis_implicated_of_an_undetermined_arm(r):
        row = next(h for h in r["hypotheses"] if h["verdict"] == "implicated")
        state = next(s for s in r["arm_states"] if s["signature"] == row["treatment_arm"])
        state["state"], state["bounds"] = "undetermined", [0.0, 0.05]
        row["treatment_state"] = "undetermined"
        for a in r["arms"] + r["minimal_cause"]["arms"]:
            if a["signature"] == row["treatment_arm"]:
                a["state"], a["bounds"] = "undetermined", [0.0, 0.05]

    def tie_at_another_confidence(r):
        clean = [s for s in r["arm_states"] if s["state"] == "clean"]
        clean[0]["confidence"] = 0.9875
        for a in r["arms"]:
            a["run_counts"] = (
                [[0, 60]] * 4 if a["signature"] in {c["signature"] for c in clean} else a["run_counts"]
            )

    def clean_above_the_ceiling(r):
        _arm(r, "capture=eager")["bounds"] = [0.0, 0.031]

    def headline_drops_one(r):
        r["headline"] = r["headline"].replace("H-capture (capture=eager), ", "")

    def arms_table_differs(r):
        next(a for a in r["arms"] if a["label"] == "baseline")["state"] = "clean"

    cases = {
        "minimal cause says": minimal_cause_says_undetermined,
        "implicated (corruption gone), but": hypothesis_implicated_of_an_undetermined_arm,
        "have the same runs but different": tie_at_another_confidence,
        "clean, but its upper bound": clean_above_the_ceiling,
        "H-capture is implicated in the hypotheses but not named": headline_drops_one,
        "arms table says baseline is clean": arms_table_differs,
    }
    for expected, change in cases.items():
        found = doctored(change)
        assert any(expected in line for line in found), (expected, found)


def test_a_headline_that_implicates_nothing_names_every_other_verdict_as_the_hypotheses_do(dsv4_report):
    report = copy.deepcopy(dsv4_report)
    verdicts = {"H-capture": "exonerated", "H-index_k": "inconclusive", "H-multi_stream": "partial"}
    for row in report["hypotheses"]:
        row["verdict"] = verdicts.get(row["id"], "exonerated")
    listed = "No hypothesis implicated (baseline corruption 9/240 (3.8%))" + verdict_groups(
        [from_json(HypothesisRow, row) for row in report["hypotheses"]]
    )
    report["headline"] = listed + "."
    assert (
        "; partial: H-multi_stream; exonerated: H-capture, H-hicache; inconclusive: H-index_k (their"
        in listed
    ), listed
    assert [p for p in disagreements(report) if p.startswith("headline")] == []
    # the wording before: "see the inconclusive rows" where one was exonerated and none inconclusive
    report["headline"] = (
        "No hypothesis implicated (baseline 9/240); see the inconclusive rows for the sessions needed."
    )
    found = [p for p in disagreements(report) if p.startswith("headline")]
    assert "headline: names none exonerated; the hypotheses say ['H-capture', 'H-hicache']" in found, found


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rehearsed_studies_of_every_shape_never_contradict_themselves(shape):
    result = check_shape(shape, 150, seed=11)
    assert result["contradicting"] == 0, result["examples"]


def test_the_cli_checks_report_files(tmp_path, dsv4_report):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(dsv4_report))
    broken = copy.deepcopy(dsv4_report)
    broken["minimal_cause"]["arms"][0]["state"] = "clean"
    bad.write_text(json.dumps(broken))
    ok = warm.run(
        [sys.executable, "-m", "orchestrator.report", "--check", str(good)], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "consistent" in ok.stdout
    no = warm.run(
        [sys.executable, "-m", "orchestrator.report", "--check", str(good), str(bad)],
        capture_output=True,
        text=True,
    )
    assert no.returncode == 1 and "minimal cause says" in no.stdout and "2 disagreement(s)" in no.stdout
