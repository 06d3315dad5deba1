"""The report's Machine section: what each server role ran on (GPU, driver, torch, CUDA, engine, python),
read from every run's `provenance.<role>.*` tags (arm.host_checks), into report.json's `machines` and the
Markdown, so a report rebuilt from MLflow alone (or from report.json) keeps it; runs on different
machines or engines are said; a study whose runs recorded no machine (the embedded default) has none."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from orchestrator.analysis.result import ABSENT, StudyResult, from_json
from orchestrator.analysis.runs import machine_of
from orchestrator.analysis.study import analyse
from orchestrator.report import check, rebuild
from orchestrator.report.pipeline import StudyCallback, build_report
from orchestrator.report.render import render_markdown
from orchestrator.run.preflight import HostProvenance
from orchestrator.tracking.write import ArmTracker
from tests.conftest import job_and_plan
from tests.test_report import _stress

ROW = "1 x NVIDIA H200 | 580.159.04 | 2.11.0+cu130 | 13.0 | sglang 0.5.17 | 3.12.3"
H200 = {
    "torch_version": "2.11.0+cu130",
    "cuda_version": "13.0",
    "gpu": "1 x NVIDIA H200",
    "driver_version": "580.159.04",
}
H100 = {**H200, "gpu": "1 x NVIDIA H100 80GB HBM3", "driver_version": "570.86.15"}
HEAD = "| role | host | GPU | driver | torch | CUDA | engine | python | runs |"


def _provenance(hostname: str, sglang: str | None, **machine: str | None) -> dict:
    """What arm.host_checks logs for a role (None values are logged as "None")."""
    info = HostProvenance(
        host="127.0.0.1",
        hostname=hostname,
        python_version="3.12.3",
        sglang_version=sglang,
        gpu_memory_used_mib=(0,),
        **machine,
    )
    return dataclasses.asdict(info)


def _study(compose_cfg, tmp_path: Path, machines: list[dict[str, dict] | None]) -> tuple[object, Path]:
    """A quick study written through the tracker as arms log it: the baseline's two runs and
    multi_stream=off's two runs, each run's roles with `machines[i]` (role -> provenance; None: the run
    failed before its host checks, recording none). Returns the config and the report's folder."""
    overrides = (f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.sweep.dir={tmp_path}/sweep")
    cfg = compose_cfg(*overrides)
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    arms = [((), 9, 51, 0), ((), 8, 52, 1), (("factor/multi_stream=off",), 0, 60, 0)]
    arms += [(("factor/multi_stream=off",), 0, 60, 1)]
    for (extra, corrupted, clean, rep), roles in zip(arms, machines, strict=True):
        job, plan = job_and_plan(compose_cfg(*overrides, *extra))
        with ArmTracker.start(job.tracking, job.study, plan, rep, callback.run_id) as tracker:
            if roles is None:
                tracker.fail("prefill: preflight refused the arm", "")
                continue
            for role, info in roles.items():
                tracker.log_provenance(role, info)
                tracker.log_provenance(role, {"gpu_memory_used_after_teardown_mib": [0]})
            out = tmp_path / f"arm{len(extra)}{rep}"
            tracker.log_stress(_stress(out, corrupted, clean), out)
    callback.on_multirun_end(cfg)
    return cfg, Path(str(cfg.report.dir)) / str(cfg.study.name)


def _rebuilt(cfg, target: Path) -> tuple[str, str]:
    """report.json and report.md rebuilt from MLflow alone (the report's folder removed first)."""
    shutil.rmtree(target)
    build_report(str(cfg.tracking.uri), str(cfg.study.name), target.parent, plots=False)
    return (target / "report.json").read_text(), (target / "report.md").read_text()


def _machine_table(md: str) -> list[str]:
    section = md.split("## Machine\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")]


