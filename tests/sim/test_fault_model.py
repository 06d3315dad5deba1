"""The fault model, the env/flag parsing and the throughput model: pure functions, no processes."""

from __future__ import annotations

import itertools
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from orchestrator.sim.args import parse_args
from orchestrator.sim.engine import DecodeEngine, SimCounters
from orchestrator.sim.envs import effective_env, parse_env_bool
from orchestrator.sim.faults import (
    BUILTIN_PATH,
    FaultModelError,
    RoleConfig,
    beta_quantile,
    load_fault_model,
    restart_rate,
    session_rate,
    validate_fault_model,
)
from orchestrator.sim.launch import server_launch
from orchestrator.sim.server import parse_time_scale
from tests.conftest import free_port


def role(mode: str, argv: list[str], env: dict[str, str]) -> RoleConfig:
    args = parse_args(["--model-path", "m", "--disaggregation-mode", mode, *argv])
    return RoleConfig(mode, effective_env(env)[0], vars(args))


def pair(
    capture=True, bf16=True, multi_stream=True, hicache=True, eager_flag="--disable-decode-cuda-graph"
) -> tuple[RoleConfig, RoleConfig]:
    b = "1" if bf16 else "0"
    prefill = role(
        "prefill", ["--enable-hierarchical-cache"] if hicache else [], {"SGLANG_DSV4_BF16_INDEX_K": b}
    )
    decode = role(
        "decode",
        [] if capture else [eager_flag],
        {"SGLANG_DSV4_BF16_INDEX_K": b, "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "1" if multi_stream else "0"},
    )
    return prefill, decode


@pytest.mark.parametrize(
    ("raw", "value", "warns"),
    [
        ("1", True, False),
        ("TRUE", True, False),
        ("yes", True, False),
        ("Y", True, False),
        ("0", False, False),
        ("False", False, False),
        ("no", False, False),
        ("n", False, False),
        ("", True, True),
        ("maybe", True, True),
        ("2", True, True),
        (None, True, False),
    ],
)
def test_env_bool_follows_sglang(raw, value, warns):
    got, warning = parse_env_bool(raw, default=True)
    assert got is value
    assert (warning is not None) is warns


def test_effective_env_keeps_default_and_warns_on_garbage():
    values, warnings = effective_env(
        {
            "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP": "off",
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "x",
            "SGLANG_DSV4_BF16_INDEX_K": "1",
        }
    )
    assert values["SGLANG_OPT_USE_MULTI_STREAM_OVERLAP"] is True  # default kept
    assert values["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == 300
    assert values["SGLANG_DSV4_BF16_INDEX_K"] is True
    assert len(warnings) == 2 and "SGLANG_OPT_USE_MULTI_STREAM_OVERLAP" in warnings[0]


def test_unknown_flag_is_an_argparse_error_exit_2():
    done = subprocess.run(
        server_launch(free_port(), flags=["--no-such-flag"]).argv,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in done.stderr


def test_time_scale_parsing():
    assert parse_time_scale(None) == 1.0
    assert parse_time_scale("0.05") == 0.05
    for bad in ("-1", "abc", "inf"):
        with pytest.raises(ValueError, match="HEISENHUNT_SIM_TIME_SCALE"):
            parse_time_scale(bad)


def test_builtin_rules_match_only_the_story():
    model = load_fault_model()
    assert model.source == str(BUILTIN_PATH)
    assert model.rule_for(*pair()).name == "overlap-race-hicache"
    assert model.rule_for(*pair(hicache=False)).name == "overlap-race-no-hicache"
    # every other configuration of the four knobs (the end-to-end check runs a few through the router)
    for cap, bf16, ms, hc in itertools.product((True, False), repeat=4):
        if not (cap and bf16 and ms):
            other = dict(capture=cap, bf16=bf16, multi_stream=ms, hicache=hc)
            assert model.rule_for(*pair(**other)) is None, other
    # the deprecated --disable-cuda-graph turns decode graphs off too (0.5.23), so the story is off
    assert model.rule_for(*pair(capture=False, eager_flag="--disable-cuda-graph")) is None


def test_a_model_testing_the_deprecated_dest_still_validates_and_matches_it(tmp_path: Path):
    data = yaml.safe_load(BUILTIN_PATH.read_text())
    for rule in data["rules"]:
        del rule["when"]["decode.args.disable_decode_cuda_graph"]
        rule["when"]["decode.args.disable_cuda_graph"] = False
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    model = load_fault_model(path)
    assert model.rule_for(*pair()).name == "overlap-race-hicache"
    assert model.rule_for(*pair(capture=False, eager_flag="--disable-cuda-graph")) is None


def test_probability_grows_with_batch_and_batch_one_never_corrupts():
    model = load_fault_model()
    for rule in model.rules:
        assert rule.probability(1) == 0.0
        values = [rule.probability(b) for b in (2, 4, 8, 16, 32, 60, 64, 200)]
        assert values == sorted(values) and values[0] > 0
    hicache, no_hicache = model.rules
    assert all(hicache.probability(b) > no_hicache.probability(b) for b in (8, 32, 60))


def test_throughput_model_hits_the_calibration_points():
    tp = load_fault_model().throughput
    # the fixed arm: multi-stream off, captured up to bs 32, eager above (C64)
    measured = {c: c / tp.step_s(c, captured=c <= 32, multi_stream=False) for c in (1, 8, 32, 64)}
    for c, target in {1: 53, 8: 280, 32: 561, 64: 657}.items():
        assert measured[c] == pytest.approx(target, rel=0.01)
    assert tp.step_s(8, True, multi_stream=True) > tp.step_s(8, True, multi_stream=False)  # costs a little
    assert tp.step_s(8, False, False) > tp.step_s(8, True, False)  # eager is slower
    assert tp.step_s(200, False, False) > tp.step_s(64, False, False)  # extrapolated past the last point


def test_clean_model_and_throughput_defaults(tmp_path: Path):
    path = tmp_path / "clean.yaml"
    path.write_text("version: 1\nname: clean\nrules: []\n")
    model = load_fault_model(path)
    assert model.rules == () and model.rule_for(*pair()) is None
    assert model.throughput == load_fault_model().throughput  # missing throughput: the built-in's


@pytest.mark.parametrize(
    ("mutate", "names"),
    [
        (lambda d: d.update(colour=1), ["top level", "'colour'", "accepted: version, name"]),
        (lambda d: d.update(version=2), ["version", "accepted: 1"]),
        (
            lambda d: d["rules"][0]["when"].update({"decode.env.SGLANG_NOPE": True}),
            ["rules[0] (overlap-race-hicache).when", "'decode.env.SGLANG_NOPE'", "SGLANG_DSV4_BF16_INDEX_K"],
        ),
        (
            lambda d: d["rules"][0]["when"].update({"router.args.port": 1}),
            ["unknown key 'router.args.port'", "prefill, decode"],
        ),
        (
            lambda d: d["rules"][0]["when"].update({"decode.args.disable_decode_cuda_graph": "no"}),
            ["when.decode.args.disable_decode_cuda_graph", "expected bool"],
        ),
        (
            lambda d: d["rules"][0].update(probability=[[1, 0.0], [8, 1.5]]),
            ["probability[1]", "between 0 and 1"],
        ),
        (lambda d: d["rules"][0].update(probability=[[8, 0.1], [4, 0.2]]), ["probability[1]", "ascending"]),
        (
            lambda d: d["rules"][0].update(shapes={"gibberish": 1}),
            ["shapes", "'gibberish'", "truncated_arguments"],
        ),
        (lambda d: d["rules"][0].update(shapes={"invalid_json": 0}), ["shapes", "weight > 0"]),
        (
            lambda d: d["rules"][0].update(restart_icc=1.5),
            ["rules[0] (overlap-race-hicache).restart_icc", "0 to 1"],
        ),
        (lambda d: d["rules"][0].update(restart_icc="high"), ["restart_icc", "'high'"]),
        (lambda d: d["rules"][0].pop("when"), ["rules[0]", "missing required key 'when'"]),
        (lambda d: d["rules"][1].update(name=d["rules"][0]["name"]), ["used twice"]),
        (lambda d: d["throughput"].update(graph_step_ms=[[1, 0]]), ["throughput.graph_step_ms[0]", "> 0 ms"]),
        (lambda d: d["throughput"].update(startup_s=-1), ["throughput.startup_s", ">= 0"]),
        (lambda d: d["throughput"].update(warp=9), ["throughput", "'warp'", "multi_stream_overhead"]),
    ],
)
def test_invalid_models_name_the_bad_key_and_what_is_accepted(tmp_path: Path, mutate, names):
    data = yaml.safe_load(BUILTIN_PATH.read_text())
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FaultModelError) as info:
        load_fault_model(path)
    message = str(info.value)
    assert str(path) in message
    for part in names:
        assert part in message


def test_unreadable_and_non_yaml_files(tmp_path: Path):
    with pytest.raises(FaultModelError, match="cannot read"):
        load_fault_model(tmp_path / "missing.yaml")
    (tmp_path / "x.yaml").write_text("rules: [\n")
    with pytest.raises(FaultModelError, match="not valid YAML"):
        load_fault_model(tmp_path / "x.yaml")
    with pytest.raises(FaultModelError, match="expected a mapping"):
        validate_fault_model(["rules"])


# --- between-start variation (restart_icc) ------------------------------------------------------


@pytest.mark.parametrize(("q", "icc"), [(0.15, 0.005), (0.15, 0.1), (0.03, 0.02), (0.5, 0.3)])
def test_restart_rate_has_mean_q_and_the_stated_icc(q, icc):
    """Over starts (u uniform), a start's session rate s has mean q and variance icc q (1 - q): the
    sessions of one start then have intra-class correlation icc (beta-binomial)."""
    u = (np.arange(200_000) + 0.5) / 200_000  # a fine grid of quantiles: the integral over u
    s = np.array([restart_rate(q, x, icc) for x in u[::50]])
    assert s.mean() == pytest.approx(q, rel=0.01)
    assert s.var() / (q * (1 - q)) == pytest.approx(icc, rel=0.03)
    assert np.all(np.diff(s) >= 0)  # a higher draw is an unluckier start
    assert restart_rate(q, 0.3, 0.0) == q  # icc 0: every start alike


def test_beta_quantile_is_scipys_betaincinv():
    """The sim's own Beta quantile (it spares each server start scipy's import) against scipy's, over
    means, ICCs and quantiles far wider than a fault model uses."""
    from scipy.special import betaincinv

    rng = np.random.default_rng(5)
    for _ in range(2000):
        q, icc, u = 10 ** rng.uniform(-4, -0.01), 10 ** rng.uniform(-4, -0.05), rng.uniform(1e-6, 1 - 1e-6)
        a, b = q * (1 - icc) / icc, (1 - q) * (1 - icc) / icc
        expected = float(betaincinv(a, b, u))
        assert beta_quantile(a, b, u) == pytest.approx(expected, rel=1e-9, abs=1e-12), (a, b, u)


def test_sessions_of_one_start_correlate_as_stated():
    """Simulate starts with the rule's own per-turn probability, at a constant load: the ANOVA
    estimate of the ICC of session outcomes recovers restart_icc, and icc 0 gives independent sessions."""
    rule = load_fault_model().rules[0]
    rng = np.random.default_rng(3)
    turns, sessions, starts = 4, 60, 3000
    for icc, expected in ((0.1, 0.1), (0.0, 0.0)):
        r = validate_fault_model({"rules": [{**rule_dict(), "restart_icc": icc}]}).rules[0]
        p = np.array([r.turn_probability(60, turns, u) for u in rng.random(starts)])
        corrupted_turns = rng.random((starts, sessions, turns)) < p[:, None, None]
        k = corrupted_turns.any(axis=2).sum(axis=1)
        q = session_rate(rule.probability(60), turns)
        assert k.mean() / sessions == pytest.approx(q, abs=0.01)
        msb = sessions * np.var(k / sessions, ddof=1)
        msw = np.mean(k * (sessions - k) / sessions) / (sessions - 1)
        icc_hat = (msb - msw) / (msb + (sessions - 1) * msw)
        assert icc_hat == pytest.approx(expected, abs=0.015)


def rule_dict() -> dict:
    return dict(yaml.safe_load(BUILTIN_PATH.read_text())["rules"][0])


def test_each_decode_start_draws_once_and_only_for_rules_with_restart_icc():
    model = load_fault_model()
    _, decode = pair()

    def start(seed: int) -> DecodeEngine:
        return DecodeEngine(model, decode, 0.0, SimCounters(), random.Random(seed))

    a, b = start(1), start(2)
    assert set(a.restart_quantiles) == {r.name for r in model.rules}
    assert a.restart_quantiles != b.restart_quantiles  # another start, another draw
    assert start(1).restart_quantiles == a.restart_quantiles  # a seeded model reproduces it
    assert a.counters.restart_quantiles == a.restart_quantiles  # shown in /server_info
    # a model without restart_icc draws nothing: its fault draws are exactly the old ones
    data = yaml.safe_load(BUILTIN_PATH.read_text())
    for r in data["rules"]:
        r.pop("restart_icc", None)
    rng = random.Random(5)
    engine = DecodeEngine(validate_fault_model(data), decode, 0.0, SimCounters(), rng)
    assert engine.restart_quantiles == {} and rng.random() == random.Random(5).random()
