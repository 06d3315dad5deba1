"""The sim's load model (engine.py): the sessions open on the decode, on an injected clock; which
requests are turns of a session. Pure: no servers."""

from __future__ import annotations

import random

import pytest

from orchestrator.sim.engine import (
    DEFAULT_SESSION_IDLE_S,
    DecodeEngine,
    SessionLoad,
    SimCounters,
    parse_session_idle,
    session_turn,
)
from orchestrator.sim.faults import RoleConfig, load_fault_model
from orchestrator.workload import tasks


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def cohort(load: SessionLoad, n: int, round_index: int = 0) -> list[str]:
    keys = [f"s{i}" for i in range(n)]
    for key in keys:
        load.begin(key, round_index)
    return keys


def test_a_session_counts_between_its_turns_until_the_idle_window_ends():
    clock = Clock()
    load = SessionLoad(idle_s=5.0, clock=clock)
    load.begin("a", 0)
    assert load.open() == 1
    load.end("a", 0, last=False)
    clock.t += 4.9  # the client is between turns (a slow host): still open
    assert load.open() == 1
    load.begin("a", 1)
    load.end("a", 1, last=False)
    clock.t += 5.1  # silent longer than the window: its client left
    assert load.open() == 0
    assert load.opened == 1


def test_the_load_of_a_cohort_does_not_depend_on_how_long_the_client_takes_between_turns():
    """60 sessions x 4 rounds; each round the client turns every session around with a pause: the same
    loads whatever the pause, as long as it is inside the window."""

    def run(pause: float) -> list[int]:
        clock = Clock()
        load = SessionLoad(idle_s=DEFAULT_SESSION_IDLE_S, clock=clock)
        seen = []
        for r in range(4):
            for i in range(60):
                load.begin(f"s{i}", r)
                seen.append(load.open(r))
                clock.t += pause / 60  # the client sends the turns one after another
            clock.t += 0.2  # decode time
            for i in range(60):
                load.end(f"s{i}", r, last=r == 3)
                clock.t += pause / 60
        return seen

    fast, slow = run(0.01), run(3.0)
    assert fast == slow
    assert min(fast[60:]) == 60  # after the first round's ramp every turn sees the whole cohort


def test_sessions_that_ended_count_for_the_turns_of_laggards_at_rounds_up_to_theirs():
    clock = Clock()
    load = SessionLoad(idle_s=10.0, clock=clock)
    cohort(load, 3)
    load.end("s0", 1, last=True)  # corrupted at round 1: the client stopped there
    load.end("s1", 3, last=True)  # its last planned round, 3
    assert load.open(0) == 3 and load.open(1) == 3  # a laggard at round <= 1 still had both beside it
    assert load.open(2) == 2  # at round 2, s0 was already gone in the modelled timeline
    assert load.open(3) == 2 and load.open(4) == 1
    assert load.open() == 3  # a request of no session: every session named
    clock.t += 10.1
    assert load.open(0) == 1  # the window ends for ended sessions too


def test_now_is_the_load_the_session_furthest_behind_would_join_next():
    clock = Clock()
    load = SessionLoad(idle_s=10.0, clock=clock)
    assert load.now() == 0
    cohort(load, 3)
    load.end("s0", 0, last=True)  # corrupted at round 0
    load.end("s1", 0, last=False)  # next: round 1
    assert load.now() == 3  # s2 is still at round 0, where s0 was there too
    load.end("s2", 0, last=False)
    assert load.now() == 2  # everyone left is at round 1: s0 ended before it
    load.begin("s1", 1)
    load.end("s1", 1, last=True)  # s1 done
    assert load.now() == 2  # s2's round 1 still has s1 beside it
    load.begin("s2", 1)
    load.end("s2", 1, last=True)
    assert load.now() == 0  # no session left open: the gauges read the decode's real load again
    assert load.max_open == 3


def test_a_new_session_takes_the_place_of_the_latest_that_ended():
    """A client that keeps C sessions at once starts the next one when one ends: the load stays C."""
    clock = Clock()
    load = SessionLoad(idle_s=10.0, clock=clock)
    cohort(load, 4)
    for step in range(20):  # 20 replacements
        load.end(f"s{step}", 3, last=True)
        clock.t += 0.1
        load.begin(f"s{step + 4}", 0)
        assert load.open(0) == 4
    assert load.opened == 24 and load.max_open == 4


