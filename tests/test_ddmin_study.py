"""End to end: a ddmin study on the embedded default (`hydra.sweeper.design=ddmin`), real multiruns of
`python -m orchestrator` into tmp_path: the search's rounds are launched by Hydra, read back from the
MLflow store, and the report names the minimal set and the configuration to deploy."""

from __future__ import annotations

import json

import pytest

from tests.conftest import FAST_SIM
from tests.test_study import finish, no_servers_left, orchestrator, runs

# two of the experiment's twenty differences: the culprit and one that does nothing; the simulated
# clock at 0.05 (the search's runs are many, the fault model's rates do not depend on the clock)
DIFFERENCES = (
    "study.ddmin.differences=["
    "{id: overlap, roles: {decode: {env: {SGLANG_OPT_USE_MULTI_STREAM_OVERLAP: '1'}}}},"
    "{id: nccl_debug, roles: {prefill: {env: {NCCL_DEBUG: WARN}}, decode: {env: {NCCL_DEBUG: WARN}}}}]"
)


@pytest.mark.slow
def test_a_ddmin_study_finds_the_culprit_and_reports_the_configuration_to_deploy(tmp_path):
    proc = orchestrator(
        tmp_path, "-m", "+experiment=ddmin_serve_script", DIFFERENCES, *FAST_SIM, "bench.enabled=false"
    )
    out = finish(proc, 300)
    assert proc.returncode == 0, out[-4000:]
    report = json.loads((tmp_path / "reports" / "ddmin_serve_script" / "report.json").read_text())
    search = report["ddmin"]
    assert search["done"] and search["minimal"] == ["overlap"], search["outcome"]
    assert search["deploy"] == ["nccl_debug"]
    roles = [t["role"] for t in search["trials"]]
    assert roles[:2] == ["good", "bad"] and roles[-1] == "deploy"
    # every subset the search tried is an arm of the study, its runs in MLflow, none started twice
    arms = [r for r in runs(tmp_path, "ddmin_serve_script") if r.data.tags.get("heisenhunt.kind") == "arm"]
    keys = {(r.data.tags["signature"], r.data.tags["repetition"]) for r in arms}
    assert len(keys) == len(arms) == search["runs_started"]
    # the good configuration runs again beside the first run of the one to deploy (for the bench)
    assert sum(len(t["runs"]) for t in search["trials"]) == len(arms)
    md = (tmp_path / "reports" / "ddmin_serve_script" / "report.md").read_text()
    assert "## Delta debugging" in md and "**Minimal set: `overlap`**" in md
    assert report["headline"].startswith("Minimal cause: overlap")
    # the bad configuration without the culprit is clean, and it is the configuration to deploy
    assert report["deploy"]["label"] == "+nccl_debug"
    assert "difference.nccl_debug" in md and not no_servers_left(tmp_path)
