"""End to end: real multiruns of `python -m orchestrator` on the embedded default, into tmp_path.

These start real processes (the simulated PD servers, the real sglang-router), send real traffic over
loopback and write a real MLflow sqlite store; they are the slow part of the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from tests import warm
from tests.conftest import orchestrator_argv
from tests.shared_runs import FACTORIAL_RUN

SMALL = [
    "workload.sessions=12",
    "workload.rounds=2",
    "bench.concurrency=[1,4]",
    "bench.requests_per_worker=2",
    "bench.output_len=16",
    "bench.input_len=64",
]


def orchestrator(tmp_path: Path, *overrides: str, **popen) -> subprocess.Popen | warm.WarmProcess:
    argv = orchestrator_argv(tmp_path, *overrides)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # forked from a warm zygote where that runs it as exec would (tests/warm.py)
    return warm.popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"orchestrator did not finish within {timeout}s:\n{out[-5000:]}")
    return out


def kill_if_running(proc: subprocess.Popen) -> None:
    """A test's last word on its orchestrator: never left running after a failed assertion."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def runs(tmp_path: Path, study: str):
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name(study)
    assert experiment is not None
    return client.search_runs([experiment.experiment_id])


def no_servers_left(tmp_path: Path) -> list[str]:
    """Processes of ours still running: any pid named by a pid file, or anything on our work dirs."""
    left = []
    for pid_file in tmp_path.glob("*/*.pid"):
        # line 1 the pid, line 2 its start time
        pid = int(pid_file.read_text().splitlines()[0])
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            if state != "Z":
                left.append(f"{pid_file}: {pid}")
        except (ProcessLookupError, FileNotFoundError):
            pass
    return left


@pytest.mark.slow
@pytest.mark.xdist_group(FACTORIAL_RUN)
def test_a_two_factor_multirun_runs_every_arm_and_reports(factorial_run):
    # `-m factor/multi_stream=on,off factor/capture=graph,eager` (tests/shared_runs.py: over the conjunction
    # fault model, whose minimal cause test_cause.py judges)
    tmp_path, out = factorial_run.root, factorial_run.out
    assert factorial_run.returncode == 0, out[-5000:]
    # a command-line sweep outside any study is its own study, named after what it sweeps
    study = "sweep-capture-multi_stream"
    children = [r for r in runs(tmp_path, study) if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 4, out[-3000:]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert {(r.data.params["factor.multi_stream"], r.data.params["factor.capture"]) for r in children} == {
        ("on", "graph"),
        ("on", "eager"),
        ("off", "graph"),
        ("off", "eager"),
    }
    # the same param keys on every arm: MLflow's compare view lines them up
    assert len({frozenset(r.data.params) for r in children}) == 1
    report = json.loads((tmp_path / "reports" / study / "report.json").read_text())
    # one hypothesis per swept factor, against the primary config's levels as baseline
    hyps = {h["id"]: (h["baseline_level"], h["treatment_level"]) for h in report["hypotheses"]}
    assert hyps == {"H-capture": ("graph", "eager"), "H-multi_stream": ("on", "off")}
    assert report["context"]["design"] == "factorial"
    [parent] = [r for r in runs(tmp_path, study) if r.data.tags.get("heisenhunt.kind") == "study"]
    assert parent.data.tags["design"] == "factorial"
    assert not (tmp_path / "reports" / "quick").exists() and not any(
        e.name == "quick" for e in mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()
    )
    assert not no_servers_left(tmp_path)


@pytest.mark.slow
def test_ctrl_c_in_the_first_arm_stops_the_sweep_and_leaves_nothing_running(tmp_path):
    proc = orchestrator(
        tmp_path,
        "-m",
        "factor/multi_stream=on,off",
        "repetition=0",
        "workload.sessions=200",
        "workload.rounds=4",
        "workload.concurrency=2",
        "bench.enabled=false",
    )
    try:
        sessions = tmp_path / "multirun" / "0" / "stress" / "sessions.jsonl"
        deadline = time.monotonic() + 120
        while not (sessions.is_file() and sessions.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the first arm never reached its stress phase"
            )
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out = finish(proc, 120)
    finally:
        kill_if_running(proc)
    assert proc.returncode != 0
    # the sweep stopped: the second arm never started, the first is KILLED, so is the parent
    assert not (tmp_path / "multirun" / "1").exists(), out[-3000:]
    by_kind = {}
    for run in runs(tmp_path, "quick"):
        by_kind.setdefault(run.data.tags.get("heisenhunt.kind"), []).append(run.info.status)
    assert by_kind == {"arm": ["KILLED"], "study": ["KILLED"]}, out[-3000:]
    assert not no_servers_left(tmp_path)
    assert not list(tmp_path.glob("*/*.pid"))
