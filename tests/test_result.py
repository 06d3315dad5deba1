"""The typed study result (analysis/result.py): report.json <-> dataclasses, exactly, and strictly."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from orchestrator.analysis.result import (
    ABSENT,
    Cost,
    CostFigures,
    ResultError,
    StudyResult,
    from_json,
    report_schema,
    to_json,
)
from orchestrator.report import rebuild
from orchestrator.report.consistency import SHAPES
from orchestrator.report.render import dumps, render_markdown

ROOT = Path(__file__).parent.parent
REPORTS = ("docs/examples/*/report.json", "reports/*/report.json")  # where the repository keeps reports


def committed_reports() -> list[Path]:
    """The reports the repository keeps: not one a run wrote here since (the README's first command
    writes reports/quick, which git ignores), so the tests read the same files on every checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "--", *(f":(glob){pattern}" for pattern in REPORTS)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if listed.returncode == 0:
        return sorted(ROOT / line for line in listed.stdout.split())
    # not a git checkout (an unpacked sdist): what is there
    return sorted(path for pattern in REPORTS for path in ROOT.glob(pattern))


COMMITTED = committed_reports()
# sections other tools append to a committed report.md (report/rebuild.py keeps the first; the second is
# orchestrator/gpu/device_run.py's)
APPENDED = (*rebuild.APPENDED, "## On the lent GPU machine")


def test_the_committed_reports_are_found():
    names = {p.parent.name for p in COMMITTED}
    assert {"dsv4_corruption", "dsv4_sequential", "gpu_race", "real_sglang"} <= names


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_a_committed_report_round_trips_to_the_same_bytes(path: Path):
    text = path.read_text()
    result = from_json(StudyResult, json.loads(text))
    assert to_json(result) == json.loads(text)
    assert dumps(result) == text


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.parent.name)
def test_a_committed_report_renders_from_its_typed_form_as_committed(path: Path):
    text = path.with_name("report.md").read_text()
    committed = text[: min((text.index("\n" + h) for h in APPENDED if h in text), default=len(text))]
    # the tracking URI is the one thing report.md quotes that report.json does not keep
    uri = committed.split("--tracking-uri ")[1].split(" --study")[0].strip("'")
    result = from_json(StudyResult, json.loads(path.read_text()))
    assert render_markdown(result, None if uri == "<tracking uri>" else uri) == committed


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_rehearsed_report_of_every_shape_round_trips(shape: str):
    _, one = SHAPES[shape]()
    result = one(np.random.default_rng(5))
    assert isinstance(result, StudyResult)
    data = json.loads(dumps(result))
    assert to_json(from_json(StudyResult, data)) == data
    assert from_json(StudyResult, data) == result
    # and the report rebuilt from report.json reads as the one written (its maps' keys come back sorted)
    uri = "sqlite:///m.db"
    assert render_markdown(from_json(StudyResult, data), uri) == render_markdown(result, uri)
    # the blocks only some designs write are typed when present
    assert (result.stopping is not None) == (shape == "sequential dsv4")
    assert (result.ddmin is not None) == shape.startswith("ddmin")


def _dsv4() -> dict:
    return json.loads((ROOT / "docs/examples/dsv4_corruption/report.json").read_text())


def test_an_unknown_key_is_refused_naming_its_path():
    data = _dsv4()
    data["arms"][2]["foo"] = 1
    with pytest.raises(ResultError, match=r"^arms\[2\]\.foo: unknown key"):
        from_json(StudyResult, data)
    data = _dsv4()
    data["minimal_cause"]["conjunctions"][0]["necessary"]["capture"]["bar"] = 0
    path = r"^minimal_cause\.conjunctions\[0\]\.necessary\.capture\.bar: unknown key"
    with pytest.raises(ResultError, match=path):
        from_json(StudyResult, data)
    data = _dsv4()
    data["extra"] = {}
    with pytest.raises(ResultError, match=r"^extra: unknown key"):
        from_json(StudyResult, data)


