"""The tests' warm start (tests/warm.py) against the cold start it stands in for: the same command answers
the same, its pid is the orchestrator's own, signals end it as they end a cold one, and whatever a fork
cannot reproduce runs cold."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm
from tests.conftest import local_cluster_overrides, seed_mlflow_store
from tests.test_study import kill_if_running, no_servers_left

ORCH = [sys.executable, "-m", "orchestrator"]


def both(argv: list[str], cwd: Path, monkeypatch) -> tuple[subprocess.CompletedProcess, ...]:
    """The command run warm, then cold (the same arguments, environment and directory)."""
    monkeypatch.setenv(warm.COLD_ENV, "0")
    warm_run = warm.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    monkeypatch.setenv(warm.COLD_ENV, "1")
    cold_run = warm.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    return warm_run, cold_run


def without_the_zygotes_frame(text: str) -> str:
    """A traceback printed with the whole stack (Hydra prints one so) starts at the zygote's frame that
    runs the command (tests/warm.py); a cold one at `python -m`'s own."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith('  File "') and line.split('"')[1] == warm.__file__:
            end = i + 1
            while end < len(lines) and lines[end].startswith("    "):  # its source line and carets
                end += 1
            return "".join(lines[:i] + lines[end:])
    return text


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],  # our help page: stdout, 0
        ["study.nme=x"],  # Hydra refuses a key: its message on stderr, 1
        ["tracking.uri=sqlite:///m.db", "--bogus"],  # our command-line check: 2
        ["-m", "--cfg", "job", "factor/multi_stream=on,off"],  # Hydra's own error, with a traceback
    ],
    ids=["help", "unknown key", "bad flag", "cfg"],
)
def test_a_warm_command_answers_as_the_cold_one(tmp_path: Path, monkeypatch, args: list[str]):
    warm_run, cold_run = both([*ORCH, *args], tmp_path, monkeypatch)
    assert (warm_run.returncode, warm_run.stdout, without_the_zygotes_frame(warm_run.stderr)) == (
        cold_run.returncode,
        cold_run.stdout,
        cold_run.stderr,
    )
    assert warm_run.stdout or warm_run.stderr


def test_a_module_of_the_package_runs_warm_as_cold(tmp_path: Path, monkeypatch):
    """`python -m orchestrator.study.rehearse` (the docs run such commands warm): a module the zygote has
    imported runs anew as __main__, with the same seeded result."""
    argv = [sys.executable, "-m", "orchestrator.study.rehearse", "+experiment=dsv4_corruption"]
    argv += ["rehearse.studies=30", "rehearse.seed=3"]
    warm_run, cold_run = both(argv, tmp_path, monkeypatch)
    assert warm_run.returncode == cold_run.returncode == 0, warm_run.stderr[-2000:]
    assert (warm_run.stdout, warm_run.stderr) == (cold_run.stdout, cold_run.stderr)
    assert "H-multistream" in warm_run.stdout


def test_a_dry_run_prints_the_same_plan_warm_and_cold(tmp_path: Path, monkeypatch):
    """A dry run reads the environment the command is given (a secret by reference) and the working
    directory's relative paths: the same plan either way."""
    argv = [
        *ORCH, *local_cluster_overrides(tmp_path), "tracking.uri=sqlite:///rel/m.db",
        "report.dir=rel/reports", f"hydra.sweep.dir={tmp_path}/multirun", "dry_run=true",
        "++deployment.roles.decode.env={HF_TOKEN: '${oc.env:HH_WARM_TOKEN}'}",
    ]  # fmt: skip
    monkeypatch.setenv("HH_WARM_TOKEN", "hf_not_a_real_token_123")
    counted = warm.children_cpu_s()
    warm_run, cold_run = both(argv, tmp_path, monkeypatch)
    # the warm child's CPU is counted, as RUSAGE_CHILDREN counts a cold one's (the test timeline's)
    assert warm.children_cpu_s() - counted >= 0.2
    assert warm_run.returncode == cold_run.returncode == 0, warm_run.stderr[-2000:]
    assert warm_run.stdout == cold_run.stdout and "HF_TOKEN" in warm_run.stdout
    assert "hf_not_a_real_token_123" not in warm_run.stdout + warm_run.stderr


