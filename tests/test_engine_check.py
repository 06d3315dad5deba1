"""The engine's own view of an arm: judging the host's probe answer (pure), `preflight_only=true` on the
embedded default (the simulator's parser and env registry, real processes, nothing started), and, after
start-up, the running server's /server_info confirming each flag a factor set (a real sim arm whose
decode overrides one, as real sglang's argument resolution sometimes does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from orchestrator.arm import ArmStart, StressThenBench, prepare, run_arm
from orchestrator.config.load import load_job
from orchestrator.remote.local import LocalTransport
from orchestrator.run.preflight import confirm_server_args, judge_role
from orchestrator.tracking.write import ArmTracker
from tests.conftest import listening, plan_of, preflight_only, typo_level, typo_refusal

SMALL = ("workload.sessions=4", "workload.rounds=2", "bench.enabled=false")
INDEX_K = "SGLANG_DSV4_BF16_INDEX_K"


def _answer(**overrides):
    answer = {
        "sglang": "0.5.23",
        "parser": "ok",
        "parser_detail": "",
        "env": {INDEX_K: {"read_in": "", "nearest": ["SGLANG_DSV4_FP4_EXPERTS"]}},
        "env_scanned": "sglang.srt.environ's 770 names and 4719 source files under /x/sglang",
        "backends": {},
    }
    return answer | overrides


OK = {"status": "ok", "abbreviated": {}, "deprecated": [], "parsed": {}}


def test_an_unread_variable_is_refused_naming_its_level_file_host_version_and_nearest_names(compose_cfg):
    plan = plan_of(compose_cfg("deployment=sglang_dsv4", "factor/index_k=bf16"))
    judged = judge_role(plan, "decode", "gpu-node-3", "/opt/sglang/bin/python", _answer(), OK)
    (problem,) = judged.problems
    assert problem.startswith("decode on gpu-node-3 (sglang 0.5.23 for /opt/sglang/bin/python): ")
    assert f"{INDEX_K} is read nowhere in this build" in problem
    assert "factor.index_k (level bf16).roles.decode.env in " in problem
    assert problem.count("conf/factor/index_k/bf16.yaml") == 1
    assert "Nearest names this build reads: SGLANG_DSV4_FP4_EXPERTS." in problem
    assert "Read by: the patched DeepSeek-V4-Flash build" in problem and "+experiment=dsv4_stock" in problem
    # read (registry or source): nothing to say
    read = _answer(env={INDEX_K: {"read_in": "sglang/srt/models/deepseek_v4.py", "nearest": []}})
    assert judge_role(plan, "decode", "h", "python", read, OK).problems == ()


def test_version_and_missing_sglang_against_the_deployments_stated_version(compose_cfg):
    plan = plan_of(compose_cfg("deployment=sglang_dsv4", "factor/index_k=stock"))
    assert plan.sglang_version == "==0.5.23"
    (other,) = judge_role(plan, "prefill", "h", "py", _answer(sglang="0.5.17"), OK).problems
    assert "written for sglang==0.5.23 (deployment.sglang_version), not 0.5.17" in other
    absent = _answer(sglang=None, parser="absent", parser_detail="No module named 'sglang'")
    (none,) = judge_role(plan, "prefill", "h", "py", absent, OK).problems
    assert "has no sglang" in none and "cluster.hosts.prefill.python" in none
    # the simulated deployments state no version: a host without sglang is a note there
    sim = plan_of(compose_cfg("factor/index_k=stock"))
    assert judge_role(sim, "prefill", "h", "py", absent, OK).problems == ()


def test_a_transfer_backend_that_does_not_import_is_refused_with_its_origin(compose_cfg):
    plan = plan_of(compose_cfg("deployment=sglang_dsv4", "factor/index_k=stock"))
    parsed = {"--disaggregation-transfer-backend": ["disaggregation_transfer_backend", "nixl"]}
    missing = {"nixl": {"module": "nixl._api", "error": "ModuleNotFoundError: No module named 'nixl'"}}
    (problem,) = judge_role(
        plan, "decode", "h", "py", _answer(backends=missing), OK | {"parsed": parsed}
    ).problems
    assert "transfer backend nixl" in problem and "deployment.roles.decode.flags" in problem
    assert "`import nixl._api` fails (ModuleNotFoundError" in problem
    # a role without the flag gets sglang's default, mooncake
    mooncake = {"mooncake": {"module": "mooncake.engine", "error": "ModuleNotFoundError: mooncake"}}
    (default,) = judge_role(plan, "decode", "h", "py", _answer(backends=mooncake), OK).problems
    assert "transfer backend mooncake" in default and "sglang's default" in default


def test_flags_refused_by_the_hosts_parser_name_the_key_that_set_them(compose_cfg):
    plan = plan_of(compose_cfg("deployment=sglang_dsv4", "factor/index_k=stock", "factor/capture=eager"))
    refused = {"status": "refused", "detail": "unrecognized arguments: --disable-decode-cuda-graph"}
    (problem,) = judge_role(plan, "decode", "h", "py", _answer(), refused).problems
    assert (
        "--disable-decode-cuda-graph" in problem
        and "factor.capture (level eager).roles.decode.flags" in problem
    )
    abbreviated = OK | {"abbreviated": {"--hicache-rat": ["--hicache-ratio"]}}
    (short,) = judge_role(plan, "prefill", "h", "py", _answer(), abbreviated).problems
    assert "--hicache-rat is not a full flag" in short and "--hicache-ratio" in short


def test_the_running_servers_view_confirms_each_flag_a_factor_set(compose_cfg):
    plan = plan_of(compose_cfg("factor/capture=eager", "factor/hicache=on"))
    parsed = {
        "--disable-decode-cuda-graph": ["disable_decode_cuda_graph", True],
        "--cuda-graph-max-bs-decode": ["cuda_graph_max_bs_decode", 32],  # the deployment's: not checked
    }
    expected = {
        "decode": judge_role(plan, "decode", "h", "py", _answer(env={}), OK | {"parsed": parsed}).expected,
        "prefill": {
            "--hicache-ratio": ("hicache_ratio", 2.0),
            "--enable-hierarchical-cache": ("enable_hierarchical_cache", True),
        },
    }
    assert expected["decode"] == {"--disable-decode-cuda-graph": ("disable_decode_cuda_graph", True)}
    taken = {
        "decode": {"disable_decode_cuda_graph": True},
        "prefill": {"hicache_ratio": 2, "enable_hierarchical_cache": True},
    }
    assert confirm_server_args(plan, expected, taken) == ([], [])
    overridden = taken | {"decode": {"disable_decode_cuda_graph": False}}
    (problem,), _ = confirm_server_args(plan, expected, overridden)
    assert problem.startswith("decode: the running server has disable_decode_cuda_graph=False")
    assert "factor.capture (level eager).roles.decode.flags" in problem and "did not take" in problem
    # a bool is not a number here: 1 is not True
    (_,), _ = confirm_server_args(plan, expected, taken | {"decode": {"disable_decode_cuda_graph": 1}})
    problems, notes = confirm_server_args(plan, expected, {"decode": {}, "prefill": None})
    assert problems == [] and len(notes) == 2 and "no /server_info" in notes[1]


def test_preflight_only_checks_every_arm_on_its_hosts_and_starts_nothing(tmp_path):
    proc = preflight_only(tmp_path, "+experiment=dsv4_corruption", timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "preflight of study dsv4_corruption (ofat): 5 arm(s) of 20 job(s) accepted by their hosts" in out
    assert "nothing was started or stopped" in out


def test_a_misspelled_variable_is_refused_on_the_embedded_default_too(tmp_path):
    """The simulator's registry: its own names and real sglang's (orchestrator/sim/envs.py)."""
    searchpath, path = typo_level(tmp_path)
    proc = preflight_only(tmp_path, searchpath, "factor/multi_stream=on,typo", timeout=180)
    assert "orchestrator.sim.envs:READ_NAMES" in typo_refusal(proc, path)


def _one_arm(compose_cfg, tmp_path: Path, *overrides: str) -> tuple[ArmStart, dict, Any]:
    """One arm of the quick study run on the embedded default: (its start, its summary, its MLflow run)."""
    job = load_job(compose_cfg(*overrides, *SMALL))
    start = prepare(job, finished=set())
    assert isinstance(start, ArmStart)
    tracker = ArmTracker.start(job.tracking, job.study, start.plan, start.repetition, None)
    transports = {r: LocalTransport() for r in start.plan.roles}
    summary = run_arm(start, transports, tracker, StressThenBench(0), tmp_path / "job")
    return start, summary, MlflowClient(job.tracking.uri).get_run(tracker.run_id)


def test_an_arm_whose_server_did_not_take_a_factors_flag_fails(compose_cfg, tmp_path):
    """The decode's argument resolution turns graphs back on (the sim's HEISENHUNT_SIM_OVERRIDE_ARGS): the
    capture=eager arm would measure graphs, so it fails, saying which flag and factor, before any session."""
    override = json.dumps({"disable_decode_cuda_graph": False})
    start, summary, run = _one_arm(
        compose_cfg,
        tmp_path,
        "factor/capture=eager",
        f"++deployment.roles.decode.env.HEISENHUNT_SIM_OVERRIDE_ARGS='{override}'",
    )
    assert summary["status"] == "FAILED"
    reason = run.data.tags.get("failure_reason") or json.dumps(run.data.tags)
    assert "the running server has disable_decode_cuda_graph=False" in reason, reason
    assert "factor.capture (level eager)" in reason
    assert "sessions_clean" not in run.data.metrics  # no session ran on the wrong server
    assert not any(listening(p) for rp in start.plan.roles.values() for p in rp.host.ports().values())


def test_an_arm_whose_servers_took_every_flag_records_what_was_confirmed(compose_cfg, tmp_path):
    _, summary, run = _one_arm(compose_cfg, tmp_path, "factor/capture=eager", "factor/multi_stream=off")
    assert summary["status"] == "FINISHED"
    tags = run.data.tags
    assert tags["provenance.decode.args_checked"] == "--disable-decode-cuda-graph"
    assert tags["provenance.decode.args_unconfirmed"] == ""
    assert "provenance.prefill.args_checked" in tags  # HiCache's two flags (the quick study's baseline)
