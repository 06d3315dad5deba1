"""Every config group composes; bad config is refused with a message naming the key and what is accepted."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from orchestrator.config.catalog import discover_factor_levels
from orchestrator.config.load import ConfigError, hydra_runtime, load_job
from tests.conftest import plan_of

SHIPPED_FACTORS = {
    "capture": ["eager", "graph"],
    "hicache": ["off", "on"],
    # stock: no variable set (stock sglang reads none: experiments/dsv4_stock.yaml)
    "index_k": ["bf16", "fp8", "stock"],
    "multi_stream": ["off", "on"],
    # the GPU decode engine's fix (experiments/gpu_race.yaml)
    "indexer_fix": ["none", "record_stream"],
    # SGLang's deterministic inference (experiments/real_determinism.yaml)
    "determinism": ["off", "on"],
}


def test_the_shipped_factors_ship_with_their_levels(compose_cfg):
    compose_cfg()
    assert discover_factor_levels() == SHIPPED_FACTORS


@pytest.mark.parametrize("factor", sorted(SHIPPED_FACTORS))
def test_every_factor_level_composes_validates_and_plans(compose_cfg, factor):
    # a factor outside the primary config's defaults list is added with `+`
    add = "" if factor in compose_cfg().factor else "+"
    for level in SHIPPED_FACTORS[factor]:
        cfg = compose_cfg(f"{add}factor/{factor}={level}")
        load_job(cfg)
        assert plan_of(cfg).factors[factor] == level


@pytest.mark.parametrize(
    "group,option",
    [
        ("cluster", "local"),
        ("deployment", "sim_dsv4"),
        ("deployment", "sglang_dsv4"),
        ("workload", "stress"),
        ("bench", "sweep"),
        ("tracking", "sqlite"),
    ],
)
def test_every_config_group_option_composes(compose_cfg, group, option):
    cfg = compose_cfg(f"{group}={option}")
    plan_of(cfg)


def test_the_shipped_study_composes_with_four_hypotheses(compose_cfg):
    cfg = compose_cfg("+experiment=dsv4_corruption")
    load_job(cfg)
    assert cfg.study.name == "dsv4_corruption"
    assert [h.id for h in cfg.study.hypotheses] == ["H-multistream", "H-capture", "H-bf16", "H-hicache"]
    assert cfg.hydra.sweeper.design == "ofat"


def test_the_default_run_is_a_multirun_study(compose_cfg):
    cfg = compose_cfg()
    assert cfg.hydra.mode.name == "MULTIRUN"
    assert cfg.hydra.sweeper.default_params


def test_unknown_level_is_refused_by_composition_naming_the_options(compose_cfg):
    with pytest.raises(MissingConfigException) as err:
        compose_cfg("factor/multi_stream=maybe")
    assert "factor/multi_stream" in str(err.value) and "off" in str(err.value) and "on" in str(err.value)


def test_unknown_factor_is_refused_naming_the_known_factors(compose_cfg):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("factor/warp_drive=on")
    assert "factor/warp_drive" in str(err.value)
    message = _problems(compose_cfg, "+factor/warp_drive=on")
    assert "factor/warp_drive" in message and "'multi_stream'" in message


def _problems(compose_cfg, *overrides) -> str:
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        plan_of(cfg)
    return str(err.value)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["+deployment.roles.decode.env.bad-name=1"],
            ["deployment.roles.decode.env", "'bad-name'", "[A-Z_][A-Z0-9_]*"],
        ),
        (["+deployment.roles.decode.env.lower=1"], ["'lower'", "[A-Z_][A-Z0-9_]*"]),
        (
            ["++deployment.roles.prefill.flags={disable-x: null}"],
            ["deployment.roles.prefill.flags", "'disable-x'", "must start with '--'"],
        ),
        (
            ["++deployment.roles.prefill.flags={--log-level: 'info;reboot'}"],
            ["--log-level", "shell metacharacter"],
        ),
        (
            ["study.hypotheses.0.factor=warp_drive"],
            ["study.hypotheses[0]", "unknown factor 'warp_drive'", "'multi_stream'"],
        ),
        (["study.hypotheses.0.treatment=maybe"], ["treatment", "unknown level 'maybe'", "['off', 'on']"]),
        (["study.baseline.capture=turbo"], ["study.baseline.capture", "'turbo'", "['eager', 'graph']"]),
        (
            ["cluster.hosts.decode.transport=telnet"],
            ["cluster.hosts.decode.transport", "'telnet'", "['local', 'ssh']"],
        ),
        (["study.test=bayes"], ["study.test", "['fisher', 'boschloo']"]),
        (
            ["cluster.hosts.decode.port=8998", "cluster.hosts.prefill.bootstrap_port=8998"],
            [
                "cluster.hosts.decode.port: port 8998 on 127.0.0.1",
                "is also cluster.hosts.prefill.bootstrap_port",
            ],
        ),
    ],
)
def test_bad_config_is_refused_naming_the_key_and_what_is_accepted(compose_cfg, overrides, expected):
    message = _problems(compose_cfg, *overrides)
    for fragment in expected:
        assert fragment in message, message


def test_yaml_booleans_for_on_off_levels_get_a_quoting_hint(compose_cfg):
    message = _problems(compose_cfg, "study.baseline.multi_stream=true")
    assert "quote the level" in message


def test_a_factor_flag_may_not_collide_with_cluster_topology(compose_cfg):
    message = _problems(compose_cfg, "++deployment.roles.decode.flags={--port: 1234}")
    assert "--port" in message and "cluster.hosts" in message


def test_a_users_own_factor_on_the_searchpath_is_known(compose_cfg, tmp_path):
    for level, value in (("slow", "1"), ("fast", "0")):
        path = tmp_path / "myconf" / "factor" / "warp" / f"{level}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'level: {level}\nroles:\n  decode: {{env: {{WARP_SLOW: "{value}"}}}}\n')
    searchpath = f"hydra.searchpath=[file://{tmp_path}/myconf]"
    cfg = compose_cfg(searchpath, "+factor/warp=fast", "+study.baseline.warp=slow")
    load_job(cfg)  # the baseline names the user's factor: known through the job's search path
    assert discover_factor_levels(hydra_runtime(cfg).searchpath)["warp"] == ["fast", "slow"]
    assert plan_of(cfg).roles["decode"].env["WARP_SLOW"] == "0"
    message = _problems(compose_cfg, searchpath, "+factor/warp=fast", "+study.baseline.warp=turbo")
    assert "study.baseline.warp" in message and "['fast', 'slow']" in message


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["study.stopping.min_runs_per_arm=0"],
            ["study.stopping", "min_runs_per_arm=0", "1 <= min_runs_per_arm <= max_runs_per_arm"],
        ),
        (
            ["study.stopping.min_runs_per_arm=4", "study.stopping.max_runs_per_arm=3"],
            ["min_runs_per_arm=4", "max_runs_per_arm=3"],
        ),
        (["study.stopping.max_sessions=10"], ["study.stopping.max_sessions: 10", "workload.sessions=80"]),
        (
            ["study.stopping.max_run_sessions=40"],
            ["study.stopping.max_run_sessions: 40", "at least workload.sessions=80"],
        ),
        (["study.stopping.icc_confidence=1.5"], ["study.stopping.icc_confidence: 1.5", "between 0 and 1"]),
        (["study.cost.restart_s=-1"], ["study.cost.restart_s: -1.0 must be >= 0"]),
        (["deployment.cost.gpus=-8"], ["deployment.cost.gpus: -8 must be >= 0"]),
    ],
)
def test_a_sequential_budget_that_cannot_run_is_refused(compose_cfg, overrides, expected):
    message = _problems(compose_cfg, *overrides)
    for text in expected:
        assert text in message, message
