"""Fixtures of the GPU engine tests: a real sim server process with a chosen decode engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from orchestrator.sim.server import DECODE_ENGINE_ENV
from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPTED = "tests.gpu.scripted:ScriptedRowsEngine"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def chat(base: str, messages: list, tools: list | None) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 1024}
    if tools:
        body["tools"] = tools
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def serve(tmp_path):
    procs = []

    def start(*flags: str, engine: str = SCRIPTED, startup_s: float = 30, **env: str):
        port = free_port()
        environ = {
            **os.environ,
            DECODE_ENGINE_ENV: engine,
            "HEISENHUNT_SIM_TIME_SCALE": "0.02",
            "HEISENHUNT_GPU_COUNTERS_DIR": str(tmp_path / "counters"),
            **env,
        }
        argv = [sys.executable, "-m", "orchestrator.sim.server", "--model-path", "m", "--port", str(port)]
        proc = subprocess.Popen(
            [*argv, *flags], cwd=REPO, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    return proc, base
            except OSError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        raise AssertionError(f"server not healthy in {startup_s} s")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
