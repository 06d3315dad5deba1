"""The GPU engine behind the real sim server process, with a CPU stand-in for the device step
(tests/gpu/scripted.py): requests, per-bucket counters in /server_info, the fix, the counters file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from orchestrator.sim.server import DECODE_ENGINE_ENV
from orchestrator.workload import tasks
from tests.conftest import free_port
from tests.gpu.conftest import REPO, chat, get_json


def planned() -> tuple[list, object]:
    task = tasks.make_task(seed=1, session_index=0, rounds=2)
    messages = tasks.initial_messages(task)
    return messages, tasks.next_expected_call(messages)


def test_a_mismatching_captured_step_corrupts_the_planned_call_and_is_counted_per_bucket(serve):
    _, base = serve()
    messages, expected = planned()
    message = chat(base, messages, tasks.TOOLS)["choices"][0]["message"]
    # the stand-in flags row 0 from the first step: nothing was streamed, the call leaks as text
    assert message["tool_calls"] is None
    assert expected.name in message["content"]
    engine = get_json(f"{base}/server_info")["sim"]["decode_engine"]
    assert engine["captured_sizes"] == [1, 2, 4, 8, 12, 16, 24, 32]
    assert engine["config"] == {
        "capture": "graph",
        "cuda_graph_max_bs_decode": 32,
        "multi_stream": True,
        "bf16_index_k": False,
        "indexer_fix": "none",
    }
    bucket = engine["buckets"]["1"]
    assert bucket["corrupted_turns"] == 1
    assert bucket["mismatched_steps"] == bucket["steps"] >= 2  # the health check's step too
    assert engine["corrupted_turns"] == 1


def test_record_stream_or_eager_leaves_every_call_intact(serve):
    messages, expected = planned()
    for flags, env, bucket in (
        ((), {"HEISENHUNT_GPU_INDEXER_FIX": "record_stream"}, "1"),
        (("--disable-decode-cuda-graph",), {}, "eager"),
        (("--disable-cuda-graph",), {}, "eager"),  # deprecated: both phases, the decode's too
    ):
        _, base = serve(*flags, **env)
        call = chat(base, messages, tasks.TOOLS)["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == expected.name
        assert json.loads(call["arguments"]) == dict(expected.arguments)
        counters = get_json(f"{base}/server_info")["sim"]["decode_engine"]["buckets"][bucket]
        assert counters["mismatched_steps"] == 0 and counters["steps"] > 0


def test_each_start_writes_its_counters_at_shutdown(serve, tmp_path):
    proc, base = serve()
    chat(base, [{"role": "user", "content": "hi"}], None)  # plain chat: mismatches, nothing to corrupt
    seed = get_json(f"{base}/server_info")["sim"]["decode_engine"]["seed"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(15)
    (path,) = (tmp_path / "counters").glob("decode-*.json")
    written = json.loads(path.read_text())
    assert written["seed"] == seed
    assert written["buckets"]["1"]["masked_rows"] == written["buckets"]["1"]["mismatched_rows"] > 0
    assert written["corrupted_turns"] == 0


def test_an_unknown_fix_stops_the_server_before_it_serves(tmp_path):
    environ = {
        **os.environ,
        DECODE_ENGINE_ENV: "tests.gpu.scripted:ScriptedRowsEngine",
        "HEISENHUNT_GPU_INDEXER_FIX": "sleep",
    }
    argv = [sys.executable, "-m", "orchestrator.sim.server", "--model-path", "m", "--port", str(free_port())]
    done = subprocess.run(argv, cwd=REPO, env=environ, capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    assert "HEISENHUNT_GPU_INDEXER_FIX must be one of" in done.stdout + done.stderr
