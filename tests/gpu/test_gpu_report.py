"""The GPU section of the study report, on small literal inputs (pure parts), and its CLI end to end."""

from __future__ import annotations

import json

from orchestrator.gpu.report import (
    attribute,
    main,
    parse_label,
    probe_summary,
    render_section,
    seed_in_log,
    start_rows,
    variation,
)

LOG = "[2026-12-01 10:00:00 DP0 TP0] GPU decode engine on NVIDIA H200 (torch 2.11.0): keys bf16, seed 42\n"


def counters(seed, bad_b1, steps_b1=10):
    b1 = {"steps": steps_b1, "mismatched_steps": bad_b1, "rows": steps_b1, "mismatched_rows": bad_b1}
    return {
        "seed": seed,
        "corrupted_turns": bad_b1,
        "planned_turns": 20,
        "buckets": {"eager": {"steps": 5, "mismatched_steps": 0}, "1": b1},
    }


REPORT = {
    "arms": [
        {
            "label": "baseline",
            "signature": "aaaaaaaaaaaa",
            "runs": [
                {"repetition": 0, "corrupted": 6, "clean": 54},
                {"repetition": 1, "corrupted": 18, "clean": 42},
            ],
        },
        {
            "label": "multi_stream=off",
            "signature": "bbbbbbbbbbbb",
            "runs": [{"repetition": 0, "corrupted": 0, "clean": 60}],
        },
    ]
}


def test_a_start_is_found_by_the_seed_its_decode_log_names():
    assert seed_in_log(LOG) == 42
    assert seed_in_log("no engine here") is None
    found = attribute([counters(42, 3), counters(7, 0)], {"gpu_race-aaaaaaaaaaaa-r0": LOG, "x": "nothing"})
    assert list(found) == ["gpu_race-aaaaaaaaaaaa-r0"] and found["gpu_race-aaaaaaaaaaaa-r0"]["seed"] == 42
    assert parse_label("gpu_race-aaaaaaaaaaaa-r1") == ("aaaaaaaaaaaa", 1)
    assert parse_label("gpu_race-notahash-r1") is None


def test_rows_join_sessions_and_counters_and_the_table_lists_buckets_in_order():
    rows = start_rows(REPORT, {"gpu_race-aaaaaaaaaaaa-r0": counters(42, 3)})
    assert [(r["arm"], r["repetition"], r["corrupted"], r["n"]) for r in rows] == [
        ("baseline", 0, 6, 60),
        ("baseline", 1, 18, 60),
        ("multi_stream=off", 0, 0, 60),
    ]
    assert rows[1]["counters"] is None
    text = render_section(rows, variation(rows), [], "NVIDIA H200, 580.159.04", {"GPU minutes used": "9"})
    assert "| arm | start | sessions | GPU turns | B1 | eager |" in text
    assert "| baseline | r0 | 6/60 | 3/20 | 3/10 | 0/5 |" in text
    assert "(no counters)" in text
    assert "- **GPU minutes used**: 9" in text


def test_start_to_start_variation_uses_the_studys_estimator():
    rows = start_rows(REPORT, {})
    var = variation(rows)
    # 6/60 vs 18/60 is far more spread than binomial: phi > 1, a positive ICC
    assert var["estimated"] and var["df"] == 1 and var["phi"] > 3 and var["icc"] > 0.03
    assert var["per_arm"]["baseline"] == [[6, 60], [18, 60]]
    same = variation(
        start_rows({"arms": [{**REPORT["arms"][0], "runs": [REPORT["arms"][0]["runs"][0]] * 2}]}, {})
    )
    assert same["icc"] == 0.0


def test_probe_cells_are_summed_over_starts():
    cell = {
        "mode": "graph",
        "bf16_keys": True,
        "multi_stream": True,
        "record_stream": False,
        "workspace_bytes": 2048,
    }
    probe = {"cells": [{**cell, "buckets": {"1": {"steps": 4, "bad_steps": 4, "bad_rows": 4}}}] * 2}
    (summary,) = probe_summary(probe)
    assert summary["starts"] == 2 and summary["buckets"]["1"] == {"steps": 8, "bad_steps": 8, "bad_rows": 8}


def test_the_cli_appends_its_section_to_the_studys_report(tmp_path):
    res = tmp_path / "results"
    for d in ("study", "logs", "counters"):
        (res / d).mkdir(parents=True)
    (res / "study" / "report.json").write_text(json.dumps({**REPORT, "study": {"name": "gpu_race"}}))
    (res / "study" / "report.md").write_text("# gpu_race: verdicts\n")
    (res / "logs" / "gpu_race-aaaaaaaaaaaa-r0.decode.log").write_text(LOG)
    (res / "counters" / "decode-1.json").write_text(json.dumps(counters(42, 3)))
    (res / "device.txt").write_text("snapshot: 0123abc\nNVIDIA H200, 580.159.04, 143771 MiB\n")
    (res / "timing.txt").write_text("study_s=212 total_s=238\n")
    out = tmp_path / "out"
    assert (
        main([str(res), "--out", str(out), "--gpu-minutes", "12", "--note", "Did not fit=more starts"]) == 0
    )
    text = (out / "report.md").read_text()
    assert text.startswith("# gpu_race: verdicts\n") and "## GPU decode" in text
    assert "- **Did not fit**: more starts" in text
    # the device run's snapshot and timing; the machine is the report's own section (from the runs' tags,
    # so a report rebuilt from MLflow keeps it), never appended here
    assert "snapshot: 0123abc\nstudy_s=212 total_s=238\n" in text
    assert "NVIDIA H200" not in text and "Provenance" not in text
    assert (out / "buckets.png").stat().st_size > 0
    buckets = json.loads((out / "gpu_buckets.json").read_text())
    assert buckets["starts"][0]["counters"]["seed"] == 42
    assert buckets["device"].startswith("snapshot: 0123abc\nNVIDIA H200, 580.159.04")
