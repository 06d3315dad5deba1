"""Which kind a corrupted turn is: the detectors' precedence, and short repetitions from the sim.

Issue 32: a degenerate repetition cut by a small max_tokens, too short to be a run, was classified
`missing_tool_call`. The turns here come from the simulator's own pure functions (agent.corrupt for the
repetition, agent.render for a healthy call), made into the turn the client sees as the sim server
does (agent.parse_output; finish_reason "length" when the tokens fill max_tokens)."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter

import pytest

from orchestrator.sim import agent
from orchestrator.sim.faults import SHAPES
from orchestrator.workload import detect, tasks
from orchestrator.workload.results import StreamedToolCall, StreamedTurn


def sim_turn(tokens: list[str], max_tokens: int | None) -> StreamedTurn:
    """The turn the client gets for raw `tokens` from the sim server (server.py: parse_output, and
    the finish_reason of `_finish_reason`)."""
    parsed = agent.parse_output("".join(tokens))
    calls = [StreamedToolCall(i, f"call_{i}", name, args) for i, (name, args) in enumerate(parsed.calls)]
    if max_tokens is not None and len(tokens) >= max_tokens:
        finish = "length"
    else:
        finish = "tool_calls" if calls else "stop"
    return StreamedTurn(content=parsed.content, tool_calls=calls, finish_reason=finish, done=True)


def planned(seed: int) -> tuple[agent.Reply, list[dict]]:
    """The planned call of round seed % 4 of session 0 of seed's task, and the conversation before it."""
    task = tasks.make_task(seed, 0, 4)
    messages = tasks.conversation_after(task, seed % 4)
    return agent.decide_reply(messages, tasks.TOOLS, "auto"), messages


def repetition(seed: int, max_tokens: int) -> list[str]:
    """The sim's repetition corruption of `planned(seed)`, its random choices drawn from Random(seed)."""
    reply, messages = planned(seed)
    return agent.corrupt(reply, "repetition", random.Random(seed), messages, tasks.TOOLS, max_tokens)


def loop_shape(tokens: list[str]) -> tuple[int, int]:
    """(tokens before the loop, tokens in its unit) of a long repetition, read off the tokens alone."""
    half = len(tokens) // 2
    unit = next(u for u in range(1, half) if tokens[half + u :] == tokens[half:-u])
    head = next(h for h in range(len(tokens)) if tokens[h + unit :] == tokens[h:-unit])
    return head, unit


def kinds(seed: int, max_tokens: int) -> tuple[str | None, set[str]]:
    """check_turn's kind for the sim's repetition, and every structural detector that fires on it."""
    turn = sim_turn(repetition(seed, max_tokens), max_tokens)
    finding = detect.check_turn(turn)
    fired = {name for name, detector in detect.STRUCTURAL if detector(turn) is not None}
    return (finding.detector if finding else None), fired


# --- the precedence --------------------------------------------------------------------------------


def test_check_turn_names_the_kind_of_the_detectors_that_fire():
    """Every corruption shape of the sim, cut at random lengths, as sent and with its stream cut (no
    finish_reason): check_turn names kind_of all the detectors that fire, plan check included."""
    rng = random.Random(7)
    several = 0
    for seed in range(200):
        reply, messages = planned(seed)
        for shape in SHAPES:
            max_tokens = rng.randint(1, 600)
            tokens = agent.corrupt(reply, shape, random.Random(seed), messages, tasks.TOOLS, max_tokens)
            sent = sim_turn(tokens, max_tokens)
            for turn in (sent, dataclasses.replace(sent, finish_reason=None)):
                fired = {name for name, detector in detect.STRUCTURAL if detector(turn) is not None}
                if detect.wrong_call(turn, reply.call) is not None:
                    fired.add("wrong_call")
                finding = detect.check_turn(turn, reply.call, check_plan=True)
                assert (finding.detector if finding else None) == detect.kind_of(fired), (fired, turn)
                several += len(fired) > 1
    assert several > 1000  # most corrupted turns fire more than one detector: the precedence decides
    # a loop explains a missing call; a missing call is named only when nothing else explains it
    order = detect.DETECTORS.index
    assert order("degenerate_repetition") < order("missing_tool_call") < order("wrong_call")


def test_the_kind_is_the_first_in_precedence_whatever_order_the_detectors_fire_in():
    for fired in itertools.permutations(["missing_tool_call", "degenerate_repetition", "malformed_json"]):
        assert detect.kind_of(fired) == "degenerate_repetition"
    assert detect.kind_of(["missing_tool_call"]) == "missing_tool_call"
    assert detect.kind_of([]) is None