def test_a_missing_key_or_a_value_of_another_type_is_refused():
    data = _dsv4()
    del data["hypotheses"][1]["p_holm"]
    with pytest.raises(ResultError, match=r"^hypotheses\[1\]\.p_holm: missing key"):
        from_json(StudyResult, data)
    data = _dsv4()
    data["arms"][0]["n"] = "180"
    with pytest.raises(ResultError, match=r"^arms\[0\]\.n: expected int"):
        from_json(StudyResult, data)
    data = _dsv4()
    data["arms"][0]["partial"] = 0
    with pytest.raises(ResultError, match=r"^arms\[0\]\.partial: expected bool"):
        from_json(StudyResult, data)


def test_a_key_only_some_designs_write_stays_absent_and_null_stays_null():
    fixed = from_json(StudyResult, _dsv4())
    assert all(h.evidence is ABSENT for h in fixed.hypotheses)
    assert all("evidence" not in h for h in to_json(fixed)["hypotheses"])
    sequential = json.loads((ROOT / "docs/examples/dsv4_sequential/report.json").read_text())
    assert all(h.evidence is not ABSENT for h in from_json(StudyResult, sequential).hypotheses)
    row = dataclasses.replace(fixed.hypotheses[0], evidence=None)
    assert to_json(row)["evidence"] is None


def test_free_form_maps_keep_their_keys_and_a_python_keyword_field_keeps_its_json_key():
    result = from_json(StudyResult, _dsv4())
    arm = result.arms[0]
    assert dict(arm.factors) == {"capture": "graph", "hicache": "on", "index_k": "bf16", "multi_stream": "on"}
    necessary = next(iter(result.minimal_cause.conjunctions[0].necessary.values()))
    assert necessary.with_ is not None and "with" in to_json(necessary) and "with_" not in to_json(necessary)


def test_a_cost_model_of_mixed_sources_reads_the_same_rebuilt_from_report_json():
    """The embedded default's usual model: three figures measured, the GPUs the deployment's. report.json
    keeps its keys sorted, so the sources come back in another order; the report rebuilt from it must
    still say them in the model's (found on the README's first run: its report.md and the one rendered
    from its report.json differed in that one sentence)."""
    _, one = SHAPES["dsv4 (4 starts)"]()
    measured = "measured: median of 4 run(s)"
    sources = {"restart_s": measured, "session_s": measured, "bench_s": measured, "gpus": "deployment.cost"}
    cost = Cost(
        model=CostFigures(restart_s=3.4, session_s=0.06, bench_s=9.0, gpus=8, sources=sources),
        gpu_hours=0.5, wall_s=225.0, starts=20, sessions=1200, modelled_runs=0, model_gpu_hours=0.5,
        per_arm={}, fixed_design_gpu_hours=None, remaining_gpu_hours=None,
    )  # fmt: skip
    result = dataclasses.replace(one(np.random.default_rng(5)), cost=cost)
    rebuilt = from_json(StudyResult, json.loads(dumps(result)))
    assert list(rebuilt.cost.model.sources) != list(sources)  # the keys did come back sorted
    written = render_markdown(result, "sqlite:///m.db")
    assert "restart_s from measured" in written
    assert render_markdown(rebuilt, "sqlite:///m.db") == written


def test_the_committed_json_schema_is_the_one_the_types_give():
    """report.schema.json is generated from the dataclasses (`result.report_schema`), never written by hand:
    regenerate it with `python -m orchestrator.report --schema > orchestrator/report/report.schema.json`."""
    committed = json.loads((ROOT / "orchestrator/report/report.schema.json").read_text())
    assert committed == report_schema()


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_schema_refuses_what_from_json_refuses(shape: str):
    import jsonschema

    _, one = SHAPES[shape]()
    data = json.loads(dumps(one(np.random.default_rng(5))))
    validator = jsonschema.Draft202012Validator(report_schema())
    assert list(validator.iter_errors(data)) == []
    for change in (
        lambda d: d["arms"][0].update(foo=1),  # an unknown key
        lambda d: d["arms"][0].pop("n"),  # a missing one
        lambda d: d["arms"][0].update(state="maybe"),  # a state that is none of the three
    ):
        bad = json.loads(json.dumps(data))
        change(bad)
        assert list(validator.iter_errors(bad)), change
        with pytest.raises(ResultError):
            from_json(StudyResult, bad)
