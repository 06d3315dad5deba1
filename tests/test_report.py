"""The report: markdown rendered from small literal inputs, and the whole path through a real MLflow store
(callback -> arms -> report at on_multirun_end -> the same report.json rebuilt by the CLI from MLflow)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.analysis.result import StudyResult, from_json
from orchestrator.report.pipeline import StudyCallback
from orchestrator.report.render import dumps, launch_command, render_markdown
from orchestrator.tracking.write import ArmTracker
from orchestrator.workload.results import BenchResult, LevelResult, Percentiles, SessionOutcome, StressSummary
from tests import warm
from tests.conftest import job_and_plan, seed_mlflow_store


def _tracker(cfg, repetition: int, parent: str | None) -> ArmTracker:
    job, plan = job_and_plan(cfg)
    return ArmTracker.start(job.tracking, job.study, plan, repetition, parent)


LITERAL = {
    "schema": 2,
    "study": {
        "name": "tiny",
        "description": "Corruption under load.",
        "baseline": {"ms": "on"},
        "alpha": 0.05,
        "test": "fisher",
        "min_effect": 0.05,
        "ceiling": 0.03,
        "throughput_floor": 0.95,
        "hypotheses": [
            {"id": "H-ms", "factor": "ms", "statement": "needs ms", "baseline": "on", "treatment": "off"}
        ],
        "min_effect_relative": False,
        "assumed_icc": 0.0,
        "stopping": {
            "min_runs_per_arm": 2,
            "max_runs_per_arm": 6,
            "max_sessions": None,
            "futility": True,
            "max_run_sessions": None,
            "icc_confidence": 0.8,
        },
        "cost": {"restart_s": None, "session_s": None, "bench_s": None, "gpus": None},
        "ddmin": {"differences": []},
    },
    "context": {"parent_run_id": "p1", "overrides": ["+experiment=tiny", "workload.sessions=60"]},
    "headline": "Implicated: H-ms (ms=off); baseline corruption 27/180 (15.0%).",
    "confidence": 0.95,
    "between_runs": {
        "method": "beta-binomial, one ICC per study",
        "estimated": False,
        "dispersion": None,
        "df": 0,
        "icc": 0.0,
        "mean_run_size": 180.0,
        "note": "assumed ICC 0",
    },
    "policy": {
        "name": "per-arm",
        "design": None,
        "alpha": 0.05,
        "confidence": 0.95,
        "ceiling": 0.03,
        "icc": 0.0,
        "text": "each arm judged at 95%",
    },
    "arm_states": [],
    "arms": [
        {
            "label": "baseline",
            "signature": "aaa",
            "deployment_signature": "aaa",
            "conditions": {},
            "factors": {"ms": "on"},
            "run_counts": [[27, 180]],
            "mean_run_size": 180.0,
            "design_effect": 1.0,
            "effective_n": 180,
            "effective_corrupted": 27,
            "missing_usage": 0,
            "families": {},
            "decode_load": None,
            "state": "corrupting",
            "n": 180,
            "corrupted": 27,
            "clean": 153,
            "errored": 1,
            "rate": 0.15,
            "ci": [0.101, 0.211],
            "upper_bound": 0.211,
            "partial": False,
            "client_bound": False,
            "facts": {"capture_batches": 400.0, "eager_batches": 40.0},
            "runs": [
                {
                    "run_id": "r1",
                    "repetition": 0,
                    "status": "FINISHED",
                    "outcomes": "complete",
                    "corrupted": 27,
                    "clean": 153,
                    "errored": 1,
                    "planned": 181,
                    "used": True,
                    "reason": "",
                }
            ],
            "config": {},
            "throughput": [
                {
                    "concurrency": 8,
                    "runs": 1,
                    "tok_s": 280.0,
                    "ttft_p50_s": 0.1,
                    "ttft_p99_s": 0.3,
                    "itl_p50_s": 0.01,
                    "itl_p99_s": 0.02,
                    "errors": 0,
                }
            ],
        },
        {
            "label": "ms=off",
            "signature": "bbb",
            "deployment_signature": "bbb",
            "conditions": {},
            "factors": {"ms": "off"},
            "run_counts": [[0, 180]],
            "mean_run_size": 180.0,
            "design_effect": 1.0,
            "effective_n": 180,
            "effective_corrupted": 0,
            "missing_usage": 0,
            "families": {},
            "decode_load": None,
            "state": "clean",
            "n": 180,
            "corrupted": 0,
            "clean": 180,
            "errored": 0,
            "rate": 0.0,
            "ci": [0.0, 0.0203],
            "upper_bound": 0.0203,
            "partial": True,
            "client_bound": False,
            "facts": {},
            "runs": [
                {
                    "run_id": "r2",
                    "repetition": 0,
                    "status": "KILLED",
                    "outcomes": "partial",
                    "corrupted": 0,
                    "clean": 20,
                    "errored": 0,
                    "planned": 60,
                    "used": True,
                    "reason": "interrupted (KeyboardInterrupt)",
                }
            ],
            "config": {
                "decode": {
                    "env": {"SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "0", "HF_TOKEN": "***"},
                    "flags": "--tp 8",
                    "argv": "python -m sglang.launch_server --tp 8",
                }
            },
            "throughput": [
                {
                    "concurrency": 8,
                    "runs": 1,
                    "tok_s": 279.0,
                    "ttft_p50_s": 0.1,
                    "ttft_p99_s": 0.3,
                    "itl_p50_s": 0.011,
                    "itl_p99_s": 0.021,
                    "errors": 0,
                }
            ],
        },
    ],
    "hypotheses": [
        {
            "id": "H-ms",
            "factor": "ms",
            "statement": "needs ms",
            "baseline_level": "on",
            "treatment_level": "off",
            "baseline_arm": "aaa",
            "treatment_arm": "bbb",
            "treatment_label": "ms=off",
            "baseline_counts": [27, 180],
            "treatment_counts": [0, 180],
            "baseline_runs": [[27, 180]],
            "treatment_runs": [[0, 180]],
            "design_effect": [1.0, 1.0],
            "effective_counts": [[27, 180], [0, 180]],
            "margin": 0.05,
            "treatment_state": "clean",
            "diff": -0.15,
            "diff_ci": [-0.2087, -0.0975],
            "p": 1.2e-9,
            "p_holm": 1.2e-9,
            "test": "fisher",
            "verdict": "implicated",
            "note": "corruption gone",
            "sessions_needed_per_arm": None,
            "more_sessions": None,
        }
    ],
    "throughput": [
        {
            "arm": "bbb",
            "label": "ms=off",
            "client_bound": False,
            "verdict": "no regression",
            "levels": [
                {
                    "concurrency": 8,
                    "ratio": 0.996,
                    "ci": [0.97, 1.02],
                    "method": "requests",
                    "clears_floor": True,
                }
            ],
        }
    ],
    "problem_runs": [
        {
            "arm": "ms=off",
            "signature": "bbb",
            "run_id": "r2",
            "repetition": 0,
            "status": "KILLED",
            "outcomes": "partial",
            "corrupted": 0,
            "clean": 20,
            "errored": 0,
            "planned": 60,
            "used": True,
            "reason": "interrupted (KeyboardInterrupt)",
        }
    ],
    "deploy": {
        "arm": "bbb",
        "label": "ms=off",
        "hypothesis": "H-ms",
        "factors": {"ms": "off"},
        "throughput_verdict": "no regression",
        "config": {
            "decode": {
                "env": {"SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "0", "HF_TOKEN": "***"},
                "flags": "--tp 8",
                "argv": "python -m sglang.launch_server --tp 8",
            }
        },
    },
    "stopping": None,
    "families": {"counted": ["structural"], "same_in_every_arm": True, "by_arm": []},
    "ddmin": None,
    "minimal_cause": None,
    "clusters": None,
}
# the typed result the renderer reads (from_json refuses a key the types do not know, and a missing one)
TYPED = from_json(StudyResult, LITERAL)


def test_render_markdown_on_a_literal_report():
    md = render_markdown(TYPED, "sqlite:///mlruns.db")
    lines = md.splitlines()
    assert lines[0] == "# tiny: Implicated: H-ms (ms=off); baseline corruption 27/180 (15.0%)."
    hyp_row = next(line for line in lines if line.startswith("| H-ms"))
    cells = [c.strip() for c in hyp_row.strip("|").split("|")]
    assert cells[1:5] == ["ms: on → off", "27/180", "0/180", "[-20.9, -9.8] pp"]
    assert cells[5:8] == ["1.20e-09", "1.20e-09", "**implicated**"]
    arm_row = next(line for line in lines if line.startswith("| baseline"))
    assert "27/180" in arm_row and "15.0%" in arm_row and "[10.1%, 21.1%]" in arm_row and "400/40" in arm_row
    assert next(line for line in lines if line.startswith("| ms=off")).rstrip().endswith("| partial |")
    assert "**ms=off** vs baseline: no regression" in md
    tput_row = next(line for line in lines if line.startswith("| 8 |"))
    assert "| 280 | 279 | 0.996 | [0.970, 1.020] |" in tput_row
    failed = md.split("## Failed and partial runs")[1].split("##")[0]
    assert "KILLED" in failed and "interrupted (KeyboardInterrupt)" in failed and "0/20/0 of 60" in failed
    deploy = md.split("## Configuration to deploy")[1].split("## Reproduce")[0]
    assert (
        "env HF_TOKEN='***' SGLANG_OPT_USE_MULTI_STREAM_OVERLAP=0 python -m sglang.launch_server --tp 8"
        in deploy
    )
    repro = md.split("## Reproduce")[1]
    assert "python -m orchestrator -m +experiment=tiny workload.sessions=60" in repro
    assert (
        "python -m orchestrator.report --tracking-uri sqlite:///mlruns.db --study tiny --out reports" in repro
    )
    assert "mlflow ui --backend-store-uri sqlite:///mlruns.db" in repro


def test_render_without_a_fix_or_problems():
    bare = dataclasses.replace(TYPED, deploy=None, problem_runs=(), throughput=())
    md = render_markdown(bare)
    assert "nothing to deploy yet" in md
    assert "None: every run finished." in md
    assert "No throughput comparison" in md


def test_dumps_is_stable_and_refuses_nan():
    shuffled = dict(reversed(list(LITERAL.items())))
    assert dumps(from_json(StudyResult, shuffled)) == dumps(TYPED)
    assert json.loads(dumps(TYPED)) == LITERAL
    with pytest.raises(ValueError):
        dumps(dataclasses.replace(TYPED, confidence=float("nan")))


def test_launch_command_quotes_values():
    assert launch_command({"env": {"A": "x y"}, "argv": "srv --p 1"}) == "env A='x y' srv --p 1"
    assert launch_command({"env": {}, "argv": "srv"}) == "srv"


# --- the whole path through MLflow -----------------------------------------------------------------


def _stress(out: Path, corrupted: int, clean: int, planned: int | None = None) -> StressSummary:
    out.mkdir(parents=True, exist_ok=True)
    rows = [
        SessionOutcome(f"s{i}", "corrupted" if i < corrupted else "clean", 4, 4).to_dict()
        for i in range(corrupted + clean)
    ]
    (out / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    total = corrupted + clean
    return StressSummary(
        sessions=total, clean=clean, corrupted=corrupted, errored=0, planned=planned or total
    )


def _bench(seed: int) -> BenchResult:
    levels = []
    for c in (1, 8, 32):
        latency = [1.0 + ((i * 7 + seed) % 11) / 50 for i in range(2 * c)]
        tokens = [64] * (2 * c)
        p = Percentiles(0.1, 0.1, 0.2, 0.3)
        levels.append(
            LevelResult(
                concurrency=c,
                requests=2 * c,
                errors=0,
                missing_usage=0,
                duration_s=2.0,
                output_tokens=sum(tokens),
                output_tok_s=c * sum(tokens) / sum(latency),
                request_s=c / 1.1,
                ttft_s=p,
                itl_s=p,
                tpot_s=p,
                achieved_concurrency=c,
                client_cpu_s=0.1,
                loop_lag_p99_s=0.001,
                request_tokens=tokens,
                request_latency_s=latency,
            )
        )
    return BenchResult(levels=levels)


def _lease_tags(member: str, start: str, end: str) -> dict[str, str]:
    return {
        "cluster": "local" if member == "pd0" else "local2-pd1",
        "cluster_pool": "local2",
        "cluster_pool.member": member,
        "lease.by": "host leases",
        "lease.holder": "pid 1 on this host",
        "lease.start": f"2026-12-01T{start}.000000+00:00",
        "lease.end": f"2026-12-01T{end}.000000+00:00",
    }


def test_report_at_multirun_end_is_rebuilt_identically_from_mlflow(compose_cfg, tmp_path):
    overrides = (f"tracking.artifact_location={tmp_path}/artifacts", f"hydra.sweep.dir={tmp_path}/sweep")
    cfg = compose_cfg(*overrides)
    callback = StudyCallback()
    callback.on_multirun_start(cfg)
    parent = callback.run_id
    arms = [
        ((), 9, 51, 0, "pd0"),
        ((), 8, 52, 1, "pd1"),
        (("factor/multi_stream=off",), 0, 60, 0, "pd1"),
        (("factor/multi_stream=off",), 0, 60, 1, "pd0"),
    ]
    for extra, corrupted, clean, rep, member in arms:
        with _tracker(compose_cfg(*overrides, *extra), rep, parent) as tracker:
            # where it ran, as a pool's arm tags it (the clusters block is rebuilt from these tags too)
            tracker.log_tags(_lease_tags(member, f"0{rep}:0{len(extra)}:00", f"0{rep}:0{len(extra)}:59"))
            out = tmp_path / f"arm{len(extra)}{rep}"
            tracker.log_stress(_stress(out, corrupted, clean), out)
            tracker.log_bench(_bench(rep), None)
    job = compose_cfg(*overrides, "factor/multi_stream=off")
    with pytest.raises(KeyboardInterrupt), _tracker(job, 2, parent) as tracker:
        tracker.log_tags({"cluster": "local"})
        tracker.log_stress(_stress(tmp_path / "killed", 0, 20, planned=60), tmp_path / "killed")
        raise KeyboardInterrupt
    with _tracker(compose_cfg(*overrides, "factor/capture=eager"), 0, parent) as tracker:
        tracker.log_tags(_lease_tags("pd1", "03:00:00", "03:00:30") | {"lease.lost": "holder gone"})
        tracker.fail("decode did not become healthy within 60 s", "Traceback ...")

    callback.on_multirun_end(cfg)

    reports = Path(str(cfg.report.dir))
    target = reports / str(cfg.study.name)
    written = (target / "report.json").read_text()
    report = json.loads(written)
    (h,) = report["hypotheses"]
    assert (h["id"], h["verdict"], h["baseline_counts"], h["treatment_counts"]) == (
        "H-multistream",
        "implicated",
        [17, 120],
        [0, 120],  # the killed run's 20 sessions are listed, never pooled (issue 13)
    )
    arms_by = {a["label"]: a for a in report["arms"]}
    assert arms_by["multi_stream=off"]["partial"] is True
    assert arms_by["capture=eager"]["n"] == 0
    assert report["deploy"]["label"] == "multi_stream=off"
    # the minimal cause is part of report.json, so the rebuild below compares it too
    cause = report["minimal_cause"]
    assert (cause["verdict"], [c["levels"] for c in cause["conjunctions"]]) == (
        "minimal cause found",
        [{"multi_stream": "on"}],
    )
    assert report["context"]["parent_run_id"] == parent
    where = report["clusters"]
    assert where["clusters"] == ["local", "local2-pd1"] and where["pools"] == ["local2"]
    assert [(r["arm"], r["reason"]) for r in where["lost"]] == [("capture=eager", "holder gone")]
    assert [le["runs"] for le in where["leases"]] == [2, 3]
    md = (target / "report.md").read_text()
    assert "## Clusters" in md and "This study's arms ran on 2 clusters (local, local2-pd1)" in md
    assert "decode did not become healthy within 60 s" in md and "FAILED" in md
    assert "## Minimal cause" in md
    assert (target / "corruption.png").stat().st_size > 1000 and (
        target / "throughput.png"
    ).stat().st_size > 1000

    client = MlflowClient(tracking_uri=str(cfg.tracking.uri))
    assert client.get_run(parent).info.status == "FINISHED"
    attached = {a.path for a in client.list_artifacts(parent, "report")}
    assert {"report/report.md", "report/report.json", "report/corruption.png"} <= attached

    shutil.rmtree(reports)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator.report",
            "--tracking-uri",
            str(cfg.tracking.uri),
            "--study",
            str(cfg.study.name),
            "--out",
            str(reports),
            "--no-plots",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Implicated: H-multistream" in proc.stdout
    assert (target / "report.json").read_text() == written


def test_report_cli_names_a_missing_study(tmp_path):
    proc = warm.run(
        [
            sys.executable,
            "-m",
            "orchestrator.report",
            "--tracking-uri",
            f"sqlite:///{tmp_path}/empty.db",
            "--study",
            "nope",
            "--out",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no MLflow experiment named 'nope'" in proc.stderr


HYDRA_APP = """
import hydra
from orchestrator.config.load import CONF_DIR, load_job
from orchestrator.config.plan import plan_arm
from orchestrator.workload.results import StressSummary
from orchestrator.tracking.write import ArmTracker, parent_run_id


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg):
    # a stand-in for the arm: no servers, the outcome the fault model would give
    job = load_job(cfg)
    plan = plan_arm(job)
    bad = 9 if plan.factors["multi_stream"] == "on" else 0
    parent = parent_run_id(job.parent_run_id, job.sweep_dir)
    with ArmTracker.start(job.tracking, job.study, plan, job.repetition, parent) as tracker:
        summary = StressSummary(sessions=60, clean=60 - bad, corrupted=bad, errored=0, planned=60)
        tracker.log_stress(summary, None)
    return tracker.run_id


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_real_hydra_multirun_hands_the_parent_to_every_job(tmp_path):
    """The shipped config's callback and sweeper around a stand-in job: one parent, children under it,
    the report at the end."""
    app = tmp_path / "app.py"
    app.write_text(HYDRA_APP)
    db = seed_mlflow_store(tmp_path / "mlflow.db")
    proc = subprocess.run(
        [
            sys.executable,
            str(app),
            f"tracking.uri={db}",
            f"tracking.artifact_location={tmp_path}/artifacts",
            f"report.dir={tmp_path}/reports",
            f"hydra.sweep.dir={tmp_path}/sweep",
            "bench.enabled=false",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=db)
    exp = client.get_experiment_by_name("quick")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("heisenhunt.kind") == "study"]
    children = [r for r in runs if r.data.tags.get("heisenhunt.kind") == "arm"]
    assert len(children) == 6  # ofat on multi_stream x repetition 0,1,2
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parent.info.run_id}
    assert parent.info.status == "FINISHED"
    assert (tmp_path / "sweep" / ".heisenhunt" / "parent_run_id").read_text().strip() == parent.info.run_id
    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    assert report["hypotheses"][0]["verdict"] == "implicated"
    assert report["hypotheses"][0]["baseline_counts"] == [27, 180]
