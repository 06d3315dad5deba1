"""The liveness judgement (pure): the kernel is the authority on "gone"; `ps` alone never is."""

from __future__ import annotations

import pytest

from orchestrator.remote.base import GroupLook, Liveness, judge_liveness, parse_group_look

STARTED = "Thu Dec  3 11:20:41 2026"


@pytest.mark.parametrize(
    ("look", "expected"),
    [
        (GroupLook(True, 2, 0, STARTED), Liveness.ALIVE),
        # ps listed nothing, the kernel knows the group: a miss of ps, alive (the bug of issue 32)
        (GroupLook(True, 0, 0, ""), Liveness.ALIVE),
        # the leader exited, its children run on
        (GroupLook(True, 1, 0, ""), Liveness.ALIVE),
        # only zombies, listed as such: gone (an unreaped group in a container without init)
        (GroupLook(True, 0, 2, STARTED), Liveness.GONE),
        (GroupLook(False, 0, 0, ""), Liveness.GONE),
        # the leader runs but has not made its group yet (before its `setsid`): alive (issue 32's campaign,
        # seed 2072488418: taken for exited, it was left running without its pid file)
        (GroupLook(False, 0, 0, STARTED, "S"), Liveness.ALIVE),
        # a zombie leader of an otherwise empty group: gone
        (GroupLook(True, 0, 1, STARTED, "Z"), Liveness.GONE),
        # the pid now names another process: ours is gone
        (GroupLook(True, 1, 0, "Mon Jan  1 00:00:00 2001"), Liveness.RECYCLED),
    ],
)
def test_judge_liveness(look: GroupLook, expected: Liveness):
    assert judge_liveness(look, STARTED) is expected


def test_without_a_recorded_start_any_leader_counts():
    assert judge_liveness(GroupLook(True, 1, 0, "Mon Jan  1 00:00:00 2001"), "") is Liveness.ALIVE


def test_parse_a_look_with_and_without_a_leader():
    assert parse_group_look(f"KNOWN\n3\n0\nS Ss\nT {STARTED}\n") == GroupLook(True, 3, 0, STARTED, "Ss")
    assert parse_group_look("UNKNOWN\n0\n0\nS \nT \n") == GroupLook(False, 0, 0, "", "")
