"""The test SLURM itself (conftest.py): a batch job and an interactive step run on the loopback node, and
scancel and a time limit end jobs with the states the launcher reads back."""

from __future__ import annotations

import socket
import time

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]


def test_sbatch_and_srun_run_on_the_loopback_node(slurm, tmp_path):
    assert slurm.run("srun", "hostname").strip() == socket.gethostname().split(".")[0]
    out = tmp_path / "out.txt"
    job = slurm.run(
        "sbatch", "--parsable", "-o", str(out), "--wrap", "echo $SLURM_JOB_ID $SLURM_JOB_NODELIST"
    )
    job = job.strip().split(";")[0]
    assert not slurm.wait_empty(30)
    assert out.read_text().split() == [job, socket.gethostname().split(".")[0]]
    assert slurm.job(job)["JobState"] == "COMPLETED"


def test_scancel_ends_a_running_job_cancelled(slurm, tmp_path):
    job = slurm.run("sbatch", "--parsable", "-o", str(tmp_path / "o"), "--wrap", "sleep 300").strip()
    deadline = time.monotonic() + 30
    while slurm.job(job)["JobState"] != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    slurm.run("scancel", job)
    assert not slurm.wait_empty(30)
    assert slurm.job(job)["JobState"] == "CANCELLED"
