"""The liveness judgement (pure): the kernel is the authority on "gone"; `ps` alone never is."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from orchestrator.remote.base import (
    GroupLook,
    Liveness,
    TransportError,
    judge_liveness,
    liveness_command,
    parse_group_look,
)

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
        # the kernel knew the group, `ps` listed nothing, then the kernel did not: its zombies were reaped
        # while `ps` ran, gone (a stopped server's group was once judged alive in that window)
        (GroupLook(True, 0, 0, "", "", kernel_knows_after=False), Liveness.GONE),
        # the leader was running when `ps` looked, whatever the kernel says after: alive at that look
        (GroupLook(True, 1, 0, STARTED, "S", kernel_knows_after=False), Liveness.ALIVE),
        # the pid now names another process: ours is gone
        (GroupLook(True, 1, 0, "Mon Jan  1 00:00:00 2001"), Liveness.RECYCLED),
    ],
)
def test_judge_liveness(look: GroupLook, expected: Liveness):
    assert judge_liveness(look, STARTED) is expected


def test_without_a_recorded_start_any_leader_counts():
    assert judge_liveness(GroupLook(True, 1, 0, "Mon Jan  1 00:00:00 2001"), "") is Liveness.ALIVE


def test_parse_a_look_with_and_without_a_leader():
    assert parse_group_look(f"KNOWN\n3\n0\nS Ss\nT {STARTED}\nKNOWN\n") == GroupLook(
        True, 3, 0, STARTED, "Ss"
    )
    assert parse_group_look("UNKNOWN\n0\n0\nS \nT \nUNKNOWN\n") == GroupLook(False, 0, 0, "", "", False)
    assert parse_group_look("KNOWN\n0\n0\nS \nT \nUNKNOWN\n").kernel_knows_after is False
    with pytest.raises(TransportError):  # an answer cut short is not a look
        parse_group_look(f"KNOWN\n3\n0\nS Ss\nT {STARTED}\n")


def look_at(pgid: int) -> GroupLook:
    """The look, run by a real shell on this host."""
    command = ["sh", "-c", liveness_command(pgid)]
    return parse_group_look(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def test_the_look_runs_in_a_shell_and_sees_a_live_group_then_a_gone_one():
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        look = look_at(child.pid)
        assert look.kernel_knows and look.kernel_knows_after and look.live == 1, look
        assert judge_liveness(look) is Liveness.ALIVE
    finally:
        child.kill()
        child.wait()
    time.sleep(0.05)
    look = look_at(child.pid)
    assert judge_liveness(look) is Liveness.GONE, look


@pytest.mark.parametrize(
    "started",
    [
        "Fri Dec  4 16:08:17 2026",  # `ps -o lstart=` in the C locale: the day of the month padded
        "4 Dez  2026 10:00:00",  # a start time that leads with a number (as a localized one might)
    ],
)
def test_the_look_reads_the_leaders_start_whole_from_one_ps_line(
    started: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look's one `ps -e` line of the leader is pid, pgid, state, then the start time with its own
    spaces: the start is what follows the third field, spaces kept, whatever it begins with (a start
    that leads with digits must not be matched inside the pid or pgid columns). A `ps` shim on the PATH
    prints the line: an honest fake of `ps`'s format, which the real `ps` of this machine cannot vary."""
    g = 4242
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ps").write_text(
        f"#!/bin/sh\nprintf '  {g}  {g} Ss   {started}\\n  4243  {g} S    {started}\\n'\n"
    )
    (shim / "ps").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    look = look_at(g)
    assert (look.leader_started, look.leader_state, look.live, look.zombies) == (started, "Ss", 2, 0)
    assert judge_liveness(look, started) is Liveness.ALIVE
