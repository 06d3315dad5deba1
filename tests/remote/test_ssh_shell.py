"""The SSH transport's persistent shell (ssh_shell.py, pooled by ssh.py), against the real loopback sshd
of conftest.py.

A command goes to a long-lived `sh` on the host instead of a session of its own. What must hold: the
answers are those of a session per command (and of the local transport), nothing carries over from
one command to the next, a timed-out command is killed with its shell, a dead shell is replaced
without running a command twice, threads get a shell each. The old path (`persistent_shell: false`)
stays under the transport contract too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import SshServer
from transport_contract import TransportContract

from orchestrator.remote import LocalTransport, SSHTransport, TransportError, make_transport
from orchestrator.remote.ssh_shell import frame

pytestmark = pytest.mark.ssh


def connect(server: SshServer, **ssh) -> SSHTransport:
    t = make_transport(server.host_cfg(**ssh))
    assert isinstance(t, SSHTransport)
    return t


def shell_pid(t: SSHTransport) -> int:
    """The pid of the shell that ran the command: the parent of its `sh -c`."""
    return int(t.run_shell('echo "$PPID"').stdout)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pids_running(argv: list[str]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().split(b"\0")[:-1] == [a.encode() for a in argv]:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class TestSessionPerCommand(TransportContract):
    """The old path, kept for the benchmark and as the fallback, meets the same contract."""

    @pytest.fixture
    def transport(self, sshd: SshServer) -> SSHTransport:
        with connect(sshd, persistent_shell=False) as t:
            yield t


# --- framing (pure) ---------------------------------------------------------------------------------


def test_a_frame_is_complete_only_with_its_end_marker_whatever_the_chunks() -> None:
    token = uuid.uuid4().hex
    other = uuid.uuid4().hex
    # no final newline, a marker of another command, a NUL and a byte that is not UTF-8
    payload = f"a\n{other} 0\n\0\xff".encode("latin-1") + b"\nno newline"
    answer = b"login noise\n" + f"{token}s\n".encode() + payload + f"\n{token} 7\n".encode()
    for cut in range(len(answer)):
        assert frame(answer[:cut], token) is None, cut
    assert frame(answer, token) == (payload, 7)
    assert frame(f"{token}s\n\n{token} 0\n".encode(), token) == (b"", 0)


# --- same answers as the local transport -------------------------------------------------------------

SAME_ANSWER = [
    "printf 'no final newline'",
    "printf 'x\\000y\\377z'; printf 'e\\377' >&2",
    "exit 255",
    "true",
    "cat; echo after-stdin",
    'echo "$0" $#',
    "printf '%s\\n' ü €; echo ünïcode >&2; exit 1",
    "python3 -c 'print(\"x\" * 300000)'",
]


@pytest.mark.parametrize("command", SAME_ANSWER)
def test_answers_equal_the_local_transports(sshd: SshServer, command: str) -> None:
    with connect(sshd) as t:
        assert t.run_shell(command) == LocalTransport().run_shell(command)


# --- one shell, no state carried over ------------------------------------------------------------------


def test_one_shell_serves_every_command_of_a_thread(sshd: SshServer) -> None:
    with connect(sshd) as t:
        pids = {shell_pid(t) for _ in range(20)}
        assert len(pids) == 1 and t.shells == 1 and t.connects == 1
        assert alive(pids.pop())


def test_nothing_carries_over_from_one_command_to_the_next(sshd: SshServer) -> None:
    with connect(sshd) as t:
        first = shell_pid(t)
        assert t.run_shell("cd / && X=1 && export Y=2 && umask 077 && exit 4").returncode == 4
        after = t.run_shell('pwd; echo "${X-unset} ${Y-unset}"; umask').stdout.split("\n")
        assert after[:2] == [os.path.expanduser("~"), "unset unset"]
        assert after[2] == LocalTransport().run_shell("umask").stdout.strip()
        assert shell_pid(t) == first  # `exit` ended the command, not the shell


def test_output_a_background_child_writes_later_stays_out_of_the_next_answer(sshd: SshServer) -> None:
    with connect(sshd) as t:
        left = t.run_shell("(sleep 0.3; echo late; echo late >&2) & echo now")
        assert (left.stdout, left.stderr) == ("now\n", "")
        assert (
            t.run_shell("sleep 0.6; echo next")
            == t.run_shell("echo next")
            == LocalTransport().run_shell("echo next")
        )


def test_login_shell_output_before_the_shell_starts_is_skipped(sshd: SshServer) -> None:
    # what a chatty ~/.bashrc does: print on both streams before the persistent sh takes over
    with connect(sshd) as t:
        t.shell_program = "echo motd; echo warning >&2; exec sh"
        result = t.run_shell("echo out; echo err >&2")
        assert (result.stdout, result.stderr) == ("out\n", "err\n")
        assert t.shells == 1


# --- timeouts, dead shells ------------------------------------------------------------------------------


def test_a_timed_out_command_is_killed_with_its_shell_and_the_next_gets_a_new_one(sshd: SshServer) -> None:
    sleeper = ["sleep", f"30.{os.getpid()}{time.monotonic_ns() % 10**6}"]
    with connect(sshd) as t:
        old = shell_pid(t)
        tmp = t._idle[0].tmp
        assert Path(tmp).is_dir()
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=r"did not finish within 0\.5s"):
            t.run_shell(" ".join(sleeper), timeout=0.5)
        assert time.monotonic() - t0 < 3.0
        assert wait_until(lambda: not pids_running(sleeper) and not alive(old) and not Path(tmp).exists())
        assert t.run_shell("echo ok").stdout == "ok\n"
        assert shell_pid(t) != old
        assert (t.shells, t.connects) == (2, 1)


def test_a_shell_killed_between_commands_is_replaced_without_an_error(
    sshd: SshServer, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    with connect(sshd) as t:
        for _ in range(3):
            old = shell_pid(t)
            os.kill(old, signal.SIGKILL)
            # at once: the transport may not know yet that the shell is gone
            assert t.run_shell(f"echo x >> {runs}; echo again").stdout == "again\n"
            assert shell_pid(t) != old
        assert runs.read_text() == "x\n" * 3  # each command ran once
        assert (t.shells, t.connects) == (4, 1)


def test_a_shell_that_dies_mid_command_is_an_error_not_a_second_run(sshd: SshServer, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    with connect(sshd) as t:
        with pytest.raises(TransportError, match="ended before the command did"):
            t.run_shell(f'echo x >> {runs}; kill -KILL "$PPID"; sleep 0.5')
        assert runs.read_text() == "x\n"
        assert t.run_shell("echo next").stdout == "next\n"


def test_threads_get_a_shell_each_within_max_sessions(sshd: SshServer) -> None:
    errors: list[BaseException] = []
    shells: set[int] = set()
    with connect(sshd, max_sessions=3) as t:

        def work(k: int) -> None:
            try:
                for i in range(3):
                    out = t.run_shell(f'sleep 0.1; echo "$PPID {k}-{i}"').stdout.split()
                    assert out[1] == f"{k}-{i}"
                    shells.add(int(out[0]))
            except BaseException as e:  # re-raised in the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert 2 <= len(shells) == t.shells <= 3
        assert t.connects == 1


def test_a_host_whose_shell_cannot_start_gets_a_session_per_command(
    sshd: SshServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="orchestrator.remote.ssh"), connect(sshd) as t:
        t.shell_program = "exec /nonexistent/sh"
        assert t.run_shell("echo out; exit 3") == LocalTransport().run_shell("echo out; exit 3")
        assert t.run_shell('echo "$0"').stdout == "sh\n"
        assert t.shells == 0
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "no persistent shell" in warnings[0] and "/nonexistent/sh" in warnings[0]


def test_close_ends_the_shell_and_removes_its_temp_dir(sshd: SshServer) -> None:
    t = connect(sshd)
    pid = shell_pid(t)
    tmp = t._idle[0].tmp
    t.close()
    assert wait_until(lambda: not alive(pid) and not Path(tmp).exists())
