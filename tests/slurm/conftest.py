"""A real single-node SLURM for the tests: slurmctld and slurmd (Debian's slurm-wlm) with a private munged,
on 127.0.0.1, configured and started by `scripts/slurm-local.sh` in a temporary directory for the whole
session, and stopped (only the daemons it started) in `finally`.

`slurm`: the running instance; its `SLURM_CONF` is set in this process's environment for the session, so
`sbatch`, `srun`, `squeue`, `scancel` and the orchestrator started by a test all reach it. The tests skip,
saying why, only where the binaries are absent (`.ci/run` and `scripts/slurm-local.sh install` install
them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.services import record_service_start

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "slurm-local.sh"
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "squeue", "scancel", "scontrol")


@dataclass
class Slurm:
    dir: Path
    conf: Path
    start_s: float

    def run(self, *argv: str, timeout: float = 30) -> str:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "SLURM_CONF": str(self.conf)},
        )
        assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"
        return done.stdout

    def queue(self) -> list[str]:
        """The ids of the jobs SLURM still has pending or running."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def wait_empty(self, timeout: float = 60) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.queue()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of one job, as key=value pairs (finished jobs stay MinJobAge, 600 s)."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(word.split("=", 1) for word in out.split() if "=" in word)


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]


@pytest.fixture(scope="session")
def slurm() -> Iterator[Slurm]:
    why = []
    if missing := _missing():
        why.append(f"SLURM is not installed ({', '.join(missing)} missing): scripts/slurm-local.sh install")
    if os.geteuid() != 0:
        why.append("the test SLURM runs its daemons as root (SlurmUser=root)")
    if why:
        if os.environ.get("HEISENHUNT_REQUIRE_SLURM"):  # CI installs it: never skip there
            pytest.fail("; ".join(why))
        pytest.skip("; ".join(why))
    workdir = Path(tempfile.mkdtemp(prefix="hh-slurm-"))
    env = {
        **os.environ,
        "HH_SLURM_DIR": str(workdir),
        "HH_SLURM_CTLD_PORT": str(free_port()),
        "HH_SLURM_D_PORT": str(free_port()),
    }
    started = time.monotonic()
    done = subprocess.run([str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=120)
    start_s = time.monotonic() - started
    record_service_start("slurm (slurmctld, slurmd, munged)", start_s)
    try:
        assert done.returncode == 0, f"slurm-local.sh start failed:\n{done.stderr}\n{_logs(workdir)}"
        conf = workdir / "slurm.conf"
        previous = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(conf)
        try:
            yield Slurm(workdir, conf, start_s)
        finally:
            if previous is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = previous
    finally:
        subprocess.run([str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=60)
        shutil.rmtree(workdir, ignore_errors=True)


def _logs(workdir: Path) -> str:
    return "\n".join(
        f"--- {log.name}\n{log.read_text(errors='replace')[-2000:]}" for log in sorted(workdir.glob("*.log"))
    )
