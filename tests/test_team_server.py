"""One MLflow server for a team (`tracking.uri=http://...`): a real `mlflow server` over a real PostgreSQL
(tests/team_server.py), as a team shares one, with several studies, a Ray pool among them, writing to it
at once, and the server crashing and coming back mid-study.

What is promised: each study's runs land in its own experiment, the report rebuilt from the server is the
one the sweep wrote, and a server that goes down for a while loses nothing measured (MLflow's client
retries its requests with backoff; what it could not send in that time is still on disk).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests import warm
from tests.conftest import POOL_MEMBERS, free_port, local_cluster_overrides, pool_overrides
from tests.team_server import MlflowServer, postgres_bin, team_server
from tests.test_study import finish, kill_if_running, no_servers_left

# one server for the module's tests (loadgroup: on one pytest worker); each test runs whole studies
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("team"), pytest.mark.timeout(900)]

REPORT_CLI = [sys.executable, "-m", "orchestrator.report"]
# two arms a study, one start each: on the pool, the two start together, one on each member
SMALL = ["workload.rounds=1", "bench.enabled=false", "workload.sessions=8", "repetition=0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    missing = [
        what
        for what, ok in (
            ("PostgreSQL (apt-get install postgresql)", postgres_bin() is not None),
            ("psycopg2 (pip install psycopg2-binary)", importlib.util.find_spec("psycopg2") is not None),
        )
        if not ok
    ]
    if missing:
        if os.environ.get("HEISENHUNT_REQUIRE_TEAM_SERVER"):  # CI installs both: never skip there
            pytest.fail(f"not installed: {', '.join(missing)}")
        pytest.skip(f"not installed: {', '.join(missing)}")
    with team_server(tmp_path_factory.mktemp("team"), free_port) as s:
        yield s


def sweep(
    root: Path, uri: str, study: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`python -m orchestrator -m` for `study` in `root`, tracking to `uri`."""
    argv = [
        sys.executable, "-m", "orchestrator", "-m", f"tracking.uri={uri}", f"study.name={study}",
        f"report.dir={root}/reports", f"hydra.sweep.dir={root}/multirun",
        "hydra.sweep.subdir=${hydra.job.num}", *extra,
    ]  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    return warm.popen(
        argv,
        cwd=root,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rebuilt_report(root: Path, uri: str, study: str) -> dict:
    """The report command, from the server alone, into a folder of its own; report.json's content."""
    out = root / "rebuilt"
    proc = warm.run(
        [*REPORT_CLI, "--tracking-uri", uri, "--study", study, "--out", str(out), "--no-plots"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / study / "report.json").read_text())


def written_report(root: Path, study: str) -> dict:
    return json.loads((root / "reports" / study / "report.json").read_text())


def arm_runs(uri: str, study: str) -> list:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name(study)
    assert experiment is not None, f"no experiment {study} on {uri}"
    return client.search_runs([experiment.experiment_id], "tags.`heisenhunt.kind` = 'arm'")


def statuses(runs: list) -> list[tuple[str, str]]:
    return [(r.info.run_name, r.info.status) for r in runs]


def sessions_on_disk(root: Path) -> dict[str, int]:
    """Per job dir of the sweep: the sessions its stress run wrote to disk (stress/sessions.jsonl)."""
    return {
        job.name: (job / "stress" / "sessions.jsonl").read_text().count("\n")
        for job in sorted((root / "multirun").iterdir())
        if (job / "stress" / "sessions.jsonl").is_file()
    }


def mid_stress(proc: subprocess.Popen, root: Path, timeout: float = 240) -> Path:
    """Once the sweep's first arm is in its stress run (two sessions written): its sessions.jsonl."""
    sessions = root / "multirun" / "0" / "stress" / "sessions.jsonl"
    deadline = time.monotonic() + timeout
    while not (sessions.is_file() and sessions.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the first arm never reached its stress run"
        time.sleep(0.2)
    return sessions


def test_two_studies_one_on_a_ray_pool_write_to_one_server_at_once(server, tmp_path):
    from tests.pool.ray_head import RAY_ENV, local_ray_head

    pytest.importorskip("ray")
    plain, pooled = tmp_path / "plain", tmp_path / "pooled"
    with local_ray_head(free_port) as address:
        procs = {
            "team-plain": (
                plain,
                sweep(plain, server.uri, "team-plain", *local_cluster_overrides(plain), *SMALL),
            ),
            "team-pooled": (
                pooled,
                sweep(
                    pooled,
                    server.uri,
                    "team-pooled",
                    "hydra/launcher=heisenhunt_ray",
                    f"hydra.launcher.ray.init.address={address}",
                    *pool_overrides(pooled),
                    *SMALL,
                    env=RAY_ENV,
                ),
            ),
        }
        try:
            outs = {study: finish(proc, 420) for study, (_, proc) in procs.items()}
        finally:
            for _, proc in procs.values():
                kill_if_running(proc)
    for study, (root, proc) in procs.items():
        assert proc.returncode == 0, (study, outs[study][-4000:])
        runs = arm_runs(server.uri, study)
        assert runs and all(r.info.status == "FINISHED" for r in runs), [
            (r.info.run_name, r.info.status) for r in runs
        ]
        assert {r.data.tags["study"] for r in runs} == {study}  # each study in its own experiment
        assert rebuilt_report(root, server.uri, study) == written_report(root, study)
        assert not no_servers_left(root)
    members = {r.data.tags.get("cluster_pool.member") for r in arm_runs(server.uri, "team-pooled")}
    assert members == set(POOL_MEMBERS)  # the pool ran arms on both clusters


def test_a_server_that_crashes_mid_stress_and_comes_back_loses_nothing(server, tmp_path):
    """The server is killed while the first arm is in its stress run and started again over the same
    database a few seconds later: the sweep waits on MLflow's retries, and every session measured is in
    the server in the end."""
    root = tmp_path / "study"
    extra = [*local_cluster_overrides(root), "workload.rounds=1", "bench.enabled=false"]
    # one arm: the outage lands in its stress, and a second arm would only add writes after it
    extra += ["workload.sessions=24", "workload.concurrency=2", "repetition=0", "factor/multi_stream=on"]
    proc = sweep(root, server.uri, "team-crash", *extra)
    try:
        mid_stress(proc, root)
        server.stop(signal.SIGKILL)
        time.sleep(5)
        server.start()
        out = finish(proc, 420)
    finally:
        kill_if_running(proc)
        if server.proc is None or server.proc.poll() is not None:
            server.start()  # the module's other tests need it
    assert proc.returncode == 0, out[-4000:]
    # the outage was felt: the first arm's writes were refused and retried
    assert "Connection refused" in (root / "multirun" / "0" / "__main__.log").read_text()
    runs = arm_runs(server.uri, "team-crash")
    assert runs and all(r.info.status == "FINISHED" for r in runs), [
        (r.info.run_name, r.info.status) for r in runs
    ]
    on_disk = sessions_on_disk(root)
    # one run per job dir, each with every session its job wrote to disk
    assert sorted(on_disk.values()) == sorted(int(r.data.metrics["sessions_total"]) for r in runs), on_disk
    assert rebuilt_report(root, server.uri, "team-crash") == written_report(root, "team-crash")
    assert not no_servers_left(root)


def test_results_measured_while_the_server_is_down_past_its_retries_are_sent_on_resume(server, tmp_path):
    """The server goes down mid-stress and stays down past the client's retries (here none) until the sweep
    has ended: the arm runs to its end, its writes kept in the outbox; the server comes back, and the
    study resumed sends them first: the arm's run ends FINISHED with every session measured, and is not
    run again."""
    root, outbox = tmp_path / "study", tmp_path / "outbox"
    extra = [*local_cluster_overrides(root), "workload.rounds=1", "bench.enabled=false", "repetition=0"]
    extra += ["workload.sessions=24", "workload.concurrency=2", "factor/multi_stream=on"]
    extra += [f"tracking.outbox_dir={outbox}"]
    no_retries = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    proc = sweep(root, server.uri, "team-outbox", *extra, env=no_retries)
    try:
        sessions = mid_stress(proc, root)
        server.stop(signal.SIGKILL)
        out = finish(proc, 420)  # the sweep ends with the server still down: no report
    finally:
        kill_if_running(proc)
        server.start()
    assert proc.returncode != 0, out[-4000:]
    job_log = (root / "multirun" / "0" / "__main__.log").read_text()
    assert "results kept in" in job_log and "resume=true" in job_log, job_log[-3000:]
    [kept] = [p for p in (outbox / "team-outbox").iterdir() if p.is_dir()]
    measured = sessions.read_text().count("\n")

    proc = sweep(root, server.uri, "team-outbox", *extra, "resume=true", env=no_retries)
    try:
        out = finish(proc, 420)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-4000:]
    [run] = arm_runs(server.uri, "team-outbox")  # sent, and not run again
    assert run.info.run_id == kept.name and run.info.status == "FINISHED"
    assert int(run.data.metrics["sessions_total"]) == measured == 24
    assert run.data.tags["outcomes"] == "complete"
    client = MlflowClient(server.uri)
    sent = client.download_artifacts(run.info.run_id, "stress/sessions.jsonl", str(tmp_path))
    assert Path(sent).read_text() == sessions.read_text()
    assert not kept.exists()
    assert rebuilt_report(root, server.uri, "team-outbox") == written_report(root, "team-outbox")
    assert not no_servers_left(root)
