"""The simulated PD deployment as real processes behind the real sglang-router, over loopback."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from simkit import (
    BASELINE,
    FIXED,
    MODEL,
    free_port,
    get_json,
    http_status,
    parse_sse,
    post_json,
    sim_counters,
)

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.launch import server_launch
from orchestrator.workload import tasks

SHORT_PD_TIMEOUTS = {
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20",
}


def plan_request(done: int = 0, stream: bool = False) -> tuple[tasks.Task, dict]:
    task = tasks.make_task(7, 1, 3)
    messages = tasks.conversation_after(task, done)
    body = {"model": MODEL, "messages": messages, "tools": tasks.TOOLS, "max_tokens": 512, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return task, body


def test_tool_calls_through_the_real_router(cluster):
    c = cluster(time_scale=0.05)
    c.start_all(FIXED)
    url = c.router_url + "/v1/chat/completions"

    task, body = plan_request()
    status, reply = post_json(url, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        task.steps[0].name,
        dict(task.steps[0].arguments),
    )
    assert reply["usage"]["completion_tokens"] > 5 and reply["usage"]["prompt_tokens"] > 100

    task, body = plan_request(done=1, stream=True)
    status, text = post_json(url, body)
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    turn = parse_sse(text)
    assert turn.finish_reason == "tool_calls" and turn.completion_tokens > 5 and turn.content == ""
    assert [(t["name"], json.loads(t["arguments"])) for t in turn.calls] == [
        (task.steps[1].name, dict(task.steps[1].arguments))
    ]
    first_delta = json.loads(text.split("\n\n")[0][6:])["choices"][0]["delta"]
    assert first_delta == {"role": "assistant", "content": ""}

    _, body = plan_request(done=3)
    status, reply = post_json(url, body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == tasks.DONE_REPLY
    assert reply["choices"][0]["finish_reason"] == "stop"

    # both roles saw the rooms the router made up for these requests
    prefill_info, decode_info = (
        get_json(c.procs["prefill"].url + "/server_info"),
        get_json(c.procs["decode"].url + "/server_info"),
    )
    shared = set(prefill_info["sim"]["recent_rooms"]) & set(decode_info["sim"]["recent_rooms"])
    assert len(shared) >= 3  # warm-up + the three requests above
    assert decode_info["disaggregation_mode"] == "decode" and decode_info["cuda_graph_max_bs_decode"] == 32
    assert decode_info["sim"]["effective_env"]["SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] is False
    assert prefill_info["sim"]["effective_env"]["SGLANG_DSV4_BF16_INDEX_K"] is True
    assert prefill_info["enable_hierarchical_cache"] is True
    assert get_json(c.procs["decode"].url + "/model_info")["tool_call_parser"] == "deepseekv4"
    assert get_json(c.procs["decode"].url + "/v1/models")["data"][0]["id"] == MODEL

    with urllib.request.urlopen(c.procs["decode"].url + "/metrics") as resp:
        metrics = resp.read().decode()
    generated = sim_counters(c.procs["decode"].url)["tokens_generated"]
    assert f'sglang:generation_tokens_total{{model_name="{MODEL}"}} {generated}' in metrics
    assert 'mode="decode_cuda_graph"} 0' not in metrics  # batches of 1 ran in captured graphs
    log = c.log("decode")
    assert "Capture target decode CUDA graph end" in log and log.index(
        "Capture target decode CUDA graph end"
    ) < log.index("The server is fired up and ready to roll!")


def test_health_is_503_while_starting(cluster, tmp_path: Path):
    slow = tmp_path / "slow-start.yaml"
    slow.write_text("version: 1\nname: slow-start\nrules: []\nthroughput: {startup_s: 40}\n")  # 2 s at 0.05
    c = cluster(time_scale=0.05, fault_model=str(slow))
    proc = c.start_decode(BASELINE, wait=False)
    statuses = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and 200 not in statuses:
        statuses.append(http_status(proc.url + "/health", timeout=2))
        time.sleep(0.1)
    assert 503 in statuses and statuses[-1] == 200
    assert statuses.index(503) < statuses.index(200)
    info = get_json(proc.url + "/server_info")
    assert info["sim"]["fault_model"]["name"] == "slow-start"


def test_decode_without_a_live_prefill_times_out_with_a_clear_error(cluster):
    c = cluster(time_scale=0.05, extra_env=SHORT_PD_TIMEOUTS)  # 20 s modelled -> 1 s
    decode = c.start_decode(BASELINE)
    dead = free_port()
    _, body = plan_request()
    body.update(bootstrap_host="127.0.0.1", bootstrap_port=dead, bootstrap_room=4242)
    started = time.monotonic()
    status, reply = post_json(decode.url + "/v1/chat/completions", body)
    waited = time.monotonic() - started
    assert status == 500
    assert "KVPoll.Bootstrapping" in reply["message"] and f"127.0.0.1:{dead}" in reply["message"]
    assert "cannot reach the prefill bootstrap server" in reply["message"]
    assert 0.9 <= waited < 10
    log = c.log("decode")
    assert "Decode handshake failed for request rank=0 bootstrap_room=4242" in log
    assert "Request 4242 timed out after" in log
    assert sim_counters(decode.url)["bootstrap_failures"] == 1
    # without bootstrap fields the decode refuses at once
    status, reply = post_json(decode.url + "/v1/chat/completions", plan_request()[1])
    assert status == 400 and "bootstrap_room" in reply["message"]


def test_decode_restarted_alone_degrades_and_a_co_restart_recovers(cluster):
    c = cluster(time_scale=0.05, extra_env=SHORT_PD_TIMEOUTS)
    c.start_all(FIXED)
    url = c.router_url + "/v1/chat/completions"
    assert post_json(url, plan_request()[1])[0] == 200

    c.stop("decode")
    c.start_decode(FIXED)  # same address, new session; the prefill kept running
    status, reply = post_json(url, plan_request()[1], timeout=60)
    assert status is not None and status >= 500, reply
    assert sim_counters(c.procs["decode"].url)["bootstrap_failures"] >= 1
    assert "in KVPoll.Bootstrapping" in c.log("decode")

    c.stop_all()  # the co-restart: router, decode, prefill; then prefill, decode, router
    c.start_all(FIXED)
    for _ in range(3):
        status, reply = post_json(url, plan_request()[1])
        assert status == 200, reply
    assert sim_counters(c.procs["decode"].url)["bootstrap_failures"] == 0


def test_invalid_fault_model_stops_the_server_with_a_clear_error(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "version: 1\nrules:\n  - name: r\n    when: {decode.env.SGLANG_TYPO: true}\n"
        "    probability: [[1, 0.0]]\n    shapes: {invalid_json: 1}\n"
    )
    launch = server_launch(free_port(), fault_model=str(bad))
    result = LocalTransport().run(launch.argv, env=launch.env, check=False, timeout=60)
    assert result.returncode == 2
    assert "unknown key 'decode.env.SGLANG_TYPO'" in result.stdout + result.stderr
    assert str(bad) in result.stdout + result.stderr


def test_generate_through_the_router_and_flush_cache(cluster):
    c = cluster(time_scale=0.05)
    c.start_all(FIXED)
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 17, "ignore_eos": True}}
    status, reply = post_json(c.router_url + "/generate", body)
    assert status == 200, reply
    assert (
        reply["meta_info"]["completion_tokens"] == 17
        and reply["meta_info"]["finish_reason"]["type"] == "length"
    )
    assert reply["text"]
    status, text = post_json(c.procs["decode"].url + "/flush_cache", {})
    assert status == 200 and "flushed" in text
