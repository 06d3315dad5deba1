"""`dry_run=true`: every arm of a sweep with its exact launch commands, secrets redacted, and nothing else:
no host contacted, no server started, no MLflow run or store."""

from __future__ import annotations

import os
from pathlib import Path

from tests import warm
from tests.conftest import orchestrator_argv

SECRET = "hf_dryrun_s3cret_value"


def _dry_run(tmp_path: Path, *overrides: str) -> str:
    # a store of its own, not a seeded copy: the dry run must not create it
    argv = orchestrator_argv(
        tmp_path, "dry_run=true", *overrides, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db"
    )
    env = {**os.environ, "HH_DRY_RUN_TOKEN": SECRET}
    proc = warm.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_the_dsv4_study_dry_run_prints_five_arms_with_every_roles_command_and_starts_nothing(tmp_path):
    token = "++deployment.roles.decode.env={HF_TOKEN: '${oc.env:HH_DRY_RUN_TOKEN}'}"
    out = _dry_run(tmp_path, "+experiment=dsv4_corruption", token)
    arms = [line for line in out.splitlines() if line.startswith("arm ")]
    assert len(arms) == 5, out[-3000:]
    assert {a.split()[1] for a in arms} == {
        "baseline", "multi_stream=off", "capture=eager", "index_k=fp8", "hicache=off",
    }  # fmt: skip
    assert all("4 job(s)" in a for a in arms)  # four repetitions each
    assert out.count("--disaggregation-mode decode") == 5 and out.count("-m orchestrator.sim.router") == 5
    assert "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP=0" in out and "--disable-decode-cuda-graph" in out
    assert "HF_TOKEN='***'" in out and SECRET not in out
    assert "5 arm(s), 20 job(s)" in out
    # nothing touched: no MLflow store, no server work dir, no pid file, no report
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "reports").exists()
    assert not any((tmp_path / role).exists() for role in ("prefill", "decode", "router"))


def test_a_command_line_sweep_dry_run_lists_every_combination(tmp_path):
    out = _dry_run(tmp_path, "-m", "factor/multi_stream=on,off", "factor/capture=graph,eager")
    assert "dry run of study sweep-capture-multi_stream (design factorial)" in out
    assert sum(line.startswith("arm ") for line in out.splitlines()) == 4


def test_a_sequential_dry_run_shows_its_first_round_and_stops(tmp_path):
    """Its later rounds depend on evidence a dry run never gathers: round 0, every arm once, then done."""
    out = _dry_run(tmp_path, "+experiment=dsv4_sequential")
    arms = [line for line in out.splitlines() if line.startswith("arm ")]
    assert len(arms) == 5 and all("1 job(s)" in a for a in arms), out[-3000:]
    assert "round 0: baseline" in out and "round 0 shown" in out
    assert not (tmp_path / "mlflow.db").exists()