def test_a_session_resumed_at_a_later_round_replaces_nothing():
    clock = Clock()
    load = SessionLoad(idle_s=10.0, clock=clock)
    load.begin("a", 0)
    load.end("a", 3, last=True)
    load.begin("b", 2)  # e.g. a conversation resumed from a transcript
    assert load.open(2) == 2


def test_a_session_that_goes_on_after_a_bad_turn_is_open_again_not_ended():
    """A client that only notes some findings (workload.count) carries on after a corrupted turn."""
    clock = Clock()
    load = SessionLoad(idle_s=10.0, clock=clock)
    cohort(load, 2)
    load.end("s0", 0, last=True)  # corrupted: the sim takes it for the session's end
    load.begin("s0", 1)  # ... but the client sends its next round
    assert load.open(0) == 2 and load.open(1) == 2  # counted once, as open
    assert load.opened == 2


def test_idle_zero_counts_only_the_sessions_held():
    """The load model before issue 17: a session counts only while the decode holds one of its turns."""
    clock = Clock()
    load = SessionLoad(idle_s=0.0, clock=clock)
    cohort(load, 5)
    for i in range(3):
        load.end(f"s{i}", 0, last=False)
    load.end("s3", 0, last=True)
    assert load.open(0) == 1 and load.open() == 1


def test_two_turns_of_one_conversation_count_once():
    load = SessionLoad(idle_s=10.0, clock=Clock())
    load.begin("a", 0)
    load.begin("a", 0)  # the same task sent twice at once
    assert load.open() == 1
    load.end("a", 0, last=True)
    assert load.open() == 1  # one of its turns is still held
    load.end("a", 0, last=True)
    load.end("a", 0, last=True)  # an extra end is ignored
    assert load.open(1) == 0 and load.opened == 1


def test_idle_window_must_not_be_negative():
    with pytest.raises(ValueError):
        SessionLoad(idle_s=-1.0)


@pytest.mark.parametrize(("raw", "value"), [(None, 10.0), ("", 10.0), ("0", 0.0), ("2.5", 2.5)])
def test_parse_session_idle(raw, value):
    assert parse_session_idle(raw) == value


@pytest.mark.parametrize("raw", ["-1", "x", "inf", "nan"])
def test_parse_session_idle_refuses(raw):
    with pytest.raises(ValueError, match="HEISENHUNT_SIM_SESSION_IDLE_S"):
        parse_session_idle(raw)


def test_session_turn_names_the_task_and_its_round():
    task = tasks.make_task(7, 3, rounds=4)
    for r in range(4):
        assert session_turn(tasks.conversation_after(task, r)) == (task.task_id, r, r == 3, 4)
    assert session_turn(tasks.conversation_after(task, 4)) is None  # the plan is done: DONE, no round


def test_session_turn_without_a_plan_or_a_task_id():
    assert session_turn([{"role": "user", "content": "Hello"}]) is None
    assert session_turn("not a conversation") is None
    plan = '<plan>[{"name": "read_file", "arguments": {"path": "a"}}]</plan>'
    key, r, last, _ = session_turn([{"role": "user", "content": f"do this: {plan}"}])
    assert len(key) == 16 and (r, last) == (0, True)  # a digest of the message that states the plan
    other = session_turn([{"role": "user", "content": f"do that: {plan}"}])
    assert other[0] != key


def test_the_engine_load_is_the_largest_of_batch_held_requests_and_open_sessions():
    model = load_fault_model()
    config = RoleConfig("decode", {}, {})
    engine = DecodeEngine(model, config, 0.0, SimCounters(), random.Random(0))
    clock = Clock()
    engine.sessions = SessionLoad(idle_s=10.0, clock=clock)
    assert engine.modelled_load() == 0
    with engine.holding(), engine.holding():
        assert engine.modelled_load() == 2  # two requests held (e.g. benchmark requests: no session)
    cohort(engine.sessions, 5)
    for i in range(5):
        engine.sessions.end(f"s{i}", 0, last=False)  # all five between turns
    assert engine.modelled_load(1) == 5
