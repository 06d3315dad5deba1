"""The decode's load during an arm's stress run (orchestrator.workload.decode_load): reading SGLang's
gauges, the poller, what MLflow keeps, report.json's `arms[].decode_load` and the report's section; one
arm end to end against the embedded default."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.tracking import MlflowClient

from orchestrator.analysis import RunRecord
from orchestrator.analysis.result import ArmDecodeLoad, RunLoad
from orchestrator.analysis.study import arm_decode_load
from orchestrator.arm import ArmStart, StressThenBench, prepare, run_arm
from orchestrator.config.load import load_job
from orchestrator.remote.local import LocalTransport
from orchestrator.report.render import decode_load_section
from orchestrator.tracking.read import _record
from orchestrator.tracking.write import ArmTracker
from orchestrator.workload.decode_load import (
    DecodeLoad,
    DecodeLoadMonitor,
    LoadUnavailable,
    fetch_metrics,
    from_record,
    parse_load,
    planned_concurrency,
)

# what SGLang 0.5.23's decode serves (two DP ranks; tp_rank 1 repeats rank 0's counts)
SGLANG_PAGE = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="0"} 30.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="m",tp_rank="0"} 25.0
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="m",tp_rank="1"} 30.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 2.0
sglang:num_decode_prealloc_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 1.0
sglang:num_decode_transfer_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 3.0
sglang:num_decode_transfer_queue_reqs{dp_rank="1",model_name="m",tp_rank="0"} NaN
sglang:num_running_reqs_offline_batch{model_name="m"} 99.0
sglang:gen_throughput{model_name="m"} 512.5
"""


def test_parse_load_sums_the_request_gauges_of_every_dp_rank():
    assert parse_load(SGLANG_PAGE) == 30 + 25 + 2 + 1 + 3
    assert parse_load("sglang:num_running_reqs 4\n") == 4  # no labels, no queue gauge
    with pytest.raises(LoadUnavailable, match="no sglang:num_running_reqs"):
        parse_load("sglang:num_queue_reqs 3\nsglang:gen_throughput 1\n")


def _series(gauge: str, value: float, **labels: object) -> str:
    body = ",".join(f'{k}="{v}"' for k, v in {"engine_type": "decode", "model_name": "m", **labels}.items())
    return f"sglang:{gauge}{{{body}}} {value}"


def dp_attention_page(tp: int, dp: int, all_schedulers: bool, priority: bool = False) -> tuple[str, float]:
    """/metrics of a DP-attention decode as sglang 0.5.23 labels it (SchedulerMetricsCollector.init_new):
    the scheduler of global TP rank r is in DP group r // (tp // dp); only attention-TP rank 0 of a group
    reports unless `all_schedulers`; with `priority` the total has priority="" beside a breakdown. Returns
    the page and the load it shows (each group's running and queued requests, once)."""
    attn_tp = tp // dp
    lines, load = ["# TYPE sglang:num_running_reqs gauge"], 0.0
    for rank in range(tp):
        group = rank // attn_tp
        if rank % attn_tp and not all_schedulers:
            continue
        running, queued = 10.0 + group, float(group % 3)
        labels: dict[str, object] = {"tp_rank": rank, "pp_rank": 0, "moe_ep_rank": rank, "dp_rank": group}
        if priority:
            lines.append(_series("num_running_reqs", running, **labels, priority=""))
            lines += [_series("num_running_reqs", running / 2, **labels, priority=p) for p in (0, 1)]
        else:
            lines.append(_series("num_running_reqs", running, **labels))
        lines.append(_series("num_queue_reqs", queued, **labels))
        if rank % attn_tp == 0:
            load += running + queued
    return "\n".join(lines) + "\n", load