def test_the_machine_each_role_ran_on_is_read_from_the_runs_and_kept_by_a_rebuild(compose_cfg, tmp_path):
    same = {
        "prefill": _provenance("gpu-node-1", "0.5.17", **H200),
        "decode": _provenance("gpu-node-1", "0.5.17", **H200),
    }
    cfg, target = _study(compose_cfg, tmp_path, [same] * 4)
    written, md = (target / "report.json").read_text(), (target / "report.md").read_text()
    report = json.loads(written)
    assert check.schema_problems(report) == [] and check.disagreements(report) == []
    assert report["machines"]["differs"] == {} and report["machines"]["unrecorded"] == 0
    assert [(r["role"], r["gpu"], r["driver"], len(r["runs"])) for r in report["machines"]["rows"]] == [
        ("prefill", "1 x NVIDIA H200", "580.159.04", 4),
        ("decode", "1 x NVIDIA H200", "580.159.04", 4),
    ]
    assert "Every run of a role ran on the same machine and engine." in md
    assert _machine_table(md) == [
        HEAD,
        f"| prefill | gpu-node-1 | {ROW} | all 4 |",
        f"| decode | gpu-node-1 | {ROW} | all 4 |",
    ]
    # before the commands that reproduce it, after the rest of the report
    assert md.index("## Machine") < md.index("## Reproduce")

    # rebuilt from MLflow alone: the same bytes, the section included
    assert _rebuilt(cfg, target) == (written, md)
    # from report.json: the same Markdown, and judged again, the same block
    result = from_json(StudyResult, report)
    assert render_markdown(result, str(cfg.tracking.uri)) == md
    again = analyse(result.study, rebuild.records_from_report(report), result.context)
    assert again.machines == result.machines


def test_runs_on_different_gpus_and_drivers_are_two_rows_and_said(compose_cfg, tmp_path):
    one = {
        "prefill": _provenance("gpu-node-1", "0.5.17", **H200),
        "decode": _provenance("gpu-node-1", "0.5.17", **H200),
    }
    other = {**one, "decode": _provenance("gpu-node-2", "0.5.17", **H100)}
    # multi_stream=off #0 ran its decode elsewhere; multi_stream=off #1 failed before its host checks
    cfg, target = _study(compose_cfg, tmp_path, [one, one, other, None])
    md = (target / "report.md").read_text()
    report = json.loads((target / "report.json").read_text())
    assert check.schema_problems(report) == []
    machines = report["machines"]
    assert machines["differs"] == {"decode": ["hostname", "gpu", "driver"]} and machines["unrecorded"] == 1
    off = next(a for a in report["arms"] if a["label"] == "multi_stream=off")
    moved = next(r["run_id"] for r in off["runs"] if r["repetition"] == 0)
    decode = [r for r in machines["rows"] if r["role"] == "decode"]
    assert [(r["hostname"], r["gpu"], r["driver"]) for r in decode] == [
        ("gpu-node-1", "1 x NVIDIA H200", "580.159.04"),
        ("gpu-node-2", "1 x NVIDIA H100 80GB HBM3", "570.86.15"),
    ]
    assert decode[1]["runs"] == [moved] and len(decode[0]["runs"]) == 2
    assert (
        "**The runs did not all run on the same machine and engine** (decode: host, GPU, driver differ "
        "between runs): a difference between arms may be the machine's or the engine's, not the factor's. "
        "1 run(s) recorded no machine (stopped before their host checks)." in md
    )
    assert _machine_table(md) == [
        HEAD,
        f"| prefill | gpu-node-1 | {ROW} | all 3 |",
        f"| decode | gpu-node-1 | {ROW} | 2: baseline #0, baseline #1 |",
        "| decode | gpu-node-2 | 1 x NVIDIA H100 80GB HBM3 | 570.86.15 | 2.11.0+cu130 | 13.0 | sglang 0.5.17 "
        "| 3.12.3 | 1: multi_stream=off #0 |",
    ]
    written = (target / "report.json").read_text()
    assert _rebuilt(cfg, target) == (written, md)


def test_a_study_whose_runs_recorded_no_machine_has_no_machine_section(compose_cfg, tmp_path):
    # what the embedded default records: a hostname and python, no GPU, torch or engine version
    sim = {"prefill": _provenance("laptop", None), "decode": _provenance("laptop", None)}
    cfg, target = _study(compose_cfg, tmp_path, [sim] * 4)
    report = json.loads((target / "report.json").read_text())
    assert "machines" not in report and from_json(StudyResult, report).machines is ABSENT
    md = (target / "report.md").read_text()
    assert "## Machine" not in md
    assert _rebuilt(cfg, target)[1] == md


def test_a_runs_machine_is_its_provenance_tags_without_the_unknown_ones():
    tags = {
        "provenance.decode.gpu": "1 x NVIDIA H200",
        "provenance.decode.torch_version": "None",
        "provenance.decode.gpu_memory_used_mib": "(0,)",
        "provenance.prefill.hostname": "n1",
        "provenance.prefill.args_checked": "--x",
        "signature": "abc",
    }
    assert machine_of(tags) == {"decode": {"gpu": "1 x NVIDIA H200"}, "prefill": {"hostname": "n1"}}
    assert machine_of({}) == {}
