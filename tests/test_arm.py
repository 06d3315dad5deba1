"""One arm as plain functions: `prepare` (pure) and `run_arm` called directly with a local transport and a
real sqlite MLflow tracker under tmp_path, against the embedded default (real sim servers behind the real
sglang-router). No Hydra app, no orchestrator subprocess."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrator.arm import ArmSkip, ArmStart, StressThenBench, prepare, run_arm
from orchestrator.config.load import load_job
from orchestrator.remote import make_transport
from orchestrator.remote.local import LocalTransport
from orchestrator.tracking.write import CORRUPTED, ArmTracker
from tests.conftest import listening, ssh_port_that_hangs_up

SMALL = ("workload.sessions=6", "workload.rounds=2", "bench.enabled=false")


def test_prepare_plans_the_arm_and_skips_it_only_on_resume_of_a_finished_run(compose_cfg):
    job = load_job(compose_cfg("factor/multi_stream=off", "repetition=2"))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart) and start.label == "multi_stream=off" and start.repetition == 2
    assert start.log_label("0123456789abcdef") == f"quick-{start.plan.signature}-r2-0123456789ab"
    done = {(start.plan.signature, 2)}
    assert isinstance(prepare(job, done), ArmStart)  # no resume: a finished run does not skip
    resumed = load_job(compose_cfg("factor/multi_stream=off", "repetition=2", "resume=true"))
    skip = prepare(resumed, done)
    assert isinstance(skip, ArmSkip) and skip.summary()["status"] == "SKIPPED"
    assert isinstance(prepare(resumed, {(start.plan.signature, 1)}), ArmStart)


def test_run_arm_runs_a_whole_arm_with_a_local_transport_and_a_sqlite_tracker(compose_cfg, tmp_path):
    job = load_job(compose_cfg("factor/multi_stream=on", *SMALL))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart)
    transports = {role: LocalTransport() for role in start.plan.roles}
    tracker = ArmTracker.start(job.tracking, job.study, start.plan, start.repetition, None)
    events: list[str] = []

    summary = run_arm(start, transports, tracker, StressThenBench(0), tmp_path / "job", events.append)

    assert summary["status"] == "FINISHED" and summary["run_id"] == tracker.run_id
    run = MlflowClient(job.tracking.uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["sessions_clean"] + m[CORRUPTED] + m["sessions_errored"] == 6
    assert m["server_ready"] == 1 and "startup_s.decode" in m
    assert run.data.params["factor.multi_stream"] == "on"
    # the origin of each setting travels with the run: the factor level that set the decode env var
    client = MlflowClient(job.tracking.uri)
    launch_json = client.download_artifacts(run.info.run_id, "launch/launch.json", str(tmp_path))
    launch = json.loads(Path(launch_json).read_text())
    assert launch["decode"]["origin"]["env SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "factor.multi_stream=on"
    assert "starting prefill" in events and any("decode healthy" in e for e in events)
    # the teardown is complete: no server, no pid file, no port left behind
    assert (tmp_path / "job" / "server_logs" / "decode.log").is_file()
    for role, rp in start.plan.roles.items():
        assert not (tmp_path / role / f"{role}.pid").exists()
        assert not any(listening(port) for port in rp.host.ports().values())


def test_two_runs_of_one_arm_each_parse_only_their_own_server_start(compose_cfg, tmp_path):
    """Every start logs to its own file: a second run's captured/eager counts are its own, not the sum."""
    job = load_job(compose_cfg("factor/multi_stream=on", *SMALL))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart)
    runs = []
    for i in range(2):
        tracker = ArmTracker.start(job.tracking, job.study, start.plan, start.repetition, None)
        transports = {role: LocalTransport() for role in start.plan.roles}
        assert (
            run_arm(start, transports, tracker, StressThenBench(0), tmp_path / f"job{i}")["status"]
            == "FINISHED"
        )
        runs.append(MlflowClient(job.tracking.uri).get_run(tracker.run_id))
    logs = sorted((tmp_path / "decode" / "logs").iterdir())
    assert len(logs) == 2  # one folder per start, named after its run
    for run, job_dir in zip(runs, ("job0", "job1"), strict=True):
        text = (tmp_path / job_dir / "server_logs" / "decode.log").read_text()
        assert text.count("The server is fired up and ready to roll!") == 1
        captured = sum("cuda graph: True" in line for line in text.splitlines() if "Decode batch" in line)
        assert run.data.metrics["capture_batches"] == captured > 0
        assert any(run.info.run_id[:12] in p.name for p in logs)


def test_a_host_whose_connection_is_cut_during_the_arms_checks_fails_the_arm_not_the_sweep(
    compose_cfg, tmp_path
):
    """Fault campaign seed 33 (ssh, four studies at once): the sshd's sessions were cut as an arm checked
    its hosts; the error escaped the arm, Hydra ended the sweep after its batch, and no report was written.
    The arm is now one FAILED run saying why, with nothing started, and returns to the sweep."""
    job = load_job(compose_cfg("factor/multi_stream=on", *SMALL))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart)
    tracker = ArmTracker.start(job.tracking, job.study, start.plan, start.repetition, None)
    with ssh_port_that_hangs_up() as port:
        cut = make_transport(
            {"transport": "ssh", "address": "127.0.0.1", "ssh": {"port": port, "config_file": "/nonexistent"}}
        )
        transports = {role: LocalTransport() for role in start.plan.roles} | {"decode": cut}
        summary = run_arm(start, transports, tracker, StressThenBench(0), tmp_path / "job")

    assert summary["status"] == "FAILED"
    run = MlflowClient(job.tracking.uri).get_run(tracker.run_id)
    assert run.info.status == "FAILED"
    reason = run.data.tags["failure_reason"]
    assert "could not check the arm on its hosts" in reason and "SSH handshake" in reason, reason
    for rp in start.plan.roles.values():  # nothing was started
        assert not any(listening(port) for port in rp.host.ports().values())


def test_a_signal_held_by_the_teardown_still_stops_the_sweep_when_the_arm_then_fails():
    """A Ctrl-C held while the servers were stopped is raised once the arm is recorded; when the arm then
    ended on an error, not on its own, the signal was dropped with the guard and the sweep went on (found
    by the fault campaign: an interrupt that became a store error let the study run on)."""
    import os
    import signal
    import time

    import pytest

    from orchestrator.arm import InterruptGuard

    guard = InterruptGuard()
    with pytest.raises(KeyboardInterrupt, match="held during the teardown"), guard.installed():
        with guard.shield():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the signal lands in the teardown, and waits
        raise RuntimeError("the arm failed after its teardown")


def test_a_signal_held_while_the_run_is_created_says_so():
    """The job's guard holds a signal while the arm's MLflow run is created; the interrupt it then raises
    names that phase, not the teardown (CI at 316548b said "held during teardown" for it)."""
    import os
    import signal
    import time

    import pytest

    from orchestrator.arm import InterruptGuard

    guard = InterruptGuard()
    with guard.installed():
        with guard.shield("creation of its MLflow run"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            assert guard.pending == signal.SIGINT  # held, not raised
        with pytest.raises(
            KeyboardInterrupt, match=r"^signal 2 \(held during the creation of its MLflow run\)$"
        ):
            guard.raise_pending()