@pytest.mark.parametrize(
    "tp, dp, all_schedulers, priority",
    [
        (8, 8, False, False),
        (8, 2, False, False),
        (8, 2, True, False),
        (4, 4, True, True),
        (8, 1, True, False),
    ],
)
def test_parse_load_counts_one_series_per_dp_group_under_dp_attention(tp, dp, all_schedulers, priority):
    page, load = dp_attention_page(tp, dp, all_schedulers, priority)
    assert parse_load(page) == load
    # the old rule (tp_rank "0" only) saw the first DP group alone: the arm read "load fell short"
    first_group_only = sum(
        float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if 'tp_rank="0"' in line and 'priority="0"' not in line and 'priority="1"' not in line
    )
    assert (first_group_only < load) == (dp > 1)


def test_parse_load_leaves_out_later_pipeline_stages():
    page = "\n".join(
        [
            _series("num_running_reqs", 12.0, tp_rank=0, pp_rank=0),
            _series("num_running_reqs", 12.0, tp_rank=1, pp_rank=1),
        ]
    )
    assert parse_load(page) == 12.0


def test_decode_load_summary_and_short_of_the_plan():
    load = DecodeLoad(planned=60, samples=(50.0, 58.0, 60.0, 52.0))
    assert (load.mean, load.p50, load.max, load.fraction, load.short) == (55.0, 55.0, 60.0, 55 / 60, False)
    assert load.metrics() == {
        "decode_load.planned": 60.0,
        "decode_load.mean": 55.0,
        "decode_load.p50": 55.0,
        "decode_load.max": 60.0,
        "decode_load.samples": 4.0,
    }
    assert DecodeLoad(planned=60, samples=(40.0, 47.0)).short  # 43.5 < 80% of 60
    unknown = DecodeLoad(planned=60, unknown="404")
    assert not unknown.measured and not unknown.short and unknown.metrics() == {"decode_load.planned": 60.0}
    assert planned_concurrency(60, None) == 60 and planned_concurrency(60, 16) == 16
    assert planned_concurrency(8, 16) == 8


