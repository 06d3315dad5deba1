"""The command lines of a standalone simulated deployment on loopback, built in one place, and the
wait for one of its processes to serve.

`server_launch` gives the argv and env of one sim server (a prefill, a decode, or a lone `null` server);
`router_launch` those of the real sglang-router in front of a prefill and a decode. Pure: they build
commands and start nothing, so tests and bench scripts start them with whatever transport they use.
`wait_healthy` polls the started process's /health (the only I/O here):

    launch = server_launch(port, mode="decode", bootstrap_port=bp, time_scale=0.05)
    pid = LocalTransport().start_detached(launch.argv, launch.env, log_path, pid_path)
    wait_healthy(launch.url, alive=lambda: transport.is_alive(pid), log_tail=lambda: tail(log_path))

The orchestrator's own deployment is not launched from here: it builds each role's argv from the
deployment config (conf/deployment/sim_dsv4.yaml) like it does for SGLang.
"""

from __future__ import annotations

import http.client
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from orchestrator.sim import server

# the real sglang-router, without the launcher's import of its Python mini load balancer (router.py)
ROUTER_MODULE = "orchestrator.sim.router"


@dataclass(frozen=True)
class Launch:
    """One process to start: its command line, the environment it adds to the caller's, its URL."""

    argv: list[str]
    env: dict[str, str]
    url: str


def server_launch(
    port: int,
    *,
    mode: str = "null",
    model_path: str = "m",
    host: str = "127.0.0.1",
    bootstrap_port: int | None = None,
    time_scale: float | str | None = None,
    fault_model: str | None = None,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    python: str = sys.executable,
) -> Launch:
    """A sim server on `host:port` in PD `mode` ("prefill", "decode" or "null": no PD).

    `time_scale` (unset: the sim's default, the modelled hardware) and `fault_model` (a YAML path; unset:
    the built-in model) become the sim's env vars; `env` is added after them, `flags` after the
    placement flags.
    """
    argv = [python, "-m", server.__name__, "--model-path", model_path]
    if mode != "null":
        argv += ["--disaggregation-mode", mode]
    argv += ["--host", host, "--port", str(port)]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    full_env = {} if time_scale is None else {server.TIME_SCALE_ENV: str(time_scale)}
    full_env.update(env or {})
    if fault_model is not None:
        full_env[server.FAULT_MODEL_ENV] = fault_model
    return Launch([*argv, *flags], full_env, f"http://{host}:{port}")


def router_launch(
    port: int,
    *,
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    metrics_port: int,
    host: str = "127.0.0.1",
    flags: Sequence[str] = (),
    python: str = sys.executable,
) -> Launch:
    """The real sglang-router in PD mode on `host:port`, in front of one prefill and one decode.

    `metrics_port` is required: the router's default (29000) may be held by another run on the machine.
    """
    argv = [
        python,
        "-m",
        ROUTER_MODULE,
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        str(bootstrap_port),
        "--decode",
        decode_url,
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-port",
        str(metrics_port),
        *flags,
    ]
    return Launch(argv, {}, f"http://{host}:{port}")


def wait_healthy(
    url: str,
    *,
    timeout_s: float = 30.0,
    alive: Callable[[], bool] | None = None,
    log_tail: Callable[[], str] | None = None,
    name: str = "sim server",
    poll_s: float = 0.1,
) -> None:
    """Return once GET `url`/health answers 200. Raise RuntimeError, with `log_tail()` when given, if
    `alive()` turns false first (the process exited) or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass  # not listening yet, 503 while it starts, or cut off by a dying process
        if alive is not None and not alive():
            problem = f"{name} exited during startup"
        elif time.monotonic() > deadline:
            problem = f"{name} not healthy within {timeout_s:g}s"
        else:
            time.sleep(poll_s)
            continue
        raise RuntimeError(f"{problem}:\n{log_tail()}" if log_tail is not None else problem)
