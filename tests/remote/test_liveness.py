"""The liveness judgement (pure): the kernel is the authority on "gone"; `ps` alone never is."""

from __future__ import annotations

import contextlib
import os
import signal
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
    start_of,
)
from orchestrator.remote.local import LocalTransport

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


def test_parse_a_look_that_found_the_leader_running():
    assert parse_group_look("LEADER\nS R\nT 42 ticks after boot\n") == GroupLook(
        True, None, None, "42 ticks after boot", "R"
    )
    with pytest.raises(TransportError):  # cut short
        parse_group_look("LEADER\nS R\n")


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
        # the leader runs: /proc says so, and nothing else is looked at (no `ps -e` of every process)
        assert (look.leader_state, look.live, look.zombies) == ("S", None, None), look
        assert look.leader_started == f"{kernel_start_ticks(child.pid)} ticks after boot"
        assert judge_liveness(look) is Liveness.ALIVE
    finally:
        child.kill()
        child.wait()
    time.sleep(0.05)
    look = look_at(child.pid)
    assert not look.kernel_knows and look.live == 0, look  # the whole look: the leader is gone
    assert judge_liveness(look) is Liveness.GONE, look


def test_a_group_whose_leader_exited_is_counted_member_by_member():
    """A leader gone and its child running on (a server whose launcher exited): the look falls back to
    the kernel and `ps`, and counts the child."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(leader.communicate()[0].strip())
    try:
        look = look_at(leader.pid)
        assert look.kernel_knows and look.kernel_knows_after and (look.live, look.zombies) == (1, 0), look
        assert (look.leader_state, look.leader_started) == ("", "")
        assert judge_liveness(look, "123 ticks after boot") is Liveness.ALIVE
    finally:
        os.kill(child, 9)


def kernel_start_ticks(pid: int) -> str:
    """Field 22 of /proc/PID/stat, read by Python: past the last ')', since a name may hold one."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_the_start_is_the_kernels_tick_count_even_under_a_name_with_parentheses(tmp_path) -> None:
    """`start_of` reads /proc/PID/stat's field 22 past the last ") ": a command named "sl) eep 2" keeps
    its own spaces and parenthesis in field 2, and a split on spaces would read the wrong field."""
    odd = tmp_path / "sl) eep 2"
    odd.symlink_to(
        subprocess.run(["sh", "-c", "command -v sleep"], capture_output=True, text=True).stdout.strip()
    )
    child = subprocess.Popen([str(odd), "30"], start_new_session=True)
    try:
        with open(f"/proc/{child.pid}/stat") as f:
            assert "(sl) eep 2)" in f.read()
        said = subprocess.run(["sh", "-c", start_of(str(child.pid))], capture_output=True, text=True)
        assert said.stdout.strip() == f"{kernel_start_ticks(child.pid)} ticks after boot"
        assert look_at(child.pid).leader_started == said.stdout.strip()
    finally:
        child.kill()
        child.wait()
    gone = subprocess.run(["sh", "-c", start_of(str(child.pid))], capture_output=True, text=True)
    assert gone.stdout == ""  # a process gone has no start


def test_a_clock_correction_that_moves_ps_start_times_leaves_a_live_group_alive(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI at 316548b: a live prefill's leader read "20:57:27" from `ps -o lstart=` at its start and
    "20:57:28" later. procps adds the boot time of /proc/stat, which Linux recomputes at each read as the
    wall clock minus the time since boot, so a correction of the wall clock moves every lstart. The
    server was judged a recycled pid: its arm FAILED and the stop left it running. Here `ps` is a shim
    that passes everything to the real one but answers `-o lstart=` one second later at each call (an
    honest fake of that move, which this machine's clock cannot be made to do): the start recorded at
    launch still matches at every look, and the stop still stops the group."""
    real_ps = subprocess.run(["sh", "-c", "command -v ps"], capture_output=True, text=True).stdout.strip()
    shim = tmp_path / "bin"
    shim.mkdir()
    calls = tmp_path / "lstart-calls"
    # a start for a live pid only, one second later at each call; anything else to the real `ps`
    later = f'date -d "@$(( $(date +%s) + $(wc -l < {calls}) ))" "+%a %b %e %T %Y"'
    (shim / "ps").write_text(
        "#!/bin/sh\n"
        f'case "$*" in *lstart*) [ -n "$({real_ps} "$@")" ] || exit 1; '
        f"echo x >> {calls}; {later}; exit 0;; esac\n"
        f'exec {real_ps} "$@"\n'
    )
    (shim / "ps").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    transport = LocalTransport()
    pid = transport.start_detached(["sleep", "300"], {}, str(tmp_path / "s.log"), str(tmp_path / "s.pid"))
    try:
        recorded = (tmp_path / "s.pid").read_text().splitlines()[1]
        for _ in range(3):
            assert transport.group_liveness(pid, recorded) is Liveness.ALIVE
            assert transport.start_time(pid) == recorded
        assert transport.stop_group(pid, grace_s=5, started_at=recorded) is False  # TERM was enough
        assert transport.group_liveness(pid, recorded) is Liveness.GONE
    finally:
        # (never /usr/bin/kill with a negative pid: procps-ng 4.0.2's reads `kill -KILL -58` as group 5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
