"""The differential oracle (workload.oracle=divergence): the comparison, the logprobs it reads, and whole
runs of both passes against the real simulated server on loopback (its race and its benign variance)."""

from __future__ import annotations

import json
import random
import urllib.request
from pathlib import Path

import pytest

from orchestrator.sim import agent
from orchestrator.sim.faults import FaultModelError, validate_fault_model
from orchestrator.workload.divergence import Difference, first_difference, words
from orchestrator.workload.prompts import load_prompts, replay_turns, session_conversation
from orchestrator.workload.results import StreamedToolCall, StreamedTurn
from orchestrator.workload.stress import StressSettings, read_outcomes, run_stress_sync

EXAMPLE_PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "prompts" / "conversations.jsonl"
# the built-in model's race (captured graphs, overlap, bf16 index keys, HiCache)
FAULTY = {"args": ("--enable-hierarchical-cache",), "env": {"SGLANG_DSV4_BF16_INDEX_K": "1"}}


def turn(
    text: str = "", tokens: list[str] | None = None, calls=(), completion: int | None = None
) -> StreamedTurn:
    usage = None if completion is None else {"prompt_tokens": 1, "completion_tokens": completion}
    return StreamedTurn(content=text, tokens=tokens, tool_calls=list(calls), usage=usage)


def test_tokens_are_compared_where_both_turns_carry_them_all():
    ref = turn("a b c", ["a", " b", " c"], completion=3)
    load = turn("a b d", ["a", " b", " d"], completion=3)
    assert first_difference(ref, load) == Difference(2, "tokens", " c", " d")
    assert first_difference(ref, turn("a b c", ["a", " b", " c"], completion=3)) is None
    # logprobs short of the usage's count: the text decides (word by word)
    short = turn("a b d", ["a", " b"], completion=3)
    assert first_difference(ref, short) == Difference(2, "text", " c", " d")
    assert first_difference(ref, load, compare="text").basis == "text"


def test_a_longer_or_shorter_output_differs_at_the_end_of_the_shorter():
    assert first_difference(turn("a b"), turn("a b c")) == Difference(2, "text", "", " c")
    assert first_difference(turn("a b c"), turn("a b")) == Difference(2, "text", " c", "")


def test_tool_calls_are_compared_by_name_and_arguments_never_by_id():
    call = StreamedToolCall(0, "call_1", "read_file", '{"path": "a"}')
    same = StreamedToolCall(0, "call_2", "read_file", '{"path": "a"}')
    other = StreamedToolCall(0, "call_1", "read_file", '{"path": "b"}')
    assert first_difference(turn(calls=[call]), turn(calls=[same])) is None
    assert first_difference(turn(calls=[call]), turn(calls=[other])).under_load == ' "b"}'
    assert "".join(words(" x  y\nz ")) == " x  y\nz "


def test_early_and_late_divergence_are_families_apart():
    assert Difference(15, "tokens", "a", "b").finding(16, 0).detector == "diverged_early"
    finding = Difference(16, "tokens", "a", "b").finding(16, 2)
    assert (finding.detector, finding.family) == ("diverged", "diverged")
    assert "turn 2" in finding.reason and "token 16" in finding.reason


def test_a_diverged_continuation_keeps_the_prefix_and_the_length_and_differs_at_its_start():
    rng = random.Random(0)
    tokens = agent.tokenize("The quick brown fox jumps over the lazy dog again and again.")
    for _ in range(200):
        out = agent.diverge(tokens, rng)
        at = next(i for i, (a, b) in enumerate(zip(tokens, out, strict=True)) if a != b)
        assert len(out) == len(tokens) and out[:at] == tokens[:at]
    assert agent.diverge([], rng) == []


def test_batch_variance_is_checked_like_the_rules():
    model = validate_fault_model({"batch_variance": {"probability": [[1, 0.0], [8, 0.5]]}})
    assert model.batch_variance.probability(1) == 0.0 and model.batch_variance.probability(8) == 0.5
    with pytest.raises(FaultModelError, match=r"batch_variance: unknown key 'rate'"):
        validate_fault_model({"batch_variance": {"probability": [[1, 0.0]], "rate": 1}})
    with pytest.raises(
        FaultModelError, match=r"batch_variance.probability\[1\]: value must be between 0 and 1"
    ):
        validate_fault_model({"batch_variance": {"probability": [[1, 0.0], [2, 1.5]]}})


def settings(url: str, out: Path, **fields) -> StressSettings:
    return StressSettings(url=url, out_dir=out, progress=False, timeout_s=60.0, **fields)


def counters(url: str) -> dict:
    with urllib.request.urlopen(url + "/server_info", timeout=5) as resp:
        return json.load(resp)["sim"]["counters"]


