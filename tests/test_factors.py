"""Arm planning: factor levels -> env/argv per role, and a signature that pools identical arms."""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
from hydra.errors import HydraException

from orchestrator.config.plan import flag_words, merge_role, signature
from orchestrator.config.schema import FactorLevel, FactorRoles, RoleDelta, RoleLaunch, SelectedLevel
from orchestrator.study.designs import ofat_overrides
from tests.conftest import plan_of


def test_levels_land_on_the_roles_the_factor_names(compose_cfg):
    plan = plan_of(
        compose_cfg(
            "factor/capture=eager", "factor/multi_stream=off", "factor/index_k=fp8", "factor/hicache=on"
        )
    )
    decode, prefill = plan.roles["decode"], plan.roles["prefill"]
    assert "--disable-decode-cuda-graph" in decode.argv and "--disable-decode-cuda-graph" not in prefill.argv
    assert "--disable-cuda-graph" not in decode.argv  # deprecated in 0.5.23: it turns prefill graphs off too
    assert decode.env["SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] == "0"
    assert "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP" not in prefill.env
    assert prefill.env["SGLANG_DSV4_BF16_INDEX_K"] == decode.env["SGLANG_DSV4_BF16_INDEX_K"] == "0"
    i = prefill.argv.index("--hicache-ratio")
    assert prefill.argv[i + 1] == "2.0" and "--enable-hierarchical-cache" in prefill.argv
    # the shipped deployment keeps the overlap schedule off on both roles
    assert "--disable-overlap-schedule" in prefill.argv and "--disable-overlap-schedule" in decode.argv
    assert plan.factors == {"capture": "eager", "hicache": "on", "index_k": "fp8", "multi_stream": "off"}


def test_router_is_wired_to_prefill_with_its_bootstrap_port_and_to_decode(compose_cfg):
    cfg = compose_cfg()
    argv = plan_of(cfg).roles["router"].argv
    hosts = cfg.cluster.hosts
    i = argv.index("--prefill")
    assert argv[i + 1 : i + 3] == [
        f"http://127.0.0.1:{hosts.prefill.port}",
        str(hosts.prefill.bootstrap_port),
    ]
    assert argv[argv.index("--decode") + 1] == f"http://127.0.0.1:{hosts.decode.port}"
    assert "--pd-disaggregation" in argv


def test_signature_ignores_ports_and_key_order_but_not_levels(compose_cfg):
    a = plan_of(compose_cfg()).signature
    b = plan_of(compose_cfg()).signature  # other free ports, other work dirs
    assert a == b
    assert plan_of(compose_cfg("factor/multi_stream=off")).signature != a
    env1 = {"A": "1", "B": "2"}
    env2 = {"B": "2", "A": "1"}
    assert signature({"decode": (env1, {"--x": None, "--y": 1})}, "m") == signature(
        {"decode": (env2, {"--y": 1, "--x": None})}, "m"
    )
    assert signature({"decode": (env1, {})}, "m") != signature({"decode": (env1, {})}, "other-model")


def _level(factor: str, option: str, **decode_env: str) -> SelectedLevel:
    value = FactorLevel(level=option, roles=FactorRoles(decode=RoleDelta(env=decode_env)))
    return SelectedLevel(factor=factor, option=option, source=f"factor/{factor}={option}", value=value)


def test_two_factors_setting_one_name_differently_is_a_conflict():
    factors = {"a": _level("a", "one", X="1"), "b": _level("b", "zero", X="0")}
    problems = merge_role("decode", RoleLaunch(), factors).problems
    assert len(problems) == 1 and re.match(r"factor.b and factor.a both set decode env X", problems[0])
    merged = merge_role("decode", RoleLaunch(env={"X": "9"}), {"a": factors["a"]})
    assert merged.env == {"X": "1"}  # a factor overrides the deployment
    assert merged.origin["env X"] == "factor.a=one" and not merged.problems


def test_flag_words_switches_scalars_and_lists():
    assert flag_words({"--a": None, "--b": 2, "--c": ["x", 3]}) == ["--a", "--b", "2", "--c", "x", "3"]


def _choices(**keys):
    return OrderedDict(
        (k.replace("__", "/"), [f"{k.replace('__', '/')}={v}" for v in vs]) for k, vs in keys.items()
    )


def test_ofat_design_is_baseline_plus_one_factor_at_a_time_times_repetitions():
    choices = _choices(
        factor__capture=["graph", "eager"],
        factor__index_k=["bf16", "fp8"],
        factor__multi_stream=["on", "off"],
        factor__hicache=["on", "off"],
        repetition=["0", "1", "2"],
    )
    baseline = {"capture": "graph", "index_k": "bf16", "multi_stream": "on", "hicache": "on"}
    jobs = ofat_overrides(choices, baseline)
    assert len(jobs) == 5 * 3
    arms = {tuple(j[:4]) for j in jobs}
    assert len(arms) == 5
    base = ("factor/capture=graph", "factor/index_k=bf16", "factor/multi_stream=on", "factor/hicache=on")
    assert base in arms
    for arm in arms - {base}:
        assert sum(a != b for a, b in zip(arm, base, strict=True)) == 1


def test_ofat_treats_a_factor_pinned_to_one_level_as_a_constant():
    choices = _choices(factor__multi_stream=["on", "off"], factor__capture=["eager"], repetition=["0", "1"])
    jobs = ofat_overrides(choices, {"multi_stream": "on", "capture": "graph"})
    assert len(jobs) == 2 * 2
    assert all("factor/capture=eager" in job for job in jobs)


def test_ofat_refuses_a_baseline_level_that_is_not_swept():
    with pytest.raises(HydraException, match="not among the swept levels"):
        ofat_overrides(_choices(factor__capture=["graph", "eager"]), {"capture": "turbo"})
    with pytest.raises(HydraException, match=r"study\.baseline\.capture is not set"):
        ofat_overrides(_choices(factor__capture=["graph", "eager"]), {})


def test_problems_found_in_many_jobs_are_reported_once_saying_where():
    from hydra_plugins.heisenhunt_sweeper._core import JOB_SEP, collapse

    problems = [f"bad env{JOB_SEP}a=1", f"bad env{JOB_SEP}a=2", f"bad flag{JOB_SEP}a=2"]
    problems.append("tracking unreachable")
    assert collapse(problems, jobs=2) == [
        "bad env (every job)",
        "bad flag (in 1 of 2 jobs, e.g. [a=2])",
        "tracking unreachable",
    ]
    assert collapse([f"bad env{JOB_SEP}a=1"], jobs=1) == ["bad env"]
