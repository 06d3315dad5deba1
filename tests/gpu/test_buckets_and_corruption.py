"""The GPU engine's pure parts: bucket choice, and what a mismatching step does to a tool call."""

from __future__ import annotations

import pytest

from orchestrator.gpu.buckets import bucket_for, capture_sizes
from orchestrator.gpu.corruption import corrupt_from, run_on_name
from orchestrator.sim import agent
from orchestrator.workload import detect, tasks
from orchestrator.workload.results import StreamedToolCall, StreamedTurn


def test_capture_sizes_follow_sglangs_list_up_to_the_max():
    assert capture_sizes(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert capture_sizes(10) == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("batch", "bucket"), [(1, 1), (3, 4), (8, 8), (9, 12), (17, 24), (32, 32), (33, None), (60, None)]
)
def test_a_batch_replays_the_smallest_captured_size_that_holds_it(batch, bucket):
    assert bucket_for(batch, capture_sizes(32)) == bucket


def test_without_captured_graphs_every_batch_runs_eager():
    assert bucket_for(1, []) is None
    with pytest.raises(ValueError):
        bucket_for(0, [1, 2])


def planned_turn():
    task = tasks.make_task(seed=3, session_index=0, rounds=4)
    messages = tasks.initial_messages(task)
    expected = tasks.next_expected_call(messages)
    reply = agent.Reply(call=expected, planned=True)
    return reply, agent.render(reply, 1024, False), expected


def as_turn(tokens: list[str]) -> StreamedTurn:
    parsed = agent.parse_output("".join(tokens))
    calls = [StreamedToolCall(i, f"call_{i}", n, a) for i, (n, a) in enumerate(parsed.calls)]
    return StreamedTurn(
        content=parsed.content, tool_calls=calls, finish_reason="tool_calls" if calls else "stop", done=True
    )


def test_the_uncorrupted_call_passes_the_oracle():
    _, tokens, expected = planned_turn()
    assert detect.check_turn(as_turn(tokens), expected, check_plan=True) is None


def test_a_mismatch_anywhere_before_the_call_closes_is_caught_by_the_oracle_and_keeps_what_was_streamed():
    reply, tokens, expected = planned_turn()
    close = tokens.index(agent.CALL_END)
    shapes = set()
    for pos in range(close):
        shape, corrupted = corrupt_from(tokens, pos, reply, tasks.TOOLS)
        shapes.add(shape)
        assert corrupted[:pos] == tokens[:pos]  # tokens already streamed never change
        finding = detect.check_turn(as_turn(corrupted), expected, check_plan=True)
        assert finding is not None, (pos, shape, "".join(corrupted))
    assert shapes == {"leaked_text", "unknown_tool", "truncated_arguments"}


def test_a_mismatch_once_the_arguments_are_complete_leaves_nothing_to_corrupt():
    reply, tokens, _ = planned_turn()
    close = tokens.index(agent.CALL_END)
    # at the closing marker the arguments are all out: "truncated" there is the call itself
    assert corrupt_from(tokens, close, reply, tasks.TOOLS) is None
    assert corrupt_from(tokens, close + 1, reply, tasks.TOOLS) is None
    assert corrupt_from(tokens, len(tokens), reply, tasks.TOOLS) is None
    assert corrupt_from(["x"], 0, agent.Reply(content="x"), None) is None


def test_a_run_on_name_is_never_a_declared_tool():
    declared = agent.tool_names(tasks.TOOLS)
    for name in declared:
        assert run_on_name(name, declared).startswith(name)
        assert run_on_name(name, declared) not in declared
    assert run_on_name("read", ["reads", "read2", "read_read", "read_x"]) == "read_unknown"