def test_the_race_on_the_sim_is_seen_as_divergence_turn_for_turn(start_sim, tmp_path):
    """Both passes on one start: the reference alone (load 1: the race never fires), then under load; the
    sim's own count of the turns it corrupted is exactly the sessions that diverged."""
    server = start_sim(**FAULTY)
    out = tmp_path / "run"
    phases: list[str] = []
    summary = run_stress_sync(
        settings(server.url, out, sessions=60, rounds=4, seed=3, oracle="divergence", early_tokens=8),
        on_phase=phases.append,
    )
    assert phases == ["reference", "stress"]  # the arm's display says which pass runs
    document = json.loads((out / "summary.json").read_text())
    assert summary.errored == 0 and summary.oracle == "divergence" and summary.reference_s > 0
    assert document["reference"]["turns"] == 240 and document["reference"]["with_tokens"] == 240
    assert summary.corrupted > 0
    assert summary.corrupted == counters(server.url)["corrupted_turns"]
    assert set(summary.by_detector) <= {"diverged_early", "diverged"}
    assert document["counted_families"] == ["diverged_early", "diverged"]
    assert document["divergence"]["basis"] == {"tokens": summary.corrupted}
    for outcome in read_outcomes(out / "sessions.jsonl"):
        if outcome.status != "corrupted":
            assert outcome.rounds_done == 4
            continue
        bad = outcome.bad_turn
        assert bad.detector == ("diverged_early" if bad.divergence["position"] < 8 else "diverged")
        artifact = json.loads((out / "corrupted" / f"{outcome.session_id}.json").read_text())
        position = artifact["difference"]["position"]
        ref, load = artifact["reference"]["tokens"], artifact["under_load"]["tokens"]
        assert (
            ref[:position] == load[:position]
            and ref[position : position + 1] != load[position : position + 1]
        )
        # the pass under load sent the reference conversation: its request is the reference's
        assert artifact["request"]["user"] == f"heisenhunt {outcome.session_id} turn {bad.round_index + 1}/4"
        assert artifact["request"]["logprobs"] is True and artifact["request"]["seed"] == 3


def test_a_healthy_sim_never_diverges(sim_server, tmp_path):
    summary = run_stress_sync(
        settings(sim_server.url, tmp_path / "run", sessions=30, rounds=3, oracle="divergence")
    )
    assert (summary.corrupted, summary.errored, summary.clean) == (0, 0, 30)


def variance_model(tmp_path: Path, p: float) -> str:
    path = tmp_path / "variance.yaml"
    path.write_text(json.dumps({"rules": [], "batch_variance": {"probability": [[1, 0.0], [2, p]]}}))
    return str(path)


def test_benign_variance_diverges_free_text_under_load_and_never_the_reference(start_sim, tmp_path):
    """A prompts file on a sim without fault but with batch variance certain under load: every session
    has free text (a chat answer, or the DONE after a plan), so every one diverges under load, none in the
    reference pass; the tool-call oracle sees it only where an expected answer judges the text."""
    server = start_sim(env={"HEISENHUNT_SIM_FAULT_MODEL": variance_model(tmp_path, 1.0)})
    prompts = str(EXAMPLE_PROMPTS)
    run = run_stress_sync(
        settings(server.url, tmp_path / "div", sessions=40, prompts=prompts, oracle="divergence")
    )
    assert (run.corrupted, run.errored) == (40, 0)
    assert counters(server.url)["benign_flips"] == 40
    tool = run_stress_sync(settings(server.url, tmp_path / "tool", sessions=40, prompts=prompts))
    conversations = load_prompts(prompts)
    answered = [session_conversation(conversations, 0, i).expected is not None for i in range(40)]
    assert tool.errored == 0
    assert tool.corrupted == sum(answered) and tool.by_detector == {"wrong_answer": sum(answered)}


def test_the_example_prompts_pass_both_oracles_on_a_healthy_sim(start_sim, tmp_path):
    """A sim without fault and without batch variance (the built-in model's benign flips would change a
    free-text turn now and then): every conversation of the example is clean under both oracles."""
    server = start_sim(env={"HEISENHUNT_SIM_FAULT_MODEL": variance_model(tmp_path, 0.0)})
    prompts = str(EXAMPLE_PROMPTS)
    sessions = len(load_prompts(prompts))
    for oracle in ("tool_calls", "divergence"):
        run = run_stress_sync(
            settings(server.url, tmp_path / oracle, sessions=sessions, prompts=prompts, oracle=oracle)
        )
        assert (run.clean, run.corrupted, run.errored) == (sessions, 0, 0), (oracle, run)
    turns = sum(len(replay_turns(c)) for c in load_prompts(prompts))
    assert json.loads((tmp_path / "divergence" / "summary.json").read_text())["reference"]["turns"] == turns


def test_deterministic_inference_on_the_sim_removes_batch_variance_and_slows_the_steps():
    """What real sglang 0.5.17 did with --enable-deterministic-inference (reports/real_determinism): the
    simulator's decode with the flag has no benign flips and steps 1 + deterministic_overhead slower."""
    from orchestrator.sim.args import parse_args
    from orchestrator.sim.engine import DecodeEngine, DecodeRequest, SimCounters
    from orchestrator.sim.faults import RoleConfig, load_fault_model

    model = validate_fault_model({"batch_variance": {"probability": [[1, 0.0], [2, 1.0]]}})
    throughput = load_fault_model().throughput
    assert throughput.step_s(16, True, False, True) == pytest.approx(
        throughput.step_s(16, True, False) * 1.19
    )
    for flags, flipped in (([], 1), (["--enable-deterministic-inference"], 0)):
        args = vars(parse_args(["--model-path", "m", *flags]))
        engine = DecodeEngine(model, RoleConfig("decode", {}, args), 0.0, SimCounters(), random.Random(0))
        request = DecodeRequest(
            "r", agent.Reply(content="a b c"), agent.tokenize("a b c"), None, 3, RoleConfig("prefill", {}, {})
        )
        engine._admit(request, 8)
        assert engine.counters.benign_flips == flipped
