"""Studies whose arms run as SLURM jobs (hydra/launcher=heisenhunt_slurm, cluster=slurm) against the real
slurmctld and slurmd of conftest.py: a whole study, a job cancelled by `scancel` mid-stress, Ctrl-C of the
driver, and a job that hits its time limit. Each arm's cluster is its job's allocation (one node: every
role on it, through the local transport), with free ports and work dirs under the test's tmp_path."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import mlflow
import pytest

from tests.conftest import sim_clock
from tests.test_study import SMALL, finish, kill_if_running, no_servers_left, orchestrator

# one SLURM for the module (loadgroup: on one pytest worker); each test runs whole studies as jobs
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(900)]
NODE = socket.gethostname().split(".")[0]
ON_SLURM = ("cluster=slurm", "hydra/launcher=heisenhunt_slurm", "hydra.launcher.poll_s=0.5")


def arm_runs(tmp_path: Path, study: str = "quick") -> list:
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.get_experiment_by_name(study)
    assert experiment is not None
    return [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]


def servers_of(tmp_path: Path) -> list[str]:
    """Processes still running from this test's work dirs (sim servers, routers), by their command line."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if str(tmp_path) in line and "pytest" not in line]


def stressing_job(slurm, tmp_path: Path, timeout: float = 240) -> str:
    """The id of the SLURM job running now (one at a time: --exclusive) once its arm is mid-stress."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for sessions in (tmp_path / "multirun").glob("*/stress/sessions.jsonl"):
            if sessions.read_text().strip() and not (sessions.parents[1] / "bench").exists():
                running = slurm.run("squeue", "-h", "-t", "RUNNING", "-o", "%i").split()
                if len(running) == 1:
                    return running[0]
        time.sleep(0.5)
    pytest.fail(f"no arm reached its stress in {timeout}s; queue {slurm.queue()}")


def test_a_study_runs_each_arm_as_a_slurm_job(slurm, tmp_path):
    # two arms, each with a start of its own (a job each); more repetitions would only queue more jobs
    # (each ~15 s of the SLURM worker's time: a second repetition added two and showed nothing more)
    proc = orchestrator(tmp_path, *ON_SLURM, *SMALL, "factor/multi_stream=on,off", "repetition=0")
    try:
        out = finish(proc, 900)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 0, out[-5000:]
    runs = arm_runs(tmp_path)
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}, out[-3000:]
    # each arm its own SLURM job, its provenance on its run
    assert len({r.data.tags["slurm.job_id"] for r in runs}) == 2
    assert {(r.data.tags["slurm.nodes"], r.data.tags["slurm.partition"]) for r in runs} == {(NODE, "debug")}
    assert {r.data.tags["cluster"] for r in runs} == {"slurm"}
    report = json.loads((tmp_path / "reports" / "quick" / "report.json").read_text())
    assert [h["id"] for h in report["hypotheses"]] == ["H-multistream"]
    assert not slurm.wait_empty(30)
    assert not no_servers_left(tmp_path) and not servers_of(tmp_path)


def one_of_two_arms_ended_mid_stress(slurm, tmp_path: Path, end_job) -> tuple[str, object]:
    """A study of two arms (one repetition each), the first long enough to be ended mid-stress by
    `end_job(job_id)`; the sweep must go on and run the other to its end, leaving nothing running.
    Returns the ended job's id and its arm's run."""
    # one session at a time (~0.3 s each) makes the stress last ~10 s, not many sessions: the other arm
    # runs all of them (400 at once ran 400 for nothing)
    proc = orchestrator(
        tmp_path, *ON_SLURM, *SMALL, "hydra.sweeper.default_params.repetition=0", "workload.sessions=32",
        "workload.concurrency=1",
    )  # fmt: skip
    try:
        job = stressing_job(slurm, tmp_path)
        end_job(job)
        out = finish(proc, 900)
    finally:
        kill_if_running(proc)
    runs = {r.data.tags["slurm.job_id"]: r for r in arm_runs(tmp_path)}
    ended = runs.pop(job)
    assert ended.info.status == "FAILED", out[-3000:]
    assert [r.info.status for r in runs.values()] == ["FINISHED"], out[-3000:]
    assert not slurm.wait_empty(30)
    assert not no_servers_left(tmp_path) and not servers_of(tmp_path)
    return job, ended


def test_a_job_cancelled_by_scancel_mid_stress_is_one_failed_arm(slurm, tmp_path):
    job, run = one_of_two_arms_ended_mid_stress(slurm, tmp_path, lambda job: slurm.run("scancel", job))
    reason = run.data.tags["failure_reason"]
    assert "cancelled by SLURM" in reason and f"SLURM job {job}" in reason, reason
    assert slurm.job(job)["JobState"] == "CANCELLED"


def test_ctrl_c_of_the_driver_cancels_every_job_and_leaves_nothing_running(slurm, tmp_path):
    # two arms: one to stop mid-stress, one queued behind it (each of the sweep's six would be a job)
    proc = orchestrator(
        tmp_path, *ON_SLURM, *SMALL, "hydra.sweeper.default_params.repetition=0", "workload.sessions=400",
        "workload.concurrency=2",
    )  # fmt: skip
    try:
        stressing_job(slurm, tmp_path)
        assert len(slurm.queue()) == 2  # one running, one queued behind it (--exclusive)
        proc.send_signal(signal.SIGINT)
        out = finish(proc, 300)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 130, out[-3000:]
    assert not slurm.queue(), out[-3000:]  # nothing left in SLURM the moment the driver is gone
    runs = arm_runs(tmp_path)
    # the running arm was stopped (KILLED, as under the basic launcher); the queued ones never started
    assert [r.info.status for r in runs] == ["KILLED"], out[-3000:]
    assert not no_servers_left(tmp_path) and not servers_of(tmp_path)


def test_a_job_past_its_time_limit_is_a_failed_arm_saying_so(slurm, tmp_path):
    # a one-minute limit (SLURM's smallest) on an arm that needs longer: one session at a time, on the
    # modelled hardware's clock (~1.4 s a session, not 0.3), so that the minute it waits for is not a
    # minute of the suite's CPU
    proc = orchestrator(
        tmp_path,
        *ON_SLURM,
        *SMALL,
        *sim_clock(1.0),
        "hydra.sweeper.default_params.repetition=0",
        "factor/multi_stream=on",
        "hydra.launcher.sbatch.time=1",
        "hydra.launcher.sbatch.signal_delay_s=5",
        "workload.sessions=5000",
        "workload.concurrency=1",
    )
    try:
        out = finish(proc, 600)
    finally:
        kill_if_running(proc)
    [run] = arm_runs(tmp_path)
    assert run.info.status == "FAILED", out[-3000:]
    assert "time limit" in run.data.tags["failure_reason"], run.data.tags["failure_reason"]
    assert not slurm.wait_empty(30)
    assert not no_servers_left(tmp_path) and not servers_of(tmp_path)


def test_a_job_killed_outright_is_a_failed_arm_and_its_servers_are_stopped(slurm, tmp_path):
    # SIGKILL to the arm's process (as a lost node or a KillWait passed would): no teardown, so the
    # launcher ends its run FAILED and stops the servers it left from their pid files

    def kill_the_arms_process(job: str) -> None:
        # the arm's own process (submitit's, in the job's step; one job runs at a time: --exclusive, its
        # folder passed as `.slurm/%j`), SIGKILLed: no teardown, no result
        ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
        ps = [line.split(None, 1) for line in ps.splitlines()[1:]]
        [pid] = [
            int(p)
            for p, args in ps
            if "submitit.core._submit" in args and str(tmp_path) in args and "srun" not in args
        ]
        os.kill(pid, signal.SIGKILL)

    _, run = one_of_two_arms_ended_mid_stress(slurm, tmp_path, kill_the_arms_process)
    assert "before the arm could return" in run.data.tags["failure_reason"], run.data.tags