def test_the_variables_taken_as_read_at_use_are_not_read_when_the_libraries_import():
    """Each READ_AT_USE_ENV prefix, as MLflow names its variables, set to a value MLflow cannot parse: the
    zygote's libraries still import (a variable read at import would raise there), and MLflow's own reader
    raises on it at use."""
    names = [
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
    ]
    assert all(name.startswith(warm.READ_AT_USE_ENV) for name in names)
    libraries = [m for m in warm.PRELOAD if m.split(".")[0] == "mlflow"]
    check = (
        f"import {', '.join(libraries)}\n"
        "from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES as v\n"
        "try:\n    v.get()\nexcept ValueError:\n    print('raised at use')\n"
    )
    env = {**os.environ, **dict.fromkeys(names, "not-a-number")}
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "raised at use", done.stderr[-2000:]


def test_what_a_fork_cannot_reproduce_runs_cold(monkeypatch):
    env = dict(os.environ)
    zygote_env = warm.zygote().env
    assert warm.cold_reason(ORCH, {"env": env}, zygote_env) is None
    # an interpreter setting, a library read at import, a Popen option, another module: cold
    assert warm.cold_reason(ORCH, {"env": {**env, "PYTHONPATH": "/elsewhere"}}, zygote_env)
    assert warm.cold_reason(ORCH, {"env": {**env, "MLFLOW_CONFIGURE_LOGGING": "true"}}, zygote_env)
    assert warm.cold_reason(ORCH, {"preexec_fn": print}, zygote_env)
    assert warm.cold_reason([sys.executable, "-m", "pytest"], {}, zygote_env)
    assert warm.cold_reason([sys.executable, "-c", "import orchestrator"], {}, zygote_env)
    assert warm.cold_reason([sys.executable, "-m", "orchestrator.study.rehearse"], {}, zygote_env) is None
    # the orchestrator's own default for MLflow's logging is the zygote's, and unbuffered output is built
    assert warm.cold_reason(ORCH, {"env": {**env, "MLFLOW_CONFIGURE_LOGGING": "false"}}, zygote_env) is None
    assert warm.cold_reason(ORCH, {"env": {**env, "PYTHONUNBUFFERED": "1"}}, zygote_env) is None
    # MLflow's HTTP retries are read at each request, never at import (next test)
    retries = {**env, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    assert warm.cold_reason(ORCH, {"env": retries}, zygote_env) is None
    proc = warm.popen([*ORCH, "--help"], stdout=subprocess.DEVNULL, preexec_fn=lambda: None)
    assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    monkeypatch.setenv(warm.COLD_ENV, "1")
    assert warm.cold_reason(ORCH, {}, zygote_env) == f"{warm.COLD_ENV} is set"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_warm_study_is_its_own_process_and_ends_by_the_signal_sent(tmp_path: Path, monkeypatch, sig):
    """The pid held is the orchestrator's: its working directory and command line are the request's, in
    a session of its own when asked; SIGKILL ends it at once (-9), SIGINT as the command says (130, what
    was kept)."""
    monkeypatch.setenv(warm.COLD_ENV, "0")
    argv = [
        *ORCH, "-m", *local_cluster_overrides(tmp_path),
        f"tracking.uri={seed_mlflow_store(tmp_path / 'm.db')}", f"report.dir={tmp_path}/reports",
        f"hydra.sweep.dir={tmp_path}/multirun", "repetition=0,1",
        "workload.sessions=400", "workload.rounds=8", "bench.enabled=false",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = warm.popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert isinstance(proc, warm.WarmProcess)
        proc_dir = Path(f"/proc/{proc.pid}")
        assert os.readlink(proc_dir / "cwd") == str(tmp_path)
        assert os.getsid(proc.pid) == proc.pid  # start_new_session
        deadline = time.monotonic() + 120
        while not list((tmp_path / "multirun").glob("*/stress/sessions.jsonl")):  # mid-stress
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert b"-m orchestrator -m" in (proc_dir / "cmdline").read_bytes()  # as `ps` shows it
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
        left = no_servers_left(tmp_path)
    finally:
        kill_if_running(proc)
        # what a killed orchestrator leaves (test_reliability.py ends it its own way), or a failed
        # assertion: the servers its pid files name that are still running, never left so
        for line in no_servers_left(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(line.rsplit(": ", 1)[1]), signal.SIGKILL)
    assert proc.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 130), out[-3000:]
    if sig == signal.SIGINT:
        assert "heisenhunt: " in out and "KILLED" in out, out[-3000:]
        assert not left, left