def test_from_record_reads_what_the_tracker_logged():
    measured = DecodeLoad(planned=60, samples=(50.0, 60.0))
    got = from_record(measured.metrics(), {"decode_load": "measured"})
    assert got == {"planned": 60, "measured": True, "unknown": "", "mean": 55.0, "p50": 55.0, "max": 60.0}
    got = from_record({"decode_load.planned": 60.0}, {"decode_load": "unknown", "decode_load_unknown": "404"})
    assert got["measured"] is False and got["unknown"] == "404" and got["mean"] is None
    assert from_record({"arm.rate": 0.1}, {}) == {}  # a run logged before the decode load was recorded


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, dict]]:
    """A loopback HTTP server answering /metrics with `state["page"]` (or `state["status"]`)."""
    state: dict = {"page": "sglang:num_running_reqs 5\nsglang:num_queue_reqs 1\n", "status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = state["page"].encode() if state["status"] == 200 else b"Not Found"
            self.send_response(state["status"])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", state
    finally:
        server.shutdown()
        server.server_close()


def test_the_monitor_polls_while_the_run_goes_on(metrics_server):
    url, _ = metrics_server
    monitor = DecodeLoadMonitor(url, planned=8, interval_s=0.02).start()
    threading.Event().wait(0.3)
    load = monitor.stop()
    assert load.measured and len(load.samples) >= 3 and set(load.samples) == {6.0}
    assert monitor.stop() is load  # idempotent


def test_a_server_without_metrics_leaves_the_load_unknown_with_why(metrics_server):
    url, state = metrics_server
    state["status"] = 404
    with pytest.raises(LoadUnavailable, match=r"HTTP 404 .*--enable-metrics"):
        fetch_metrics(url, 2.0)
    load = DecodeLoadMonitor(url, planned=8, interval_s=0.02).start()
    threading.Event().wait(0.1)
    result = load.stop()
    assert not result.measured and "--enable-metrics" in result.unknown and result.failed_polls >= 1
    gone = DecodeLoadMonitor("http://127.0.0.1:9/metrics", planned=8, interval_s=10.0).start().stop()
    assert not gone.measured and "could not be read" in gone.unknown  # one poll at stop: a short run


def _run(rep: int, load: dict) -> RunRecord:
    return RunRecord(
        run_id=f"r{rep}",
        status="FINISHED",
        signature="aaa",
        repetition=rep,
        factors={},
        outcomes="complete",
        clean=50,
        corrupted=10,
        decode_load=load,
    )


def _measured(mean: float, planned: int = 60) -> dict:
    return {"planned": planned, "measured": True, "unknown": "", "mean": mean, "p50": mean, "max": planned}


def test_arm_decode_load_over_the_runs_and_the_report_sentences():
    assert arm_decode_load([_run(0, {})]) is None  # runs logged before it: no field to show
    full = arm_decode_load([_run(0, _measured(56.0)), _run(1, _measured(58.0))])
    assert full.mean == 57.0 and full.fraction == pytest.approx(0.95) and not full.short
    assert (full.runs, full.runs_measured, full.unknown) == (2, 2, ())
    short = arm_decode_load(
        [_run(0, _measured(30.0)), _run(1, {"planned": 60, "measured": False, "unknown": "404"})]
    )
    assert short.short and short.runs_measured == 1 and short.unknown == ("404",)
    assert short.per_run[1] == RunLoad(repetition=1, mean=None, p50=None, max=None, unknown="404")

    def arm(label: str, load: ArmDecodeLoad | None) -> SimpleNamespace:
        # what the section reads of an arm: its label and its typed decode load
        return SimpleNamespace(label=label, decode_load=load)

    md = "\n".join(
        decode_load_section([arm("baseline", full), arm("multi_stream=off", short), arm("old", None)])
    )
    assert md.startswith("## Decode load")
    assert "| baseline | 60 | 57.0 | 57.0 | 60 | 95% | 2/2 |" in md
    assert "| multi_stream=off | 60 | 30.0 | 30.0 | 60 | 50% | 1/2 |" in md
    assert (
        "**multi_stream=off** fell short: the decode held 30.0 requests on average against 60 planned" in md
    )
    assert "**multi_stream=off**: decode load unknown in 1 of 2 runs (404)." in md
    assert "| old |" not in md and "**baseline**" not in md
    assert decode_load_section([arm("x", None)]) == []  # a report of runs logged before it
    calm = decode_load_section([arm("baseline", full)])
    assert "Every arm reached its planned concurrency." in calm


def test_an_arm_records_the_decode_load_it_reached(compose_cfg, tmp_path: Path):
    """A whole arm against the embedded default: the sim's decode reports its modelled load in SGLang's
    gauges, the arm's MLflow run keeps it, and it reads back as the analysis sees it."""
    job = load_job(compose_cfg("workload.sessions=6", "workload.rounds=2", "bench.enabled=false"))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart)
    transports = {role: LocalTransport() for role in start.plan.roles}
    tracker = ArmTracker.start(job.tracking, job.study, start.plan, start.repetition, None)
    assert run_arm(start, transports, tracker, StressThenBench(0), tmp_path / "job")["status"] == "FINISHED"
    client = MlflowClient(job.tracking.uri)
    run = client.get_run(tracker.run_id)
    m = run.data.metrics
    assert m["decode_load.planned"] == 6 and run.data.tags["decode_load"] == "measured"
    assert m["decode_load.samples"] >= 1 and 1 <= m["decode_load.mean"] <= m["decode_load.max"] <= 6 + 2
    saved = json.loads((tmp_path / "job" / "stress" / "decode_load.json").read_text())
    assert saved["planned"] == 6 and len(saved["samples"]) == m["decode_load.samples"]
    assert "decode_load.json" in {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "stress")}
    record = _record(run, (), {})
    assert record.decode_load["measured"] and record.decode_load["planned"] == 6
    assert arm_decode_load([record]).runs_measured == 1
