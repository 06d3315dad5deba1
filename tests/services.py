"""How long each service a test starts (PostgreSQL, MLflow's server, Ray, sshd, SLURM) took to start: a line
per start in the file HEISENHUNT_SERVICE_TIMES names, which `.ci/run` prints at its end."""

from __future__ import annotations

import os


def record_service_start(name: str, seconds: float) -> None:
    path = os.environ.get("HEISENHUNT_SERVICE_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{name}: started in {seconds:.1f} s\n")
