"""The real_sglang study (experiments/real_sglang.yaml, conf/deployment/sglang_tiny_pd.yaml) and the real
server's lines: sglang 0.5.17's decode log and /metrics as it wrote them on the H200, read by the same
parsers the arms use, and the study log read by orchestrator.gpu.device_run."""

from __future__ import annotations

from orchestrator.decode_load import parse_load
from orchestrator.gpu.device_run import batches_by_start, render_section, starts_from_study_log
from orchestrator.observe import parse_decode_log
from tests.conftest import plan_of

# lines of real 0.5.17 decode logs on the H200 (reports/real_sglang/logs.tgz; the non-PD line from the probe's FINDINGS.md)
DECODE_LOG = """\
[2026-12-03 05:48:45] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, bs=[1, 2, 4, 8, 12, 16], avail mem=74.39 GB
[2026-12-03 05:48:47] Capture target decode CUDA graph end. elapsed=1.43 s, mem usage=0.04 GB, avail mem=74.35 GB.
[2026-12-03 05:48:48] The server is fired up and ready to roll!
[2026-12-03 05:48:51] Decode batch, #running-req: 1, #token: 39, token usage: 0.00, pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, cuda graph: True, gen throughput (token/s): 2.15, #queue-req: 0
[2026-12-03 00:49:01] Decode batch, #running-req: 1, #token: 382, token usage: 0.00, cuda graph: True, gen throughput (token/s): 829.98, #queue-req: 0
[2026-12-03 05:56:54] Decode batch, #running-req: 1, #token: 39, token usage: 0.00, pre-allocated usage: 0.00, #prealloc-req: 0, #transfer-req: 0, #retracted-req: 0, cuda graph: False, gen throughput (token/s): 1.67, #queue-req: 0
"""


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


# /metrics of a real 0.5.17 decode (labels as its SchedulerMetricsCollector writes them)
METRICS = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="/tmp/real-sglang/tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="/tmp/real-sglang/tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.0
# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{engine_type="unified",model_name="/tmp/real-sglang/tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
# TYPE sglang:num_decode_transfer_queue_reqs gauge
sglang:num_decode_transfer_queue_reqs{engine_type="unified",model_name="/tmp/real-sglang/tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:cuda_graph_passes_total{engine_type="unified",mode="decode_cuda_graph",model_name="/tmp/real-sglang/tiny",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 226.0
"""


def test_the_real_metrics_give_the_decode_load():
    assert parse_load(METRICS) == 8.0


STUDY_LOG = """\
[2026-12-03 06:01:00,000][orchestrator][INFO] - arm baseline, repetition 0, signature e1ac15514731
[2026-12-03 06:01:00,100][orchestrator][INFO] - starting prefill
[2026-12-03 06:01:20,100][orchestrator][INFO] - prefill healthy after 20.0s
[2026-12-03 06:01:20,200][orchestrator][INFO] - starting decode
[2026-12-03 06:01:41,300][orchestrator][INFO] - decode healthy after 21.1s
[2026-12-03 06:01:41,400][orchestrator][INFO] - router healthy after 18.2s
[2026-12-03 06:03:00,000][orchestrator][INFO] - arm capture=eager, repetition 1, signature 0061e5b6502e
[2026-12-03 06:03:30,000][orchestrator][ERROR] - arm capture=eager failed: decode: not healthy within 300s
"""


def test_the_study_log_gives_each_start_and_the_section_shows_it():
    starts = starts_from_study_log(STUDY_LOG)
    assert [(s["label"], s["repetition"]) for s in starts] == [("baseline", 0), ("capture=eager", 1)]
    assert starts[0]["healthy_s"] == {"prefill": 20.0, "decode": 21.1, "router": 18.2}
    assert starts[1]["failed"].startswith("decode: not healthy") and starts[1]["healthy_s"] == {}
    batches = batches_by_start({"real_sglang-e1ac15514731-r0-0123456789ab.decode.log": DECODE_LOG})
    assert batches[("e1ac15514731", 0)]["capture_batches"] == 2
    section = render_section("NVIDIA H200, 580.159.04", starts, batches, "study 300 s", "none")
    assert "| baseline | 0 | 20.0 | 21.1 | 18.2 | yes | 2 | 1 |  |" in section
    assert "| capture=eager | 1 | - | - | - | - | - | - | decode: not healthy within 300s |" in section
    # a start whose decode never served shows no batches, even where a later start of its arm has a log
    again = render_section("", starts, {("0061e5b6502e", 1): batches[("e1ac15514731", 0)]}, "", "")
    assert "| capture=eager | 1 | - | - | - | - | - | - |" in again
