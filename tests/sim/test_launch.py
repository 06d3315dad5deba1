"""The sim's launch builder (its argv is what the sim's own parser reads back, its env what the sim
reads) and the health wait, on a real process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.remote.local import LocalTransport
from orchestrator.sim.args import parse_args
from orchestrator.sim.launch import router_launch, server_launch, wait_healthy
from orchestrator.sim.server import FAULT_MODEL_ENV, TIME_SCALE_ENV
from tests.conftest import free_port


def test_server_launch_places_the_role_and_sets_the_sims_env():
    launch = server_launch(
        8100,
        mode="decode",
        model_path="org/model",
        bootstrap_port=8998,
        time_scale=0.05,
        fault_model="/tmp/faults.yaml",
        flags=["--disable-decode-cuda-graph"],
        env={"SGLANG_X": "1"},
    )
    assert launch.argv[:3] == [sys.executable, "-m", "orchestrator.sim.server"]
    args = parse_args(launch.argv[3:])
    assert (args.model_path, args.disaggregation_mode, args.host, args.port) == (
        "org/model",
        "decode",
        "127.0.0.1",
        8100,
    )
    assert args.disaggregation_bootstrap_port == 8998 and args.disable_decode_cuda_graph
    assert launch.env == {TIME_SCALE_ENV: "0.05", "SGLANG_X": "1", FAULT_MODEL_ENV: "/tmp/faults.yaml"}
    assert launch.url == "http://127.0.0.1:8100"


def test_a_lone_server_has_no_pd_flags_and_adds_no_env():
    launch = server_launch(8100)
    assert "--disaggregation-mode" not in launch.argv and "--disaggregation-bootstrap-port" not in launch.argv
    assert parse_args(launch.argv[3:]).disaggregation_mode == "null"
    assert launch.env == {}


def test_router_launch_wires_prefill_bootstrap_and_decode():
    launch = router_launch(
        8200,
        prefill_url="http://127.0.0.1:8100",
        bootstrap_port=8998,
        decode_url="http://127.0.0.1:8101",
        metrics_port=29555,
    )
    argv = launch.argv
    assert argv[argv.index("--prefill") + 1 : argv.index("--prefill") + 3] == [
        "http://127.0.0.1:8100",
        "8998",
    ]
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:8101"
    assert argv[argv.index("--prometheus-port") + 1] == "29555" and "--pd-disaggregation" in argv
    assert launch.url == "http://127.0.0.1:8200"


def test_the_router_module_reads_its_arguments_as_the_sglang_router_launcher_does():
    """orchestrator.sim.router starts the same Rust router without the launcher's mini-LB import: the
    same argv gives the same RouterArgs, and the Python debugging balancer is refused, not started."""
    from sglang_router.launch_router import parse_router_args as launcher_parse

    from orchestrator.sim import router

    launch = router_launch(
        8000, prefill_url="http://127.0.0.1:8101", bootstrap_port=8998, decode_url="http://127.0.0.1:8102",
        metrics_port=29001, flags=["--policy", "round_robin"],
    )  # fmt: skip
    flags = launch.argv[launch.argv.index(router.__name__) + 1 :]
    assert router.parse_router_args(flags) == launcher_parse(flags)
    with pytest.raises(SystemExit, match="mini-lb"):
        router.main([*flags, "--mini-lb"])


def test_wait_healthy_names_a_server_that_exited_with_its_log(tmp_path: Path):
    transport = LocalTransport()
    launch = server_launch(free_port(), flags=["--no-such-flag"])
    log = tmp_path / "sim.log"
    pid = transport.start_detached(launch.argv, launch.env, str(log), str(tmp_path / "sim.pid"))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)decode exited during startup:.*--no-such-flag"):
            wait_healthy(
                launch.url, alive=lambda: transport.is_alive(pid), log_tail=log.read_text, name="decode"
            )
    finally:
        transport.stop_group(pid)


def test_wait_healthy_gives_up_on_a_port_nobody_serves():
    with pytest.raises(RuntimeError, match=r"router not healthy within 0\.3s"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=0.3, name="router")
