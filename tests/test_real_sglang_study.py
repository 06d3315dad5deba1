"""The real_sglang study (experiments/real_sglang.yaml, conf/deployment/sglang_tiny_pd.yaml) and the real
server's lines: sglang 0.5.17's decode log and /metrics as it wrote them on the H200, read by the same
parsers the arms use, and the study log read by orchestrator.gpu.device_run."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import pytest

from orchestrator.gpu.device_run import batches_by_start, render_section, starts_from_study_log
from orchestrator.run.observe import parse_decode_log
from orchestrator.sim import engine as engine_module
from orchestrator.sim.args import parse_args
from orchestrator.sim.engine import DecodeEngine, SimCounters
from orchestrator.sim.envs import effective_env
from orchestrator.sim.faults import RoleConfig, load_fault_model
from orchestrator.workload.decode_load import parse_load
from tests.conftest import plan_of

LINES = Path(__file__).parent / "real_sglang_lines"

# real 0.5.17 decode log lines from the H200 (reports/real_sglang/logs.tgz; the non-PD one: the probe)
DECODE_LOG = (LINES / "decode.log").read_text()


def test_the_study_composes_as_the_device_runs_it(compose_cfg):
    python = "++cluster.hosts.prefill.python=/tmp/real-sglang/python"
    graph = plan_of(compose_cfg("+experiment=real_sglang", python, "factor/capture=graph"))
    eager = plan_of(compose_cfg("+experiment=real_sglang", python, "factor/capture=eager"))
    assert graph.deployment == "sglang_tiny_pd" and graph.sglang_version == "==0.5.17"
    assert graph.sequential_start and graph.workload.count == ["structural"]
    assert graph.workload.tool_choice == "plan"
    assert "--disable-decode-cuda-graph" in eager.roles["decode"].argv
    assert "--disable-decode-cuda-graph" not in graph.roles["decode"].argv
    assert graph.roles["prefill"].argv[:3] == ["/tmp/real-sglang/python", "-m", "sglang.launch_server"]
    for plan in (graph, eager):
        for role in ("prefill", "decode"):
            argv = plan.roles[role].argv
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp"
            assert "--enable-metrics" in argv and argv[argv.index("--load-format") + 1] == "dummy"
        assert plan.roles["router"].argv[2] == "sglang_router.launch_router"
    assert graph.signature != eager.signature


def test_the_real_decode_log_gives_captured_and_eager_batches():
    facts = parse_decode_log(DECODE_LOG)
    assert facts.ready and facts.graph_capture_seen
    assert (facts.capture_batches, facts.eager_batches) == (2, 1)
    # the prefill graph's capture is not the decode's
    prefill = DECODE_LOG.replace("target decode", "target prefill")
    assert not parse_decode_log(prefill).graph_capture_seen


# /metrics as a 0.5.17 decode writes it: gauge names and labels read off its metrics_collector.py (written
# here from the source, not captured: the study reads the gauges live and keeps only the load)
METRICS = (LINES / "metrics.txt").read_text()


def test_the_real_metrics_give_the_decode_load():
    assert parse_load(METRICS) == 8.0


STUDY_LOG = (LINES / "study.log").read_text()


def test_the_study_log_gives_each_start_and_the_section_shows_it():
    starts = starts_from_study_log(STUDY_LOG)
    assert [(s["label"], s["repetition"]) for s in starts] == [("baseline", 0), ("capture=eager", 1)]
    assert starts[0]["healthy_s"] == {"prefill": 20.0, "decode": 21.1, "router": 18.2}
    assert starts[1]["failed"].startswith("decode: not healthy") and starts[1]["healthy_s"] == {}
    batches = batches_by_start({"real_sglang-e1ac15514731-r0-0123456789ab.decode.log": DECODE_LOG})
    assert batches[("e1ac15514731", 0)]["capture_batches"] == 2
    section = render_section(starts, batches, "study 300 s", "none", snapshot="f72a77b")
    assert "Ran from snapshot f72a77b." in section
    assert "| baseline | 0 | 20.0 | 21.1 | 18.2 | yes | 2 | 1 |  |" in section
    assert "| capture=eager | 1 | - | - | - | - | - | - | decode: not healthy within 300s |" in section
    # a start whose decode never served shows no batches, even where a later start of its arm has a log
    again = render_section(starts, {("0061e5b6502e", 1): batches[("e1ac15514731", 0)]}, "", "")
    assert "| capture=eager | 1 | - | - | - | - | - | - |" in again


def test_the_device_run_appends_no_machine_to_the_report(tmp_path):
    """The machine (GPU, driver, torch, engine) is each run's own, in its tags, and the report's Machine
    section shows it from them, so a re-render keeps it: the device run's section says only what the
    device run alone knows, and keeps device.txt in device_run.json."""
    import json

    from orchestrator.gpu.device_run import main

    res = tmp_path / "results"
    (res / "study").mkdir(parents=True)
    (res / "logs").mkdir()
    (res / "study" / "report.md").write_text("# real_sglang: verdicts\n")
    (res / "device.txt").write_text(
        "snapshot: f72a77b636bf\nNVIDIA H200, 580.159.04, 143771 MiB\npython 3.12.3 torch 2.11.0+cu130\n"
    )
    (res / "study.log").write_text(STUDY_LOG)
    (res / "steps.txt").write_text("study 330 s (status 0)\n")
    (res / "leftovers.txt").write_text("sglang processes: none\n")
    (res / "logs" / "real_sglang-e1ac15514731-r0-0123456789ab.decode.log").write_text(DECODE_LOG)
    assert main([str(res), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "report.md").read_text()
    assert text.startswith("# real_sglang: verdicts\n")
    assert "## On the lent GPU machine" in text and "Ran from snapshot f72a77b636bf." in text
    assert "| baseline | 0 | 20.0 | 21.1 | 18.2 | yes | 2 | 1 |  |" in text
    assert "study 330 s (status 0)" in text and "sglang processes: none" in text
    assert "H200" not in text and "580.159.04" not in text and "2.11.0" not in text
    record = json.loads((tmp_path / "out" / "device_run.json").read_text())
    assert record["device"][1] == "NVIDIA H200, 580.159.04, 143771 MiB"


def _fields(line: str) -> list[str]:
    return re.findall(r"(#?[a-z][a-z ()/-]*?): ", line.split("Decode batch, ", 1)[1])


def test_the_sims_pd_decode_line_has_the_real_ones_fields_in_their_order(caplog):
    """The sim writes its decode-batch line as real 0.5.17 does in PD (KV-transfer queues included), so a
    parser written against the sim reads the real server too."""
    real = next(line for line in DECODE_LOG.splitlines() if "#transfer-req" in line)
    config = RoleConfig("decode", effective_env({})[0], vars(parse_args(["--model-path", "m"])))
    engine = DecodeEngine(load_fault_model(), config, 0.0, SimCounters(), random.Random(1))
    with caplog.at_level(logging.INFO, logger=engine_module.log.name):
        engine._log_batch(3, captured=True)
    sim = next(r.getMessage() for r in caplog.records if "Decode batch" in r.getMessage())
    assert _fields(sim) == _fields(real), (sim, real)
    assert parse_decode_log(sim).capture_batches == 1


# the lent-GPU studies that keep their MLflow store beside the report: study -> its sweeps pooled
STORED = {"real_sglang": False, "real_determinism": True}


@pytest.mark.parametrize(("study", "pool_sweeps"), sorted(STORED.items()))
def test_the_committed_report_is_what_its_own_mlflow_store_gives(tmp_path, monkeypatch, study, pool_sweeps):
    """reports/real_sglang (the H200) and reports/real_determinism (an H100, three device calls' stores
    merged) keep the run's MLflow store beside the report; rebuilt here, the way its report.md says, it
    gives the committed report.json to the byte."""
    import json
    import shutil
    import tarfile

    from orchestrator.report.pipeline import build_report

    committed = Path(__file__).parent.parent / "reports" / study
    store = tmp_path / "reports" / study
    store.mkdir(parents=True)
    shutil.copy(committed / "mlruns.db", store)
    with tarfile.open(committed / "mlruns-artifacts.tgz") as tar:
        tar.extractall(store, filter="data")
    monkeypatch.chdir(tmp_path)
    build_report(f"sqlite:///reports/{study}/mlruns.db", study, tmp_path / "out", False, pool_sweeps)
    rebuilt = json.loads((tmp_path / "out" / study / "report.json").read_text())
    assert rebuilt == json.loads((committed / "report.json").read_text())


def test_a_device_stores_artifact_paths_are_made_relative_to_the_checkout(tmp_path):
    import sqlite3

    from orchestrator.gpu.device_run import relocate_artifacts

    db = tmp_path / "mlruns.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE runs (artifact_uri TEXT)")
        con.execute("CREATE TABLE experiments (artifact_location TEXT)")
        con.execute("INSERT INTO runs VALUES ('/tmp/rs/tree/mlruns/abc/artifacts'), (NULL)")
        con.execute("INSERT INTO experiments VALUES ('/tmp/rs/tree/mlruns/0')")
    assert relocate_artifacts(db, "reports/x/mlruns") == 2
    assert relocate_artifacts(db, "reports/x/mlruns") == 0  # already there
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT artifact_uri FROM runs").fetchall() == [
            ("reports/x/mlruns/abc/artifacts",),
            (None,),
        ]
        assert con.execute("SELECT artifact_location FROM experiments").fetchall() == [
            ("reports/x/mlruns/0",)
        ]