# --- short repetitions, as the sim makes them -------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "max_tokens"),
    [
        (42, 16),  # 'search( heartbeat indexer' x4: a unit of 18 characters, 4 copies
        (18, 44),  # 'run_shell( tokenizer_manager.py' x6
        (58, 33),  # 'http_get( top_k' x9: one copy short of a run
        (78, 26),  # 'run_shell( ls src' x11: copies enough, but 77 characters, short of a run's 80
        (105, 34),  # 'run_shell( git diff --stat' x6
    ],
)
def test_a_short_repetition_found_classified_missing_tool_call_is_a_repetition(seed, max_tokens):
    kind, fired = kinds(seed, max_tokens)
    assert kind == "degenerate_repetition", (kind, "".join(repetition(seed, max_tokens)))
    assert fired == {"degenerate_repetition", "missing_tool_call"}  # both true; precedence names one
    assert kind == detect.kind_of(fired)


@pytest.mark.parametrize(
    ("content", "kind"),
    [
        ("read_file( a.py a.py a.py", "degenerate_repetition"),  # three copies: the minimum
        ("read_file( a.py a.py", "missing_tool_call"),  # two: a phrase said twice
        ("the " * 9, "degenerate_repetition"),  # short of a run, but the whole text
        ("I looked at the file and I will call the tool now now now", "missing_tool_call"),  # a sliver
        ("read_file( a.py a.py a.py and then stopped", "missing_tool_call"),  # a loop ends only at the cut
        ("read_file(" + " -- " * 5, "missing_tool_call"),  # no letter or digit: a rule, not a loop
    ],
)
def test_a_loop_in_place_of_the_call_fills_the_end_of_the_text(content, kind):
    turn = StreamedTurn(content=content, finish_reason="length", done=True)
    assert detect.check_turn(turn).detector == kind
    with_a_call = dataclasses.replace(
        turn, tool_calls=[StreamedToolCall(0, "c", "read_file", '{"path": "src/a.py"}')]
    )
    assert detect.degenerate_repetition(with_a_call) is None  # a call was made: not a loop in its place


def short_repetitions(n: int, copies: range) -> list[tuple[int, int, int]]:
    """(seed, max_tokens, whole copies of the unit) for n sim repetitions: each seed's loop cut by
    max_tokens after a random number of whole copies in `copies` and a random part of one more."""
    rng = random.Random(32)
    cases = []
    for seed in range(n):
        head, unit = loop_shape(repetition(seed, agent.REPETITION_CAP))
        k = rng.choice(copies)
        cases.append((seed, head + k * unit + rng.randrange(unit), k))
    return cases


def test_every_sim_repetition_of_three_copies_or_more_is_a_repetition():
    """A Monte Carlo over 2,400 planned calls, each looped for 3 (the minimum of a loop in place of the
    call) to 9 whole copies (one short of a run)."""
    cases = short_repetitions(2400, range(3, 10))
    wrong = Counter()
    for seed, max_tokens, _ in cases:
        kind, _ = kinds(seed, max_tokens)
        if kind != "degenerate_repetition":
            wrong[kind] += 1
    assert not wrong, f"{sum(wrong.values())} of {len(cases)} short repetitions misclassified: {wrong}"


def test_below_the_minimum_a_cut_loop_is_only_a_missing_call():
    """Two copies and a part: not yet evidence of a loop (a phrase said twice), so the turn's kind is
    the missing call; the minimum is where the previous test starts."""
    for seed, max_tokens, _ in short_repetitions(300, range(1, 3)):
        assert kinds(seed, max_tokens)[0] == "missing_tool_call", (seed, max_tokens)


# --- clean turns -----------------------------------------------------------------------------------


def test_every_healthy_call_the_sim_renders_is_clean():
    """The sim's healthy path (decide_reply, render) for every round of 600 tasks: no finding, with or
    without the plan check."""
    turns = 0
    for seed in range(600):
        task = tasks.make_task(seed, 0, 4)
        for done, expected in enumerate(task.steps):
            messages = tasks.conversation_after(task, done)
            reply = agent.decide_reply(messages, tasks.TOOLS, "auto")
            turn = sim_turn(agent.render(reply, 1024, False), 1024)
            assert turn.finish_reason == "tool_calls", turn
            assert detect.check_turn(turn, expected, check_plan=True) is None, turn
            turns += 1
    assert turns == 2400
