"""The sim's flags in SGLang 0.5.23's spelling and resolution (orchestrator/sim/args.py), and the
test-only HEISENHUNT_SIM_OVERRIDE_ARGS knob of the sim server, on real server processes."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
from simkit import Arm, get_json, sim_counters

from orchestrator.sim.args import (
    apply_overrides,
    decode_graph_max_bs,
    decode_graphs_enabled,
    deprecation_warnings,
    parse_args,
    parse_overrides,
    prefill_graphs_enabled,
)
from orchestrator.sim.engine import DecodeEngine, SimCounters
from orchestrator.sim.envs import effective_env
from orchestrator.sim.faults import RoleConfig, load_fault_model
from orchestrator.sim.launch import server_launch
from orchestrator.sim.server import OVERRIDE_ARGS_ENV
from tests.conftest import free_port

EAGER = Arm(capture=False)  # --disable-decode-cuda-graph


def parse(*flags: str):
    return parse_args(["--model-path", "m", "--disaggregation-mode", "decode", *flags])


@pytest.mark.parametrize(
    "flags",
    [
        ["--cuda-graph-max-bs", "32"],  # 0.5.9's spelling: 0.5.23 refuses it as ambiguous
        ["--cuda-graph-max-bs=32"],
        ["--cuda-graph-max-bs-dec", "8"],  # a prefix: argparse must not take it for the full flag
    ],
)
def test_the_parser_refuses_spellings_0523_refuses_naming_them(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*flags)
    assert exit_.value.code == 2
    assert f"unrecognized arguments: {' '.join(flags)}" in capsys.readouterr().err


def test_the_0523_max_bs_spelling_is_the_decode_one_and_must_be_positive(capsys):
    assert parse().cuda_graph_max_bs_decode == 32  # the sim's default (sglang's: None, its own)
    assert parse("--cuda-graph-max-bs-decode", "8").cuda_graph_max_bs_decode == 8
    assert decode_graph_max_bs(parse("--cuda-graph-max-bs-decode", "8")) == 8
    with pytest.raises(SystemExit):
        parse("--cuda-graph-max-bs-decode", "0")
    assert "--cuda-graph-max-bs-decode must be >= 1" in capsys.readouterr().err


def test_the_deprecated_switch_turns_both_phases_off_the_decode_one_only_decode():
    legacy, decode_only, prefill_only, none = (
        parse("--disable-cuda-graph"),
        parse("--disable-decode-cuda-graph"),
        parse("--disable-prefill-cuda-graph"),
        parse(),
    )
    # resolved as SGLang's cuda_graph_hook does: the per-phase switches follow the deprecated one
    assert (legacy.disable_decode_cuda_graph, legacy.disable_prefill_cuda_graph) == (True, True)
    assert (decode_graphs_enabled(legacy), prefill_graphs_enabled(legacy)) == (False, False)
    assert not decode_only.disable_cuda_graph and not decode_only.disable_prefill_cuda_graph
    assert (decode_graphs_enabled(decode_only), prefill_graphs_enabled(decode_only)) == (False, True)
    assert (decode_graphs_enabled(prefill_only), prefill_graphs_enabled(prefill_only)) == (True, False)
    assert (decode_graphs_enabled(none), prefill_graphs_enabled(none)) == (True, True)
    # only the deprecated flag is warned about, in SGLang's words
    assert deprecation_warnings(decode_only) == [] == deprecation_warnings(none)
    (warning,) = deprecation_warnings(legacy)
    assert "'--disable-cuda-graph' is deprecated" in warning and "--disable-decode-cuda-graph" in warning
    # the decision also reads a role's args as a mapping (the hand-off's), resolved or not
    assert not decode_graphs_enabled({"disable_cuda_graph": True})
    assert not decode_graphs_enabled({"disable_decode_cuda_graph": True}) and decode_graphs_enabled({})


@pytest.mark.parametrize(
    ("flags", "graphs", "max_bs"),
    [
        ([], True, 32),
        (["--disable-cuda-graph"], False, 32),
        (["--disable-decode-cuda-graph"], False, 32),
        (["--cuda-graph-max-bs-decode", "8"], True, 8),
    ],
)
def test_the_decode_engine_captures_by_the_one_decision(flags, graphs, max_bs):
    config = RoleConfig("decode", effective_env({})[0], vars(parse(*flags)))
    engine = DecodeEngine(load_fault_model(), config, 0.0, SimCounters(), random.Random(1))
    assert (engine.graph_enabled, engine.max_graph_bs) == (graphs, max_bs)


def test_overrides_are_checked_against_the_parser():
    assert parse_overrides('{"disable_decode_cuda_graph": false, "hicache_ratio": 3}') == {
        "disable_decode_cuda_graph": False,
        "hicache_ratio": 3.0,
    }
    assert parse_overrides('{"tool_call_parser": null}') == {"tool_call_parser": None}  # default None
    for raw, names in [
        (
            '{"disable_cuda_graphs": true}',
            ["unknown dest 'disable_cuda_graphs'", "disable_decode_cuda_graph"],
        ),
        ('{"cuda_graph_max_bs_decode": "8"}', ["cuda_graph_max_bs_decode", "expected int", "'8'"]),
        ('{"cuda_graph_max_bs_decode": true}', ["cuda_graph_max_bs_decode", "expected int"]),
        ('{"disable_decode_cuda_graph": 0}', ["disable_decode_cuda_graph", "expected bool"]),
        ('{"disaggregation_mode": "both"}', ["disaggregation_mode", "'both'", "'prefill'"]),
        ('{"port": null}', ["port", "expected int"]),
        ("[1]", ["JSON object"]),
        ("{nope", ["not JSON"]),
    ]:
        with pytest.raises(ValueError) as info:
            parse_overrides(raw)
        for name in names:
            assert name in str(info.value), (raw, str(info.value))


def test_overrides_apply_after_resolution_and_re_resolve_the_rest():
    args = parse("--disable-decode-cuda-graph")
    assert apply_overrides(args, {"disable_decode_cuda_graph": False}) == [
        ("disable_decode_cuda_graph", True, False)
    ]
    assert decode_graphs_enabled(args)
    args = parse()
    apply_overrides(args, {"disable_cuda_graph": True})  # the per-phase switches follow it
    assert args.disable_decode_cuda_graph and args.disable_prefill_cuda_graph
    with pytest.raises(ValueError, match="override disable_cuda_graph to false too"):
        apply_overrides(parse("--disable-cuda-graph"), {"disable_decode_cuda_graph": False})
    with pytest.raises(ValueError, match="--cuda-graph-max-bs-decode must be >= 1"):
        apply_overrides(parse(), {"cuda_graph_max_bs_decode": 0})


# --- on real server processes ------------------------------------------------------------------------


def test_an_overridden_flag_is_in_effect_and_reported_by_server_info(cluster):
    """The knob models a server whose argument resolution overrides a flag: given
    --disable-decode-cuda-graph, it captures graphs anyway, says so in one warning line, and reports
    the value it runs with."""
    c = cluster(extra_env={OVERRIDE_ARGS_ENV: json.dumps({"disable_decode_cuda_graph": False})})
    decode = c.start_decode(EAGER)
    info = get_json(decode.url + "/server_info")
    assert info["disable_decode_cuda_graph"] is False and info["disable_cuda_graph"] is False
    assert info["cuda_graph_max_bs_decode"] == 32
    assert info["internal_states"][0]["decode_cuda_graph_bs"] == list(range(1, 33))
    counters = sim_counters(decode.url)  # the health checks' steps ran in captured graphs
    assert counters["captured_steps"] > 0 and counters["eager_steps"] == 0
    log = c.log("decode")
    assert (
        "Overriding disable_decode_cuda_graph=True -> False (HEISENHUNT_SIM_OVERRIDE_ARGS)" in log
        and log.count("Overriding ") == 1
    )
    assert "Capture target decode CUDA graph end" in log and "deprecated" not in log


def test_the_deprecated_switch_runs_eager_warns_and_reports_both_phases_off(cluster):
    c = cluster()
    decode = c.start_decode(extra=["--disable-cuda-graph"])
    info = get_json(decode.url + "/server_info")
    assert info["disable_cuda_graph"] and info["disable_decode_cuda_graph"]
    assert info["disable_prefill_cuda_graph"] and info["internal_states"][0]["decode_cuda_graph_bs"] == []
    counters = sim_counters(decode.url)
    assert counters["eager_steps"] > 0 and counters["captured_steps"] == 0
    log = c.log("decode")
    assert "'--disable-cuda-graph' is deprecated" in log and "Capture target decode CUDA graph" not in log


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"disable_cuda_graphs": True}, ["'disable_cuda_graphs'", "accepted:", "disable_decode_cuda_graph"]),
        ({"cuda_graph_max_bs_decode": "32"}, ["cuda_graph_max_bs_decode", "expected int"]),
    ],
)
def test_a_bad_override_stops_the_server_at_start_up_naming_it(overrides, names):
    launch = server_launch(free_port(), mode="decode", env={OVERRIDE_ARGS_ENV: json.dumps(overrides)})
    done = subprocess.run(
        launch.argv, env={**os.environ, **launch.env}, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    output = done.stdout + done.stderr
    assert OVERRIDE_ARGS_ENV in output and "ready to roll" not in output
    for name in names:
        assert name in output
